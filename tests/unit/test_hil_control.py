"""The node's test-control socket (edgerun/testing/control.py): what each command does, over a real unix socket,
and that a node started without ``--test-control`` has neither the socket nor the ``hilaccel`` engine key."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from edgerun.config import parse_config
from edgerun.errors import SourceError
from edgerun.node import Node
from edgerun.ota.updater import Updater
from edgerun.sources.replay import ReplaySource
from edgerun.testing.control import ACCELERATOR_PLAN, ControlledCamera, ControlServer
from tests.conftest import REPO
from tests.unit.test_ota_release import Fleet


@pytest.fixture
def control(tmp_path):
    """The server on a real node that is not built (no pipeline runs): its source and updater are made by hand."""
    fleet = Fleet(tmp_path / "fleet")
    cfg = parse_config(
        {
            "node": {"id": "n1"},
            "source": {"kind": "replay", "replay": {"width": 160, "height": 120}},
            "ota": {
                "enabled": True,
                "state_dir": str(tmp_path / "state"),
                "root_keys": fleet.root_pub_paths,
                "watch_dir": str(fleet.release_dir),
            },
        }
    )
    node = Node(cfg)
    node.source = source = ControlledCamera(ReplaySource(cfg.source.replay))  # as --test-control builds it
    node.updater = Updater(node, cfg.ota)
    node.updater.store.ensure_dirs()
    source.open()
    server = ControlServer(node, tmp_path / "c.sock")
    yield server, source
    server.set_skew(0.0)
    ACCELERATOR_PLAN.clear()
    source.close()


def test_camera_goes_and_comes_back(control):
    server, source = control
    image = np.zeros((120, 160, 3), np.uint8)
    assert source.read(image, 0) is not None
    server.handle({"cmd": "camera", "present": False})
    with pytest.raises(SourceError, match="camera disconnected"):
        source.read(image, 1)
    with pytest.raises(SourceError):
        source.open()  # the pipeline's reopen fails too while it is gone
    assert server.handle({"cmd": "state"})["camera_present"] is False
    server.handle({"cmd": "camera", "present": True})
    assert source.read(image, 2) is not None


def test_clock_skew_moves_the_wall_clock_and_back(control):
    server, _ = control
    server.handle({"cmd": "clock_skew", "seconds": 30})
    assert time.time() - time.monotonic() == pytest.approx(server_offset() + 30, abs=0.5)
    server.handle({"cmd": "clock_skew", "seconds": 0})
    assert time.time() - time.monotonic() == pytest.approx(server_offset(), abs=0.5)


def server_offset() -> float:
    from edgerun.testing import control as module

    return module._real_time() - time.monotonic()


def test_accelerator_and_power_cut_commands_arm_the_faults(control):
    server, _ = control
    assert server.handle({"cmd": "accelerator", "mode": "raise"})["accelerator"] == "raise"
    assert server.handle({"cmd": "accelerator", "mode": "clear"})["accelerator"] == "ok"
    assert server.handle({"cmd": "ota_crash_at", "step": "staged"})["ota_crash_at"] == "staged"
    store = server.node.updater.store
    store.journal(1, "begin")  # not the armed step: the process lives on
    pid = os.fork()
    if pid == 0:  # the child journals the armed step and must die right after it is on disk
        try:
            store.journal(1, "staged")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert [r["step"] for r in store.journal_records()] == ["begin", "staged"]
    without_ota = ControlServer(Node(parse_config({})), server.path)
    with pytest.raises(ValueError, match="OTA is not enabled"):
        without_ota.handle({"cmd": "ota_crash_at", "step": "staged"})
    with pytest.raises(ValueError, match="unknown OTA step 'lunch'"):
        server.handle({"cmd": "ota_crash_at", "step": "lunch"})
    with pytest.raises(ValueError, match="unknown fault mode 'melt'"):
        server.handle({"cmd": "accelerator", "mode": "melt"})
    with pytest.raises(ValueError, match="unknown command 'dance'"):
        server.handle({"cmd": "dance"})


def test_the_socket_answers_one_json_line_and_refuses_garbage(control):
    server, _ = control

    async def exchange(payload: bytes) -> dict:
        reader, writer = await asyncio.open_unix_connection(str(server.path))
        writer.write(payload)
        await writer.drain()
        line = await reader.readline()
        writer.close()
        return json.loads(line)

    async def main() -> list[dict]:
        await server.start()
        try:
            assert oct(server.path.stat().st_mode & 0o777) == "0o600"
            return [
                await exchange(p) for p in (b'{"cmd": "ping"}\n', b"not json\n", b"[1, 2]\n", b'{"cmd": "camera"}\n')
            ]
        finally:
            await server.stop()

    ping, garbage, array, missing = asyncio.run(main())
    assert ping == {"ok": True, "node": "n1", "pid": os.getpid()}
    assert garbage["ok"] is False and array == {"ok": False, "error": "expected a JSON object"}
    assert missing == {"ok": False, "error": "'present'"}
    assert not server.path.exists()


def test_without_test_control_the_accelerator_key_does_not_exist(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[engine]\norder = ["hilaccel", "tflite"]\n')
    result = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgerun: error: {cfg}: engine.order[0]: expected one of ")
    assert lines[0].endswith("got 'hilaccel'")


def test_slow_cpu_stands_in_for_a_weaker_board_and_refuses_a_bad_delay(monkeypatch):
    """hilcpu: the real TFLite engine whose every call waits the configured delay first (a test double for a
    weaker board's CPU); its detections are the CPU engine's own."""
    from edgerun.engines.base import EngineOptions
    from edgerun.engines.tflite import TFLiteEngine
    from edgerun.testing.control import SLOW_CPU_DELAY_ENV, SlowCpu

    model = REPO / ".cache" / "models" / "blazeface_short" / "model.tflite"
    if not model.exists():
        pytest.skip("the demo bundle is not under .cache/models (make models)")
    monkeypatch.setenv(SLOW_CPU_DELAY_ENV, "40")
    slow = SlowCpu(model, EngineOptions())
    reference = TFLiteEngine(model, EngineOptions(num_threads=1))
    try:
        assert slow.KEY == "hilcpu" and slow.plan.delay_s == pytest.approx(0.04)
        assert (slow.cpu_threads, slow.concurrent_calls) == (1, 1)
        tensor = np.random.default_rng(7).random(reference.input_spec.shape, dtype=np.float32)
        for ours, theirs in zip(slow.infer(tensor), reference.infer(tensor)):
            assert np.array_equal(ours, theirs)
        assert slow.plan.calls == 1
    finally:
        slow.close()
        reference.close()
    monkeypatch.setenv(SLOW_CPU_DELAY_ENV, "fast")
    with pytest.raises(ValueError, match="EDGERUN_TEST_CPU_DELAY_MS: expected milliseconds, got 'fast'"):
        SlowCpu(model, EngineOptions())

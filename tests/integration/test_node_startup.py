"""Starting the real node as systemd would: READY once built, a stop during a slow accelerator open, and
the checks that run before any heavy work. Real processes, a real unix datagram NOTIFY_SOCKET, real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgerun.engines.breadcrumb import Breadcrumbs
from edgerun.testing.faults import OPEN_STALL_ENV
from tests.conftest import REPO, free_port
from tests.integration.test_node import REPLAY, NodeProcess, write_config

WAIT_S = 60.0  # generous: node start on a shared 2-core machine

MISSING_CAMERA = """[source]
kind = "opencv"
uri = "/dev/video99"
reopen_backoff_s = 0.2
reopen_backoff_max_s = 0.5
"""


@pytest.fixture
def started():
    procs: list = []
    yield procs
    for proc in procs:
        if isinstance(proc, NodeProcess):
            proc.stop()
        elif proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_missing_camera_at_boot_is_ready_and_degraded(tmp_path, started, blazeface_bundle):
    """systemd (Type=notify) must see READY=1 although no frame can come: the node is up and says why not."""
    n = NodeProcess(tmp_path, source=MISSING_CAMERA)
    started.append(n)
    n.recv_notify("READY=1", timeout=WAIT_S)
    n.wait_http()
    status, _, body = n.get("/healthz")
    health = json.loads(body)
    assert status == 200 and health["state"] == "degraded"
    assert "/dev/video99" in health["reasons"]["source"]
    metrics = n.get("/metrics")[2].decode()
    inferred = [line for line in metrics.splitlines() if line.startswith("edgerun_frames_inferred_total ")]
    assert inferred and float(inferred[0].split()[1]) == 0  # ready without a single frame
    # READY=1 means built and serving; /readyz means inferring, so it answers 503 until a first frame.
    assert n.get("/readyz")[0] == 503
    # systemctl status shows why: the STATUS= line names the degraded part and its reason.
    n.recv_notify("STATUS=degraded (", timeout=WAIT_S)
    status_line = next(m for m in n.messages if "STATUS=degraded (" in m).split("STATUS=", 1)[1].splitlines()[0]
    assert status_line.startswith("degraded (source: ") and "/dev/video99" in status_line, status_line
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(WAIT_S) == 0


BOOTSTRAP = """
import sys
from edgerun.engines import base
base.ENGINE_MODULES["slowopen"] = "edgerun.testing.faults:OpenStallEngine"
from edgerun.cli import main
sys.exit(main(["run", "-c", sys.argv[1]]))
"""


def test_sigterm_during_a_slow_accelerator_open_is_a_clean_stop(tmp_path, started, blazeface_bundle):
    """A stop while the accelerator opens exits 0 and leaves no breadcrumb blaming the engine."""
    bundle = tmp_path / "bundle"
    shutil.copytree(blazeface_bundle.root, bundle)
    manifest = bundle / "model.toml"
    manifest.write_text(manifest.read_text().replace("[variants]\n", '[variants]\nslowopen = "model.tflite"\n'))
    state = tmp_path / "state"
    stall = tmp_path / "stall"
    stall.touch()
    extra = f'[model]\nbundle = "{bundle}"\n[engine]\norder = ["slowopen"]\nstate_dir = "{state}"\n'
    cfg = write_config(tmp_path, REPLAY, free_port(), extra=extra)
    (tmp_path / "bootstrap.py").write_text(BOOTSTRAP)
    env = dict(os.environ, PYTHONPATH=str(REPO), **{OPEN_STALL_ENV: str(stall)})
    env.pop("NOTIFY_SOCKET", None)
    stderr = tmp_path / "stderr.log"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "bootstrap.py"), str(cfg)],
        cwd=str(REPO),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr.open("w"),
    )
    started.append(proc)
    end = time.monotonic() + WAIT_S
    opening = Path(str(stall) + ".opening")
    while not opening.exists():
        assert proc.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() < end, "the node never began opening the accelerator"
        time.sleep(0.02)
    assert read_count(state / "inflight-slowopen") == 1  # inside the open, the breadcrumb is armed
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT_S) == 0, stderr.read_text()[-3000:]
    log = stderr.read_text()
    assert "Traceback" not in log
    assert not list(state.glob("inflight-*"))  # a clean stop: nothing in flight is left to blame
    assert Breadcrumbs(state).recover() == {}  # the next start begins on the accelerator, not the fallback
    assert not (state / "engine-state.json").exists()


def read_count(path: Path) -> int:
    from edgerun.engines.breadcrumb import read_inflight

    record = read_inflight(path)
    return record[0] if record is not None else -1


def test_a_config_mistake_is_found_before_the_model_loads(tmp_path):
    """A TLS CA that is not a PEM file fails in the preflight: exit 2, one line, no engine ever opened."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    extra = f'[sinks.mqtt]\nenabled = true\nport = {free_port()}\ntls_ca = "{ca}"\n'
    cfg = write_config(tmp_path, REPLAY, free_port(), extra=extra)
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("edgerun: error: sinks.mqtt.tls_ca: ") and str(ca) in lines[-1]
    assert "XNNPACK" not in proc.stderr  # TFLite never created an interpreter: the model was not loaded
    assert "Traceback" not in proc.stderr


def test_build_then_serve_in_process(tmp_path, astronaut_rgb, blazeface_bundle):
    """``await node.build()`` opens and warms everything but starts nothing; ``await node.serve()`` serves."""
    import asyncio

    import cv2

    from edgerun.config import parse_config
    from edgerun.node import Node
    from tests.integration.jsonl import read_records

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(6):
        cv2.imwrite(str(photos / f"{i}.png"), cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR))
    out = tmp_path / "d.jsonl"
    cfg = parse_config(
        {
            "node": {"id": "in-process"},
            "source": {"kind": "images", "path": str(photos), "loop": False, "fps": 0},
            "model": {"bundle": str(blazeface_bundle.root)},
            "pipeline": {"policy": "block"},
            "sinks": {"jsonl": {"path": str(out)}},
            "service": {"http_enabled": False},
        }
    )
    node = Node(cfg)

    async def main() -> int:
        assert await node.build()
        assert node.pipeline is not None and node.failover is not None
        assert node.failover.active_key == "tflite"  # open and warm...
        assert node.sinks == [] and not out.exists()  # ...but nothing is served yet
        assert node.stats.captured == 0
        return await node.serve()  # until the images run out

    assert asyncio.run(main()) == 0
    batches = [r for r in read_records(out) if r["schema"] == "edgerun.detections/1"]
    assert [b["seq"] for b in batches] == list(range(6))
    assert all(len(b["detections"]) == 1 for b in batches)  # the astronaut's face in every frame

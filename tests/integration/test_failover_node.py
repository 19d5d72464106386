"""Failover in the real node process: a wedged accelerator mid-stream, and a process killed inside a call.

The "accelerator" is the real ONNX Runtime engine running the real BlazeFace
model (converted from the bundle's TFLite model), registered in the node
subprocess under the key "flaky" by a small bootstrap script. ``FlakyOnnxEngine``
is a test engine: while the file named by ``$EDGERUN_TEST_WEDGE`` exists, its
calls block, like a driver that stopped answering; removing the file heals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install edgerun[onnx])")
pytest.importorskip("tflite2onnx", reason="tflite2onnx not installed (pip install edgerun[onnx])")

from edgerun.engines.breadcrumb import read_inflight
from edgerun.engines.onnx import OnnxEngine
from tests.conftest import REPO, free_port
from tests.integration.jsonl import read_records
from tests.unit.test_onnx_engine import bundle_with_onnx

WAIT_S = 60.0  # generous: node start and a shared 2-core machine


class FlakyOnnxEngine(OnnxEngine):
    """TEST ENGINE: the real ONNX engine, wedged while the file named by $EDGERUN_TEST_WEDGE exists."""

    KEY = "flaky"

    def infer(self, tensor: np.ndarray, outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        flag = os.environ.get("EDGERUN_TEST_WEDGE", "")
        while flag and os.path.exists(flag):
            time.sleep(0.005)
        return super().infer(tensor, outputs)


BOOTSTRAP = """
import sys
from edgerun.engines import base
base.ENGINE_MODULES["flaky"] = "tests.integration.test_failover_node:FlakyOnnxEngine"
from edgerun.cli import main
sys.exit(main(["run", "-c", sys.argv[1]]))
"""


class FailoverNode:
    """``edgerun run`` in a subprocess with the flaky engine first in ``engine.order``."""

    def __init__(self, tmp: Path, bundle_root: Path, hang_deadline_ms: int, run: int) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.jsonl = tmp / f"run{run}.jsonl"
        self.wedge = tmp / "wedge"
        self.state = tmp / "state"
        cfg = tmp / f"run{run}.toml"
        cfg.write_text(
            f"""[node]
id = "failover-node"
[source]
kind = "replay"
fps = 20
[model]
bundle = "{bundle_root}"
[engine]
order = ["flaky"]
num_threads = 1
hang_deadline_ms = {hang_deadline_ms}
reprobe_min_s = 0.5
reprobe_max_s = 5.0
state_dir = "{self.state}"
[sinks.jsonl]
path = "{self.jsonl}"
[service]
http_port = {self.port}
stall_s = 30.0
"""
        )
        script = tmp / "bootstrap.py"
        script.write_text(BOOTSTRAP)
        env = dict(os.environ, EDGERUN_TEST_WEDGE=str(self.wedge), PYTHONPATH=str(REPO))
        env.pop("NOTIFY_SOCKET", None)
        self.stderr_path = tmp / f"run{run}.stderr"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(cfg)],
            cwd=str(REPO),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr_path.open("w"),
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"node exited with {self.proc.returncode}: {self.stderr_path.read_text()[-3000:]}")

    def records(self) -> list[dict]:
        return read_records(self.jsonl)

    def engines(self) -> list[str]:
        return [r["model"]["engine"] for r in self.records() if r["schema"] == "edgerun.detections/1"]

    def events(self, kind: str = "engine") -> list[dict]:
        return [r for r in self.records() if r["schema"] == "edgerun.event/1" and r["kind"] == kind]

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def health(self) -> dict:
        return json.loads(self.get("/healthz")[1])

    def metric(self, line_start: str) -> float | None:
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        return None

    def wait(self, what: str, predicate, timeout: float = WAIT_S):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check_alive()
            try:
                value = predicate()
            except (urllib.error.URLError, ConnectionError, ValueError):
                value = None
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; stderr: {self.stderr_path.read_text()[-3000:]}")

    def wait_for_engine(self, key: str, after: int, count: int = 3) -> None:
        self.wait(f"{count} batches from {key}", lambda: self.engines()[after:].count(key) >= count)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def onnx_bundle_root(tmp_path_factory, blazeface_bundle) -> Path:
    root = bundle_with_onnx(blazeface_bundle, tmp_path_factory.mktemp("bundle"))
    text = (root / "model.toml").read_text()
    (root / "model.toml").write_text(text.replace("[variants]\n", '[variants]\nflaky = "model.onnx"\n'))
    return root


@pytest.fixture
def nodes(tmp_path, onnx_bundle_root):
    started: list[FailoverNode] = []

    def start(hang_deadline_ms: int) -> FailoverNode:
        node = FailoverNode(tmp_path, onnx_bundle_root, hang_deadline_ms, run=len(started))
        started.append(node)
        return node

    yield start
    (tmp_path / "wedge").unlink(missing_ok=True)
    for node in started:
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(10)


def test_wedged_accelerator_fails_over_in_the_node_and_switches_back(nodes):
    node = nodes(hang_deadline_ms=400)
    node.wait_for_engine("flaky", after=0)
    assert node.health()["state"] == "running"

    node.wedge.touch()
    wedged_at = len(node.engines())
    node.wait_for_engine("tflite", after=wedged_at)  # detections go on from the CPU
    health = node.health()
    assert health["state"] == "degraded"
    assert "serving on tflite: flaky hang" in health["reasons"]["engine"]
    failover = node.wait("failover event", lambda: [e for e in node.events() if e["event"] == "failover"])
    assert failover[0]["from"] == "flaky" and failover[0]["to"] == "tflite"
    assert node.metric('edgerun_engine_active{engine="tflite"}') == 1.0
    assert node.metric('edgerun_engine_active{engine="flaky"}') == 0.0
    assert node.metric("edgerun_failovers_total") == 1.0
    assert node.metric('edgerun_frames_dropped_total{reason="engine_hang",stage="infer"}') == 1.0

    node.wedge.unlink()
    healed_at = len(node.engines())
    node.wait_for_engine("flaky", after=healed_at)
    node.wait("health running again", lambda: node.health()["state"] == "running")
    assert [e["event"] for e in node.events()][-1] == "switch_back"
    assert node.metric("edgerun_fallback_seconds_total") > 0.0
    lost = sum(
        node.metric(f'edgerun_frames_dropped_total{{reason="{r}",stage="infer"}}') or 0.0
        for r in ("engine_hang", "engine_error", "failover")
    )
    assert 1.0 <= lost <= 3.0  # at most the frames in flight (queue depth 1 + preprocess + infer)

    assert node.stop() == 0
    assert not list(node.state.glob("inflight-*"))  # a clean exit leaves no breadcrumb


def test_killed_inside_an_accelerator_call_restarts_on_the_fallback(nodes):
    first = nodes(hang_deadline_ms=600_000)  # a wedge nobody notices in time: systemd's watchdog kills it
    first.wait_for_engine("flaky", after=0)
    first.wedge.touch()
    breadcrumb = first.state / "inflight-flaky"
    first.wait("an accelerator call in flight", lambda: (read_inflight(breadcrumb) or (0,))[0] >= 1)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert first.proc.returncode == -signal.SIGKILL
    assert read_inflight(breadcrumb)[0] >= 1  # the breadcrumb outlives the process

    first.wedge.unlink()  # the "driver" works again after the restart
    second = nodes(hang_deadline_ms=600_000)
    second.wait_for_engine("tflite", after=0, count=1)
    assert second.engines()[0] == "tflite"  # started on the fallback, without touching the suspect
    started = second.wait("start event", lambda: [e for e in second.events() if e["event"] == "start_degraded"])
    assert started[0]["from"] == "flaky" and "crashed the process" in started[0]["reason"]
    assert json.loads((second.state / "engine-state.json").read_text())["crashes"] == {"flaky": 1}
    # Re-probed after the crash backoff (0.5 s x 2): it passes its warm-up and serves again.
    second.wait_for_engine("flaky", after=0)
    second.wait("health running", lambda: second.health()["state"] == "running")
    assert any(e["event"] == "switch_back" for e in second.events())
    assert second.stop() == 0

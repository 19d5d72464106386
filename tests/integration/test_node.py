"""The real node as a subprocess: real model, real HTTP, real sd_notify socket, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.jsonl import read_records


def write_config(tmp_path: Path, source: str, http_port: int, extra: str = "") -> Path:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        f"""[node]
id = "test-node"
log_level = "info"
{source}
[sinks.jsonl]
path = "{tmp_path / "detections.jsonl"}"
[service]
http_port = {http_port}
stall_s = 1.0
{extra}
"""
    )
    return cfg


REPLAY = """[source]
kind = "replay"
fps = 20
"""


class NodeProcess:
    def __init__(self, tmp_path: Path, source: str = REPLAY, extra: str = "") -> None:
        self.tmp = tmp_path
        self.port = free_port()
        self.jsonl = tmp_path / "detections.jsonl"
        self.notify_path = tmp_path / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.settimeout(0.2)
        cfg = write_config(tmp_path, source, self.port, extra)
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path), WATCHDOG_USEC="1000000")
        self.stderr_path = tmp_path / "stderr.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr_path.open("w"),
            env=env,
        )
        self.messages: list[str] = []

    def recv_notify(self, until: str, timeout: float = 30.0, alive: bool = True) -> list[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                self.messages.append(self.notify.recv(4096).decode())
            except TimeoutError:
                pass
            if any(until in m for m in self.messages):
                return self.messages
            if alive:
                self.check_alive()
        raise AssertionError(f"no {until!r} from sd_notify; got {self.messages}")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"node exited with {self.proc.returncode}: {self.stderr_path.read_text()[-2000:]}")

    def get(self, path: str) -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Content-Type", ""), err.read()

    def wait_http(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check_alive()
            try:
                self.get("/healthz")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        raise AssertionError("HTTP never answered")

    def records(self) -> list[dict]:
        return read_records(self.jsonl)

    def lines(self) -> list[dict]:
        """The detection batches (the same file also carries node events)."""
        return [r for r in self.records() if r["schema"] == "edgerun.detections/1"]

    def events(self) -> list[dict]:
        return [r for r in self.records() if r["schema"] == "edgerun.event/1"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.notify.close()


@pytest.fixture
def node(tmp_path, blazeface_bundle):
    started: list[NodeProcess] = []

    def start(**kwargs) -> NodeProcess:
        n = NodeProcess(tmp_path, **kwargs)
        started.append(n)
        return n

    yield start
    for n in started:
        n.stop()


def test_node_detects_serves_http_and_notifies_systemd(node):
    n = node()
    n.recv_notify("READY=1")
    n.wait_http()
    # Detections appear, with the documented schema and real faces from the replay.
    end = time.monotonic() + 30
    while time.monotonic() < end and not any(b["detections"] for b in n.lines()):
        time.sleep(0.2)
    batches = n.lines()
    assert batches, "no batches written"
    first = batches[0]
    assert first["schema"] == "edgerun.detections/1"
    assert first["node"] == "test-node"
    assert first["model"] == {"name": "blazeface_short", "version": 1, "engine": "tflite"}
    assert first["pose"] is not None
    faces = [d for b in batches for d in b["detections"]]
    assert faces and all(d["label"] == "face" and 0.5 <= d["score"] <= 1.0 for d in faces)
    x1, y1, x2, y2 = faces[0]["box"]
    assert 0 <= x1 < x2 <= 640 and 0 <= y1 < y2 <= 480

    status, ctype, body = n.get("/healthz")
    assert status == 200 and json.loads(body)["state"] == "running", body
    status, _, body = n.get("/readyz")
    assert status == 200
    status, ctype, body = n.get("/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    text = body.decode()
    inferred = [line for line in text.splitlines() if line.startswith("edgerun_frames_inferred_total ")]
    assert inferred and float(inferred[0].split()[1]) > 0
    assert 'edgerun_health_state{state="running"} 1.0' in text
    assert "edgerun_stage_seconds_bucket" in text
    # A live source (drop_oldest) gets one interpreter on every core, so one worker.
    assert "edgerun_pipeline_workers 1.0" in text
    status, ctype, body = n.get("/snapshot.jpg")
    assert status == 200 and ctype == "image/jpeg" and body[:2] == b"\xff\xd8"

    msgs = n.recv_notify("WATCHDOG=1")
    assert any(m.startswith("STATUS=") or "\nSTATUS=" in m for m in msgs)


def test_sigterm_exits_zero_and_flushes_frames_in_flight(node):
    n = node()
    n.recv_notify("READY=1")
    time.sleep(1.0)
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(10) == 0
    log = n.stderr_path.read_text()
    # Inside its budget (service.shutdown_timeout_s): the drain ended by itself, not on the node's deadline.
    assert "did not drain" not in log and "Traceback" not in log
    summary = json.loads(log.split("stopped: ", 1)[1].splitlines()[0])
    written = n.lines()
    # Every batch the node handed to its sinks is in the file, and every captured frame is accounted for.
    assert len(written) == summary["frames"] > 0
    assert summary["captured"] == summary["frames"] + summary["dropped"]
    assert any("STOPPING=1" in m for m in n.recv_notify("STOPPING=1", timeout=2, alive=False))
    states = [e["state"] for e in n.events() if e["kind"] == "health"]
    assert states[0] == "running" and states[-1] == "stopping"


def test_missing_camera_keeps_the_node_up_and_degraded(node):
    source = """[source]
kind = "opencv"
uri = "/dev/video99"
reopen_backoff_s = 0.2
reopen_backoff_max_s = 0.5
"""
    n = node(source=source)
    n.wait_http()
    time.sleep(1.5)
    n.check_alive()
    status, _, body = n.get("/healthz")
    health = json.loads(body)
    assert status == 200
    assert health["state"] == "degraded"
    assert "source" in health["reasons"] and "/dev/video99" in health["reasons"]["source"]
    text = n.get("/metrics")[2].decode()
    assert 'edgerun_health_state{state="degraded"} 1.0' in text
    errors = [line for line in text.splitlines() if line.startswith("edgerun_frames_inferred_total ")]
    assert errors and float(errors[0].split()[1]) == 0
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(10) == 0


def test_corrupt_model_is_one_clear_line(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "model.tflite").write_bytes(b"not a flatbuffer at all")
    (bundle / "model.toml").write_text(
        'name = "broken"\nversion = 1\nlabels = ["x"]\n[decoder]\nkind = "mediapipe_ssd"\n'
        '[variants]\ntflite = "model.tflite"\n'
    )
    cfg = write_config(tmp_path, REPLAY, free_port(), extra=f'[model]\nbundle = "{bundle}"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2  # a person must fix the model: systemd does not restart it in a loop
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"edgerun: error: {bundle / 'model.tflite'}: not a loadable TFLite model")
    assert "WARNING" not in proc.stderr  # no warning line before it repeating the error
    assert "Traceback" not in proc.stderr


def test_broker_unreachable_at_start_node_runs_and_names_the_sink(node):
    """The MQTT broker is not there: detections still reach the JSONL sink and health names the sink."""
    dead_port = free_port()
    n = node(extra=f"[sinks.mqtt]\nenabled = true\nport = {dead_port}\nreconnect_max_s = 0.5\n")
    n.recv_notify("READY=1")
    n.wait_http()
    end = time.monotonic() + 20
    health = {}
    while time.monotonic() < end:
        health = json.loads(n.get("/healthz")[2])
        if "sink.mqtt" in health["reasons"]:
            break
        time.sleep(0.2)
    assert health["state"] == "degraded"
    assert f"127.0.0.1:{dead_port}" in health["reasons"]["sink.mqtt"]
    end = time.monotonic() + 20
    while not n.lines() and time.monotonic() < end:
        time.sleep(0.1)  # the JSONL writer thread flushes on its own schedule
    assert n.lines(), "detections must still flow to the other sinks"
    metrics = n.get("/metrics")[2].decode()
    assert 'edgerun_sink_connected{sink="mqtt"} 0.0' in metrics
    assert 'edgerun_sink_connected{sink="jsonl"} 1.0' in metrics


def test_node_publishes_to_a_real_broker(node):
    """A real mosquitto on a loopback port: mosquitto_sub sees the retained status and the detections."""
    from edgerun.sinks.mosquitto import run_mosquitto

    with run_mosquitto() as broker:
        n = node(extra=f"[sinks.mqtt]\nenabled = true\nport = {broker.port}\nqos_detections = 1\n")
        n.recv_notify("READY=1")
        sub = subprocess.run(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-V",
                "mqttv5",
                "-t",
                "edgerun/test-node/#",
                "-v",
                "-C",
                "6",
                "-W",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        topics = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in sub.stdout.splitlines()}
        assert topics.get("edgerun/test-node/status") == "online"
        payload = json.loads(topics["edgerun/test-node/detections"])
        assert payload["schema"] == "edgerun.detections/1" and payload["node"] == "test-node"
        n.proc.send_signal(signal.SIGTERM)
        assert n.proc.wait(10) == 0
        retained = subprocess.run(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-t",
                "edgerun/test-node/status",
                "-C",
                "1",
                "-W",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert retained.stdout.strip() == "stopped"  # a clean shutdown says goodbye itself, not as its will


def test_camera_that_disappears_is_reopened_and_the_node_recovers(node, tmp_path, astronaut_rgb):
    """A looping video file removed mid-run stands in for a camera unplugged and plugged back."""
    import cv2

    video = tmp_path / "cam.avi"
    frame = cv2.cvtColor(cv2.resize(astronaut_rgb, (320, 240)), cv2.COLOR_RGB2BGR)
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (320, 240))
    for _ in range(5):
        writer.write(frame)
    writer.release()
    backup = video.read_bytes()
    source = f"""[source]
kind = "opencv"
uri = "{video}"
loop = true
fps = 30
reopen_backoff_s = 0.1
reopen_backoff_max_s = 0.3
"""
    n = node(source=source)
    n.recv_notify("READY=1")
    n.wait_http()

    def state() -> dict:
        return json.loads(n.get("/healthz")[2])

    def wait(predicate, timeout=20.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = state()
            if predicate(h):
                return h
            time.sleep(0.1)
        raise AssertionError(f"health never matched; last {h}")

    wait(lambda h: h["state"] == "running")
    video.unlink()
    gone = wait(lambda h: h["state"] == "degraded" and "source" in h["reasons"])
    assert "cam.avi" in gone["reasons"]["source"]
    n.check_alive()
    before = len(n.lines())
    video.write_bytes(backup)
    wait(lambda h: h["state"] == "running")
    end = time.monotonic() + 10
    while len(n.lines()) <= before and time.monotonic() < end:
        time.sleep(0.1)
    assert len(n.lines()) > before  # frames flow again after the reopen
    text = n.get("/metrics")[2].decode()
    errors = [line for line in text.splitlines() if line.startswith("edgerun_source_errors_total ")]
    assert errors and float(errors[0].split()[1]) >= 1

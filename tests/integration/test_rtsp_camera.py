"""A real node against a real RTSP camera (GStreamer's RTSP server) that is killed and restarted.

The node connects with credentials in its URL, detects the face in the served picture, goes ``degraded`` with
the reason when the server is SIGKILLed, reconnects with backoff in the same process, counts the frames lost,
and never shows the password: not in its log, its JSONL payloads, /healthz or /metrics. The reconnect time is
measured and printed (``rtsp reconnect: {...}``), not asserted.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.errors import SourceError
from edgerun.sources.opencv import OpenCvSource
from edgerun.testing.ports import free_port
from tests.integration.rtsp_camera import RtspCamera, require_rtsp_server
from tests.integration.test_node import NodeProcess

PASSWORD = "s3cret-Pa55"


@pytest.fixture
def camera(tmp_path: Path, astronaut_rgb):
    require_rtsp_server()
    image = tmp_path / "face.png"
    cv2.imwrite(str(image), cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR))
    cam = RtspCamera(free_port(), image, "viewer", PASSWORD)
    cam.start()
    yield cam
    cam.stop()


def test_a_wrong_password_is_one_line_without_it(camera):
    src = OpenCvSource(camera.url(password="wrong-guess"), open_timeout_s=3.0)
    with pytest.raises(SourceError) as err:
        src.open()
    assert str(err.value) == (
        f"stream 'rtsp://viewer:***@127.0.0.1:{camera.port}/cam' (ffmpeg) could not be opened: "
        f"127.0.0.1:{camera.port} answers, but the stream did not open (check its path and credentials)"
    )
    # ... and the right one opens the same server, over TCP and over UDP.
    for transport in ("tcp", "udp"):
        src = OpenCvSource(camera.url(), transport=transport, open_timeout_s=5.0)
        src.open()
        try:
            assert (src.width, src.height) == (640, 480)
            image = np.zeros((480, 640, 3), np.uint8)
            assert src.read(image, 0) is not None and image.mean() > 20  # the picture, not a black frame
        finally:
            src.close()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("transport", ["tcp", "udp"])
def test_node_rides_out_an_rtsp_camera_killed_and_restarted(camera, tmp_path, blazeface_bundle, transport):
    source = f"""[source]
kind = "opencv"
uri = "{camera.url()}"
transport = "{transport}"
open_timeout_s = 3.0
read_timeout_s = 2.0
reopen_backoff_s = 0.2
reopen_backoff_max_s = 1.0
"""
    n = NodeProcess(tmp_path, source=source)
    try:
        n.recv_notify("READY=1")
        n.wait_http()

        def health() -> dict:
            return json.loads(n.get("/healthz")[2])

        def wait_for(predicate, what: str, timeout: float = 30.0) -> dict:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                n.check_alive()
                h = health()
                if predicate(h):
                    return h
                time.sleep(0.05)
            raise AssertionError(f"never {what}; last health {health()}")

        def faces() -> int:
            return sum(len(b["detections"]) for b in n.lines())

        wait_for(lambda h: h["state"] == "running", "running")
        end = time.monotonic() + 30
        while faces() == 0 and time.monotonic() < end:
            time.sleep(0.2)
        found = [d for b in n.lines() for d in b["detections"]]
        assert found and all(d["label"] == "face" for d in found)  # the astronaut's face, through RTSP
        pid = n.proc.pid

        camera.kill()
        t_killed = time.monotonic()
        down = wait_for(lambda h: h["state"] == "degraded" and "source" in h["reasons"], "degraded")
        t_degraded = time.monotonic()
        reason = down["reasons"]["source"]
        assert f"rtsp://viewer:***@127.0.0.1:{camera.port}/cam" in reason and PASSWORD not in reason
        # Down long enough for a few reconnect tries to be refused (the reason then says so).
        wait_for(lambda h: "connection refused" in h["reasons"].get("source", ""), "refused", timeout=10)
        batches_down = len(n.lines())

        camera.start()
        t_restarted = time.monotonic()
        end = time.monotonic() + 30
        while len(n.lines()) <= batches_down and time.monotonic() < end:
            time.sleep(0.02)
        t_frames = time.monotonic()
        assert len(n.lines()) > batches_down  # frames flow again
        # Running again (also after the watchdog's stall check, which looks every half WATCHDOG_USEC, sees them).
        wait_for(lambda h: h["state"] == "running", "running again")
        t_running = time.monotonic()
        assert n.proc.poll() is None and n.proc.pid == pid  # the same process: no restart

        text = n.get("/metrics")[2].decode()
        assert metric(text, "edgerun_source_reconnects_total") >= 1
        lost = metric(text, "edgerun_source_frames_lost_total")
        outage = metric(text, "edgerun_source_last_outage_seconds")
        # The server was gone for at least the time to notice and a refused try, at 15 fps.
        assert outage > 0 and lost >= 1
        print(
            "rtsp reconnect: "
            + json.dumps(
                {
                    "transport": transport,
                    "kill_to_degraded_s": round(t_degraded - t_killed, 3),
                    "restart_to_running_s": round(t_running - t_restarted, 3),
                    "restart_to_first_batch_s": round(t_frames - t_restarted, 3),
                    "node_outage_s": round(outage, 3),
                    "frames_lost": lost,
                    "source_errors": metric(text, "edgerun_source_errors_total"),
                    "reconnects": metric(text, "edgerun_source_reconnects_total"),
                }
            )
        )

        n.proc.send_signal(signal.SIGTERM)
        assert n.proc.wait(15) == 0
        log = n.stderr_path.read_text()
        summary = json.loads(log.split("stopped: ", 1)[1].splitlines()[0])
        assert summary["captured"] == summary["frames"] + summary["dropped"]  # every captured frame accounted for
        assert summary["source_lost"] == lost and summary["source_reconnects"] >= 1
        # The password appears nowhere the node writes or serves; FFmpeg's own lines stay out of the log.
        served = n.jsonl.read_text() + json.dumps(down) + text
        assert PASSWORD not in log and PASSWORD not in served
        assert "viewer:***@" in log
        assert "[tcp @" not in log and "[rtsp @" not in log
    finally:
        n.stop()

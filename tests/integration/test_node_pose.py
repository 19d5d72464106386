"""A node whose camera knows no pose takes it from a MAVLink autopilot: real pymavlink bytes over loopback UDP."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from swarm.geo import LocalFrame
from tests.conftest import free_port
from tests.integration.brokers import wait_for
from tests.integration.test_pose_mavlink import HOME_ALT, LAT0, LON0, Autopilot

pytest.importorskip("pymavlink.dialects.v20.common")


def test_detections_carry_the_autopilots_pose(tmp_path, astronaut_rgb):
    import cv2

    images = tmp_path / "frames"
    images.mkdir()
    cv2.imwrite(str(images / "a.png"), cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR))
    port, http_port = free_port(), free_port()
    out = tmp_path / "detections.jsonl"
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        f"""[node]
id = "pose-node"
[source]
kind = "images"
path = "{images}"
fps = 10
[source.pose]
kind = "mavlink"
url = "udpin:127.0.0.1:{port}"
origin = [{LAT0}, {LON0}]
[sinks.jsonl]
path = "{out}"
[service]
http_port = {http_port}
"""
    )
    lat, lon = LAT0 + 0.0001, LON0 + 0.0002
    stop = threading.Event()

    def fly() -> None:
        pilot = Autopilot(("127.0.0.1", port))
        try:
            while not stop.is_set():
                pilot.position(lat, lon, 12.0)
                pilot.attitude(30.0, 2.0, -1.0)
                time.sleep(0.05)
        finally:
            pilot.close()

    sender = threading.Thread(target=fly, daemon=True)
    sender.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), "--seconds", "30"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

        def posed() -> list[dict]:
            if not out.exists():
                return []
            rows = []
            for line in out.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("schema") == "edgerun.detections/1" and row.get("pose"):
                    rows.append(row)
            return rows

        assert wait_for(lambda: len(posed()) >= 3, timeout=60), proc.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        proc.terminate()
        proc.wait(30)
    finally:
        stop.set()
        sender.join(5)
    east, north, _ = LocalFrame(LAT0, LON0, HOME_ALT).from_geodetic(lat, lon, HOME_ALT)
    pose = posed()[-1]["pose"]
    assert pose["east_m"] == pytest.approx(east, abs=0.05) and pose["north_m"] == pytest.approx(north, abs=0.05)
    assert pose["up_m"] == pytest.approx(12.0, abs=0.01) and pose["yaw_deg"] == pytest.approx(30.0, abs=0.01)
    assert proc.returncode == 0
    # Every frame's pose look-up is counted; the ground is the home GLOBAL_POSITION_INT implies (no HOME_POSITION).
    posed_frames = [
        line for line in metrics.splitlines() if line.startswith('edgerun_pose_frames_total{result="posed"}')
    ]
    assert posed_frames and float(posed_frames[0].split()[-1]) >= 3
    assert f'edgerun_pose_ground_alt_m{{source="global_position"}} {HOME_ALT}' in metrics

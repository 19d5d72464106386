"""The station under a 50-node fleet, and through a broker outage: real mosquitto, the station, headless Chromium.

The 50 nodes are synthetic publishers (one paho client sending schema-valid ``edgerun.detections/1`` and
``edgerun.metrics/1`` at 15 fps per node): fifty real node processes cannot run on a CI machine. The
station and the page are the real ones. Page timings go to ``station-load.json`` in the test's directory
(``EDGERUN_STATION_BENCH`` names another path); nothing here asserts a duration.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.conftest import free_port
from tests.integration.brokers import wait_for
from tests.integration.test_station_browser import CHROMEDRIVER, browser  # noqa: F401 - the fixture

N_NODES = 50
FPS = 15.0
SECONDS = 6.0
TICK_S = 0.25  # the station's default delta period

pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
    pytest.mark.skipif(not Path(CHROMEDRIVER).exists(), reason="Debian's chromium-driver is not installed"),
]


def detections(node: str, seq: int, t: float) -> bytes:
    angle = seq / FPS * 0.2 + hash(node) % 360
    return json.dumps(
        {
            "schema": "edgerun.detections/1",
            "node": node,
            "seq": seq,
            "ts": t,
            "frame": {"width": 640, "height": 480, "source": "replay"},
            "model": {"name": "blazeface_short", "version": 1, "engine": "tflite"},
            "latency_ms": 20.0,
            "pose": {
                "east_m": 100 + 80 * math.cos(angle) + int(node[1:]) % 10 * 8,
                "north_m": 100 + 80 * math.sin(angle),
                "up_m": 20.0,
                "yaw_deg": math.degrees(angle) % 360,
                "pitch_deg": 0.0,
                "roll_deg": 0.0,
                "hfov_deg": 60.0,
            },
            "detections": [{"label": "face", "class_id": 0, "score": 0.8, "box": [100, 100, 160, 170]}],
        }
    ).encode()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SseCounter(threading.Thread):
    """Counts, per node, the deltas the station streams (a raw text/event-stream reader)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.updates: Counter[str] = Counter()
        self.seen_at: dict[str, list[float]] = {}  # node -> station time of its first and last update
        self.deltas = 0
        self.stop = False

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/api/stream")
        response = conn.getresponse()
        event = ""
        while not self.stop:
            line = response.readline().decode()
            if not line:
                break
            if line.startswith("event: "):
                event = line[7:].strip()
            elif line.startswith("data: ") and event == "delta":
                self.deltas += 1
                delta = json.loads(line[6:])
                for node in delta.get("nodes", {}):
                    self.updates[node] += 1
                    self.seen_at.setdefault(node, [delta["ts"], delta["ts"]])[1] = delta["ts"]
        conn.close()


@pytest.mark.timeout(240)
def test_fifty_nodes_are_throttled_and_a_broker_outage_is_shown(browser, tmp_path):  # noqa: F811
    import paho.mqtt.client as mqtt

    with run_mosquitto() as broker:
        port = free_port()
        station = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgerun",
                "station",
                "--mqtt",
                f"127.0.0.1:{broker.port}",
                "--bind",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "station.log").open("w"),
            text=True,
        )
        try:
            assert "station: http://127.0.0.1:" in station.stdout.readline()
            counter = SseCounter(port)
            counter.start()
            client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
            client.max_queued_messages_set(0)
            client.connect("127.0.0.1", broker.port)
            client.loop_start()
            nodes = [f"n{i:02d}" for i in range(N_NODES)]
            cpu0 = cpu_seconds(station.pid)
            t0 = time.monotonic()
            seq = 0
            sent = 0
            while time.monotonic() - t0 < SECONDS:
                now = time.time()
                for node in nodes:
                    client.publish(f"edgerun/{node}/detections", detections(node, seq, now))
                    sent += 1
                if seq % int(FPS) == 0:
                    for node in nodes:
                        client.publish(f"edgerun/{node}/status", "online", qos=1, retain=True)
                        summary = {
                            "model": "blazeface_short",
                            "model_version": 1,
                            "engine": "tflite",
                            "state": "running",
                            "frames": seq,
                            "detections": seq,
                            "fps": FPS,
                            "latency_p99_ms": 30.0,
                            "dropped": 0,
                        }
                        client.publish(
                            f"edgerun/{node}/metrics",
                            json.dumps({"schema": "edgerun.metrics/1", "node": node, "ts": now, "summary": summary}),
                        )
                seq += 1
                time.sleep(max(0.0, t0 + seq / FPS - time.monotonic()))
            elapsed = time.monotonic() - t0
            station_cpu = (cpu_seconds(station.pid) - cpu0) / elapsed
            client.disconnect()
            client.loop_stop()
            time.sleep(1.0)
            counter.stop = True

            # every node reached the stream, none more often than the station's tick allows
            assert set(counter.updates) == set(nodes)
            # updates per second of the station's own clock, over each node's first to last update
            per_node_rate = max(
                n / (counter.seen_at[k][1] - counter.seen_at[k][0] + TICK_S) for k, n in counter.updates.items()
            )
            assert per_node_rate <= 1.0 / TICK_S + 0.5, counter.updates.most_common(3)

            driver = browser
            driver.get(f"http://127.0.0.1:{port}/")
            assert wait_for(
                lambda: (
                    driver.execute_script("return document.querySelectorAll('#nodes tbody tr[data-id]').length")
                    == N_NODES
                ),
                30,
            )
            assert wait_for(
                lambda: driver.execute_script("return document.querySelectorAll('g.drone').length") == N_NODES, 30
            )
            render_ms = driver.execute_script("""
                const t0 = performance.now(); renderMap(); renderNodes(); renderHeader();
                return performance.now() - t0;""")

            # the broker goes away: the page says so, and the station reconnects when it is back
            broker.stop()
            assert wait_for(lambda: "unreachable" in driver.find_element("id", "banner").text, 30)
            broker.start()
            assert wait_for(lambda: not driver.find_element("id", "banner").is_displayed(), 30)
            events = driver.execute_script(
                "return [...document.querySelectorAll('#events tbody tr')].map(r => r.textContent);"
            )
            assert any("lost the broker" in e for e in events) and any("connected to the broker" in e for e in events)

            out = Path(os.environ.get("EDGERUN_STATION_BENCH") or tmp_path / "station-load.json")
            out.write_text(
                json.dumps(
                    {
                        "nodes": N_NODES,
                        "fps_per_node": FPS,
                        "messages_sent": sent,
                        "seconds": round(elapsed, 2),
                        "deltas": counter.deltas,
                        "max_updates_per_node_s": round(per_node_rate, 2),
                        "page_render_ms": round(render_ms, 1),
                        "station_cpu_percent_of_one_core": round(100 * station_cpu, 1),
                    },
                    indent=2,
                )
            )
        finally:
            station.terminate()
            station.wait(10)

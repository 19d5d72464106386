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
from typing import Any

import pytest

from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.conftest import free_port
from tests.integration.brokers import wait_for
from tests.integration.station_rig import CHROMEDRIVER, browser  # noqa: F401 - the fixture

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


def start_station(broker_port: int, port: int, tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    """The real station on the test's broker, once it says where it serves; its log in ``station.log``."""
    station = subprocess.Popen(
        [sys.executable, "-m", "edgerun", "station", "--mqtt", f"127.0.0.1:{broker_port}",
         "--bind", f"127.0.0.1:{port}", *extra],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "station.log").open("w"),
        text=True,
    )  # fmt: skip
    assert station.stdout is not None
    first = station.stdout.readline()
    if "station: http://127.0.0.1:" not in first:
        station.kill()
        station.wait(10)
    assert "station: http://127.0.0.1:" in first, (tmp_path / "station.log").read_text()[-2000:]
    return station


def publisher(broker_port: int) -> Any:
    """A paho MQTT 5 client standing in for the fleet's nodes, connected, its network loop running."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", broker_port)
    client.loop_start()
    return client


@pytest.mark.timeout(240)
def test_fifty_nodes_are_throttled_and_a_broker_outage_is_shown(browser, tmp_path):  # noqa: F811

    with run_mosquitto() as broker:
        port = free_port()
        station = start_station(broker.port, port, tmp_path)
        try:
            counter = SseCounter(port)
            counter.start()
            client = publisher(broker.port)
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


N_OBJECTS = 200
ANCHOR = (53.1170, -4.1300, 120.0)  # the replay scene's field near Llanberis: [lat, lon, alt_m]


def find_pictures(count: int) -> list[bytes]:
    """Real JPEG crops (scikit-image's photos, as a node crops its finds: longest side <= 320 px)."""
    import cv2
    from skimage import data

    photos = [cv2.cvtColor(p, cv2.COLOR_RGB2BGR) for p in (data.astronaut(), data.chelsea(), data.coffee())]
    out = []
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = photo.shape[:2]
        x, y = (37 * i) % (w - 240), (53 * i) % (h - 200)
        crop = cv2.resize(photo[y : y + 200, x : x + 240], (320, 267))
        ok, jpeg = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, 85])
        assert ok
        out.append(jpeg.tobytes())
    return out


def fleet_object(i: int, owner: str, now: float) -> bytes:
    east, north = 20.0 + (i % 20) * 9.0, 20.0 + (i // 20) * 9.0
    lat = ANCHOR[0] + north / 111_320.0
    lon = ANCHOR[1] + east / (111_320.0 * math.cos(math.radians(ANCHOR[0])))
    return json.dumps(
        {
            "schema": "edgerun.object/2",
            "id": f"{i + 1:016x}",
            "label": "person" if i % 3 else "face",
            "lat": lat,
            "lon": lon,
            "alt_m": ANCHOR[2],
            "uncertainty_m": 0.5,
            "first_seen": now - 5,
            "last_seen": now,
            "score": 0.8,
            "owner": owner,
            "seen_by": [owner],
            "ts": now,
            "east_m": east,
            "north_m": north,
            "origin": list(ANCHOR),
        }
    ).encode()


# One redraw of the whole page as the timer drives it (maps, tables, header, alerts), timed twice: the script
# alone, and with the style and layout it leaves to the browser (forced by reading a size). "cold" first forgets
# what was drawn (patch.js's patchReset, where the page has it), so every row, shape and picture is built.
REDRAW_JS = """
if (arguments[0] && typeof patchReset === "function") patchReset();
const t0 = performance.now();
renderMaps(); renderNodes(); renderHeader();
if (typeof alertsRender === "function") alertsRender();
const script = performance.now() - t0;
void document.body.offsetHeight;
return [script, performance.now() - t0];"""
REDRAWS = 9  # each figure is the median of this many, 250 ms apart (a tick's changes between two)


def redraw_times(driver: Any, cold: bool) -> dict[str, float]:
    times = []
    for _ in range(REDRAWS):
        times.append(driver.execute_script(REDRAW_JS, cold))
        time.sleep(TICK_S)
    script, total = sorted(t[0] for t in times), sorted(t[1] for t in times)
    return {"script_ms": round(script[REDRAWS // 2], 1), "with_layout_ms": round(total[REDRAWS // 2], 1)}


class LiveFleet(threading.Thread):
    """The 50 nodes going on at 15 fps while the page is measured, so a redraw has a tick's changes to draw."""

    def __init__(self, client: Any, nodes: list[str], seq: int) -> None:
        super().__init__(daemon=True)
        self.client, self.nodes, self.seq = client, nodes, seq
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        k = 0
        while not self.stop.is_set():
            now = time.time()
            for node in self.nodes:
                self.client.publish(f"edgerun/{node}/detections", detections(node, self.seq + k, now))
            k += 1
            self.stop.wait(max(0.0, t0 + k / FPS - time.monotonic()))


@pytest.mark.timeout(240)
def test_two_hundred_finds_with_pictures_reach_the_page_and_the_store(browser, tmp_path):  # noqa: F811
    """50 nodes at 15 fps and 200 fleet objects with their pictures (real JPEGs, as nodes publish them): every
    find reaches the page with its picture and alert, the store keeps them; timings and sizes are written to
    ``station-finds-load.json`` (``EDGERUN_STATION_FINDS_BENCH``), none asserted."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    db = tmp_path / "station.db"
    pictures = find_pictures(N_OBJECTS)
    with run_mosquitto() as broker:
        port = free_port()
        station = start_station(broker.port, port, tmp_path, "--db", str(db))
        try:
            client = publisher(broker.port)
            nodes = [f"n{i:02d}" for i in range(N_NODES)]
            cpu0 = cpu_seconds(station.pid)
            t0 = time.monotonic()
            seq = 0
            while time.monotonic() - t0 < SECONDS:
                now = time.time()
                for node in nodes:
                    client.publish(f"edgerun/{node}/detections", detections(node, seq, now))
                # the finds come in over the run, each with its picture, as their owners report them
                for i in range(seq * N_OBJECTS // int(SECONDS * FPS), (seq + 1) * N_OBJECTS // int(SECONDS * FPS)):
                    owner = nodes[i % N_NODES]
                    client.publish(f"edgerun/fleet/objects/{i + 1:016x}", fleet_object(i, owner, now), 1, retain=True)
                    props = Properties(PacketTypes.PUBLISH)
                    props.UserProperty = [("node", owner), ("score", "0.8"), ("box", "100,100,160,170"),
                                          ("ts", repr(now))]  # fmt: skip
                    client.publish(f"edgerun/fleet/objects/{i + 1:016x}/image", pictures[i], 1, True, props)
                seq += 1
                time.sleep(max(0.0, t0 + seq / FPS - time.monotonic()))
            elapsed = time.monotonic() - t0
            station_cpu = (cpu_seconds(station.pid) - cpu0) / elapsed
            live = LiveFleet(client, nodes, seq)
            live.start()

            driver = browser
            driver.get(f"http://127.0.0.1:{port}/")
            rows = "return document.querySelectorAll('#objects tbody tr[data-id]').length"
            assert wait_for(lambda: driver.execute_script(rows) == N_OBJECTS, 60), driver.execute_script(rows)
            snapshot = json.loads(urllib_get(port, "/api/snapshot"))
            with_picture = [o for o in snapshot["objects"] if o.get("image_url")]
            assert len(with_picture) == N_OBJECTS
            # a picture the page links is the one the node published, byte for byte
            sample = with_picture[7]
            assert urllib_get(port, sample["image_url"]) == pictures[int(sample["id"], 16) - 1]
            drones = "return document.querySelectorAll('g.drone').length"
            assert wait_for(lambda: driver.execute_script(drones) == N_NODES, 30)
            redraw_cold = redraw_times(driver, cold=True)
            redraw_live = redraw_times(driver, cold=False)
            live.stop.set()
            live.join(10)
            client.disconnect()
            client.loop_stop()
            # the cold redraws rebuilt the page: it still shows every find, once
            assert driver.execute_script(rows) == N_OBJECTS
            assert driver.execute_script("return document.querySelectorAll('#alert-list .alert').length") == N_OBJECTS
            markers = driver.execute_script("return document.querySelectorAll('#geomap .leaflet-marker-icon').length")
            assert markers > 0, "the lat/lon map shows the finds (single or clustered)"
            station.terminate()
            station.wait(10)
            db_bytes = sum(p.stat().st_size for p in tmp_path.glob("station.db*"))
            out = Path(os.environ.get("EDGERUN_STATION_FINDS_BENCH") or tmp_path / "station-finds-load.json")
            out.write_text(
                json.dumps(
                    {
                        "nodes": N_NODES,
                        "fps_per_node": FPS,
                        "objects_with_pictures": N_OBJECTS,
                        "picture_bytes_mean": round(sum(map(len, pictures)) / len(pictures)),
                        "seconds": round(elapsed, 2),
                        "station_cpu_percent_of_one_core": round(100 * station_cpu, 1),
                        "page_redraw_ms": redraw_live["script_ms"],
                        "page_redraw": {"cold": redraw_cold, "live": redraw_live, "median_of": REDRAWS},
                        "map_marker_elements": markers,
                        "store_bytes": db_bytes,
                    },
                    indent=2,
                )
            )
        finally:
            if station.poll() is None:
                station.terminate()
                station.wait(10)


def urllib_get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return body

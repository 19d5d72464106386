"""Drones on the lat/lon map where they say they are: real mosquitto, the station as a process, headless Chromium.

Two drones fly in two local frames 3 km apart (each node's frame is anchored where its autopilot got its first
fix); only the first owns a find. Each sends its camera's lat/lon in its detections' pose (as an anchored node
does, ``edgerun.types.Pose.to_wire``). The page draws each drone, its footprint and its trail at its own place:
the second is not put into the first one's frame (where the find's frame would have placed it, 3 km off).
The detections come from a paho client standing in for the drones (what is tested is the station and the page).
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.types import Pose
from swarm.geo import offset_latlon
from tests.integration.brokers import wait_for
from tests.integration.station_rig import StationProcess, browser, needs_chromium, publish  # noqa: F401 (fixture)

pytestmark = [pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"), needs_chromium]

FRAME_A = (53.1170, -4.1300, 120.0)
FRAME_B = (*offset_latlon(53.1170, -4.1300, 3000.0, 0.0), 140.0)  # 3 km east
# drone -> (its frame, east, north in that frame)
DRONES = {"drone-a": (FRAME_A, 40.0, 25.0), "drone-b": (FRAME_B, -30.0, 60.0)}

GEO_JS = """return Object.fromEntries(Object.entries(GEO.droneMarkers).map(([id, m]) => {
  const at = m.marker.getLatLng(); const fp = GEO.footprints[id];
  const c = fp ? fp.layer.getBounds().getCenter() : null;
  return [id, {lat: at.lat, lon: at.lng, footprint: c ? [c.lat, c.lng] : null,
    shown: !document.getElementById('geomap').classList.contains('hidden')}];
}));"""


def detections(node: str, seq: int) -> bytes:
    frame, east, north = DRONES[node]
    pose = Pose(east + seq * 0.5, north, 25.0, 0.0, 0.0, 0.0, 60.0, *frame)
    return json.dumps(
        {
            "schema": "edgerun.detections/1",
            "node": node,
            "seq": seq,
            "ts": time.time(),
            "frame": {"width": 640, "height": 480, "source": "replay"},
            "model": {"name": "blazeface_short", "version": 1, "engine": "tflite"},
            "latency_ms": 20.0,
            "pose": msgspec.to_builtins(pose.to_wire()),  # as the node's sink sends it
            "detections": [],
        }
    ).encode()


def find_of_drone_a() -> bytes:
    lat, lon = offset_latlon(FRAME_A[0], FRAME_A[1], 45.0, 20.0)
    return json.dumps(
        {
            "schema": "edgerun.object/2",
            "id": "00000000000000a1",
            "label": "person",
            "lat": lat,
            "lon": lon,
            "first_seen": time.time() - 2,
            "last_seen": time.time(),
            "score": 0.9,
            "owner": "drone-a",
            "seen_by": ["drone-a"],
            "east_m": 45.0,
            "north_m": 20.0,
            "origin": list(FRAME_A),
        }
    ).encode()


@pytest.mark.timeout(180)
def test_each_drone_is_drawn_at_its_own_lat_lon_whatever_frame_it_flies_in(tmp_path, browser):  # noqa: F811
    with run_mosquitto() as broker:
        station = StationProcess(tmp_path, broker.port)
        try:
            station.wait_connected()
            time.sleep(1.0)  # the subscription follows the connection (the detections below come four times)
            publish(broker.port, [("edgerun/fleet/objects", find_of_drone_a(), {})], retain=False)
            for seq in range(4):
                publish(broker.port, [(f"edgerun/{n}/detections", detections(n, seq), {}) for n in DRONES], False)
                time.sleep(1.1)  # a trail point a second
            sent = {n: json.loads(detections(n, 3))["pose"] for n in DRONES}
            browser.get(station.url + "/")
            assert wait_for(lambda: set(browser.execute_script(GEO_JS)) == set(DRONES), 30, 0.25), station.log()
            drawn = browser.execute_script(GEO_JS)
            for node, at in drawn.items():
                assert at["shown"]  # the page chose the lat/lon map
                assert abs(at["lat"] - sent[node]["lat"]) < 1e-7 and abs(at["lon"] - sent[node]["lon"]) < 1e-7
                # its footprint lies around it (the camera looks straight down), not 3 km off in another frame
                assert at["footprint"] is not None
                assert abs(at["footprint"][0] - at["lat"]) < 3e-4 and abs(at["footprint"][1] - at["lon"]) < 5e-4
        finally:
            station.stop()

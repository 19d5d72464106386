"""A node whose frame has a place on Earth says where its camera is (lat/lon/alt in the detections' pose), and the
station keeps it for the map; a frame with no anchor sends the pose as before, without them."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from edgerun import wire
from edgerun.station.model import FleetModel
from edgerun.types import DetectionBatch, Detections, FrameMeta, Pose
from swarm.geo import LocalFrame

ANCHOR = (53.1170, -4.1300, 120.0)  # the replay scene's field near Llanberis


def batch(pose: Pose | None) -> DetectionBatch:
    meta = FrameMeta(seq=7, source="replay", width=640, height=480, wall_time=1_800_000_000.0, t_capture=0.0, pose=pose)
    empty = Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32))
    return DetectionBatch("drone-7", meta, empty, ("face",), "blazeface_short", 1, "tflite")


@pytest.mark.parametrize(("east", "north", "up"), [(0.0, 0.0, 20.0), (250.0, -120.0, 35.0), (-800.0, 600.0, 60.0)])
def test_an_anchored_pose_carries_the_cameras_lat_lon_as_proj_computes_it(east, north, up):
    pose = Pose(east, north, up, 90.0, 0.0, 0.0, 60.0, *ANCHOR)
    sent = batch(pose).to_payload()["pose"]
    # PROJ's topocentric frame is the reference; the wire's closed form agrees within 10 cm over a search area.
    lat, lon, alt = LocalFrame(*ANCHOR).to_geodetic(east, north, 0.0)
    assert abs(sent["lat"] - lat) < 1e-6 and abs(sent["lon"] - lon) < 1.5e-6
    assert sent["alt_m"] == pytest.approx(ANCHOR[2] + up, abs=0.01)
    assert msgspec.json.decode(json.dumps(sent), type=wire.Pose).lat == sent["lat"]  # what a station decodes


def test_a_pose_with_no_anchor_sends_no_position_and_older_payloads_still_decode():
    sent = batch(Pose(3.0, 4.0, 20.0)).to_payload()["pose"]
    assert set(sent) == {"east_m", "north_m", "up_m", "yaw_deg", "pitch_deg", "roll_deg", "hfov_deg"}
    out_of_range = dict(sent, lat=95.0, lon=0.0)
    with pytest.raises(msgspec.ValidationError, match="lat"):
        msgspec.json.decode(json.dumps(out_of_range), type=wire.Pose)


def test_the_station_keeps_a_nodes_lat_lon_for_the_map():
    model = FleetModel()
    anchored = batch(Pose(250.0, -120.0, 35.0, 90.0, 0.0, 0.0, 60.0, *ANCHOR)).to_payload()
    plain = dict(batch(Pose(3.0, 4.0, 20.0)).to_payload(), node="drone-8")
    model.ingest("edgerun/drone-7/detections", json.dumps(anchored).encode(), 1_800_000_000.0)
    model.ingest("edgerun/drone-8/detections", json.dumps(plain).encode(), 1_800_000_000.0)
    nodes = model.snapshot(1_800_000_001.0)["nodes"]
    assert (nodes["drone-7"]["pose"]["lat"], nodes["drone-7"]["pose"]["lon"]) == (
        anchored["pose"]["lat"],
        anchored["pose"]["lon"],
    )
    assert "lat" not in nodes["drone-8"]["pose"]

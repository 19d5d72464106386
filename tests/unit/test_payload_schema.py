"""The published payload, its JSON Schema, the native DDS type and the listener's parser agree."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from edgerun.listen import decode_message, format_detections, format_object
from edgerun.tracing import FrameTraceIds
from edgerun.types import PAYLOAD_SCHEMA, DetectionBatch, Detections, FrameMeta, Pose

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "edgerun" / "schema" / "detections-v1.json").read_text())
IDL = (REPO / "edgerun" / "sinks" / "idl" / "edgerun.idl").read_text()


def batch(n: int = 2, keypoints: int = 0, pose: bool = True, seq: int = 7, traced: bool = False) -> DetectionBatch:
    boxes = np.array([[10.04, 20.0, 110.5, 90.25], [300.0, 200.0, 350.0, 260.0], [0, 0, 1, 1]], np.float32)[:n]
    det = Detections(
        boxes=boxes,
        scores=np.array([0.91234, 0.5, 0.01], np.float32)[:n],
        class_ids=np.array([0, 1, 7], np.int32)[:n],
        keypoints=np.full((n, keypoints, 2), 12.34, np.float32) if keypoints else None,
    )
    meta = FrameMeta(
        seq=seq,
        source="replay",
        width=640,
        height=480,
        wall_time=1795000000.123456,
        t_capture=100.0,
        pose=Pose(1.0, -2.0, 6.0, 3.0, 1.0, 0.5) if pose else None,
    )
    trace = FrameTraceIds(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x1, 0x00F067AA0BA902B7) if traced else None
    return DetectionBatch("node-a", meta, det, ("face", "person"), "blazeface_short", 1, "tflite", trace=trace)


PAYLOADS = [
    batch().to_payload(100.0142),
    batch(keypoints=6).to_payload(100.02),
    batch(n=0, pose=False).to_payload(None),
    batch(n=3, keypoints=2, pose=False).to_payload(101.0),  # class 7 has no label: the label is "7"
    batch(keypoints=6, traced=True).to_payload(100.02),  # a traced frame names its trace
]
# A frame anchored on Earth: its pose says where the camera is (lat, lon, alt_m), which an unanchored one omits.
ANCHORED = batch()
assert ANCHORED.meta.pose is not None
ANCHORED.meta.pose.origin_lat, ANCHORED.meta.pose.origin_lon, ANCHORED.meta.pose.ground_alt_m = 53.117, -4.13, 120.0
ANCHORED_PAYLOAD = ANCHORED.to_payload(100.5)


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    return jsonschema.Draft202012Validator(SCHEMA)


@pytest.mark.parametrize("payload", [*PAYLOADS, ANCHORED_PAYLOAD])
def test_payloads_validate(validator, payload) -> None:
    validator.validate(payload)


def test_schema_describes_exactly_the_fields_produced() -> None:
    payload = PAYLOADS[1]
    assert SCHEMA["properties"]["schema"]["const"] == PAYLOAD_SCHEMA
    assert set(SCHEMA["properties"]) == set(PAYLOADS[4]) == set(payload) | {"trace_id"}
    assert set(payload) == set(SCHEMA["required"])  # trace_id is the one optional field: absent when not traced
    assert PAYLOADS[4]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert set(SCHEMA["properties"]["frame"]["properties"]) == set(payload["frame"])
    assert set(SCHEMA["properties"]["model"]["properties"]) == set(payload["model"])
    pose = SCHEMA["$defs"]["pose"]
    assert set(payload["pose"]) == set(pose["required"])
    assert set(pose["properties"]) == set(ANCHORED_PAYLOAD["pose"]) == set(pose["required"]) | {"lat", "lon", "alt_m"}
    assert set(SCHEMA["$defs"]["detection"]["properties"]) == set(payload["detections"][0])
    assert "keypoints" not in PAYLOADS[0]["detections"][0]  # optional: only models with keypoints


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda p: p.pop("seq"), "$"),
        (lambda p: p.update(schema="edgerun.detections/2"), "$.schema"),
        (lambda p: p["detections"][0].update(box=[1, 2, 3]), "$.detections[0].box"),
        (lambda p: p["detections"][0].update(score=1.5), "$.detections[0].score"),
        (lambda p: p["frame"].update(width="640"), "$.frame.width"),
        (lambda p: p["detections"][0].update(keypoints=[[1.0]]), "$.detections[0].keypoints[0]"),
        (lambda p: p.update(pose={"east_m": 1}), "$.pose"),
        (lambda p: p.update(trace_id="4BF92F3577B34DA6A3CE929D0E0E4736"), "$.trace_id"),
        (lambda p: p.update(trace_id=None), "$.trace_id"),
    ],
)
def test_schema_rejects(validator, mutate, path) -> None:
    payload = json.loads(json.dumps(PAYLOADS[1]))
    mutate(payload)
    errors = list(validator.iter_errors(payload))
    assert errors and any(e.json_path == path for e in errors), [(e.json_path, e.message) for e in errors]


def test_documented_example_validates(validator) -> None:
    page = (REPO / "docs" / "payloads.md").read_text()
    m = re.search(r"## Detection payload.*?```json\n(.*?)```", page, re.S)
    assert m is not None, "docs/payloads.md has no detection payload example"
    validator.validate(json.loads(m.group(1)))


def test_documented_object_example_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "edgerun" / "schema" / "object-v2.json").read_text())
    page = (REPO / "docs" / "payloads.md").read_text()
    m = re.search(r"## Fleet object payload.*?```json\n(.*?)```", page, re.S)
    assert m is not None, "docs/payloads.md has no fleet object example"
    jsonschema.validate(json.loads(m.group(1)), schema)


# -- native DDS type ---------------------------------------------------------------------------


def idl_structs(text: str) -> dict[str, list[str]]:
    """Struct name -> member names in order (with "@key " kept), from the simple IDL we ship."""
    text = re.sub(r"//[^\n]*", "", text)
    structs = {}
    for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\};", text, re.S):
        members = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if decl:
                member = re.search(r"(\w+)\s*(\[\d+\])?$", decl)
                assert member is not None, decl
                members.append(("@key " if decl.startswith("@key") else "") + member.group(1))
        structs[name] = members
    return structs


def test_idl_matches_the_python_types() -> None:
    import dataclasses

    pytest.importorskip("cyclonedds")
    from edgerun.sinks.idl import native

    structs = idl_structs(IDL)
    assert set(structs) == {"Keypoint", "Detection", "Pose", "FrameInfo", "ModelInfo", "DetectionBatch", "FleetObject"}
    for name, members in structs.items():
        cls = getattr(native, name)
        assert cls.__idl_typename__ == f"edgerun::{name}"
        fields = [f.name for f in dataclasses.fields(cls)]
        assert [m.removeprefix("@key ") for m in members] == fields, name
    assert structs["DetectionBatch"][0] == "@key node"
    assert structs["FleetObject"][0] == "@key id"
    native.DetectionBatch.__idl__.populate()
    assert native.DetectionBatch.__idl__.keyless is False


@pytest.mark.parametrize("payload", PAYLOADS)
def test_native_sample_round_trips_exactly(payload) -> None:
    pytest.importorskip("cyclonedds")
    from edgerun.sinks.dds import native_to_payload, payload_to_native
    from edgerun.sinks.idl import native

    wire = payload_to_native(payload).serialize()
    assert native_to_payload(native.DetectionBatch.deserialize(wire)) == payload


def test_the_dds_sample_carries_the_pose_but_not_the_cameras_lat_lon() -> None:
    """The DDS type (edgerun.idl) has no field for them yet: the pose arrives in its local frame only."""
    pytest.importorskip("cyclonedds")
    from edgerun.sinks.dds import native_to_payload, payload_to_native
    from edgerun.sinks.idl import native

    back = native_to_payload(native.DetectionBatch.deserialize(payload_to_native(ANCHORED_PAYLOAD).serialize()))
    local = {k: v for k, v in ANCHORED_PAYLOAD["pose"].items() if k not in ("lat", "lon", "alt_m")}
    assert back == dict(ANCHORED_PAYLOAD, pose=local)


def test_ros2_message_from_payload() -> None:
    pytest.importorskip("cyclonedds")
    from edgerun.sinks.dds import payload_to_ros2, stamp_of
    from edgerun.sinks.idl import ros2

    payload = PAYLOADS[0]
    msg = ros2.Detection2DArray.deserialize(payload_to_ros2(payload, "cam").serialize(use_version_2=False))
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == stamp_of(payload["ts"]) == (1795000000, 123456001)
    assert msg.header.frame_id == "cam" and len(msg.detections) == 2
    d = msg.detections[0]
    hypothesis = d.results[0].hypothesis
    assert (hypothesis.class_id, hypothesis.score) == ("face", payload["detections"][0]["score"])
    x1, y1, x2, y2 = payload["detections"][0]["box"]  # the payload's rounded pixels
    assert (d.bbox.center.position.x, d.bbox.center.position.y) == pytest.approx(((x1 + x2) / 2, (y1 + y2) / 2))
    assert (d.bbox.size_x, d.bbox.size_y) == pytest.approx((x2 - x1, y2 - y1))
    assert d.results[0].pose.pose.orientation.w == 1.0
    assert ros2.topic_name("/drone_7/") == "rt/drone_7/detections"


def test_ros2_namespace_and_domain_config() -> None:
    from edgerun.errors import ConfigError
    from edgerun.sinks.dds import domain_config, ros2_namespace

    assert ros2_namespace("", "demo-node") == "demo_node"
    assert ros2_namespace("/fleet/7up/", "x") == "fleet/n7up"
    lo = domain_config("lo")
    assert '<NetworkInterface name="lo"/>' in lo and "<AllowMulticast>false</AllowMulticast>" in lo
    assert '<Peer address="127.0.0.1"/>' in lo
    assert "AllowMulticast" not in domain_config("eth0")
    with pytest.raises(ConfigError, match="sinks.dds.interface"):
        domain_config('lo"/><x')


# -- the listener's parser -------------------------------------------------------------------


def test_decode_good_messages() -> None:
    kind, obj = decode_message(json.dumps(PAYLOADS[1]).encode())
    assert kind == "detections" and obj == PAYLOADS[1]
    assert decode_message(b"online") == ("text", "online")
    assert decode_message(b'{"schema": "edgerun.event/1", "kind": "health"}')[0] == "json"
    line = format_detections(PAYLOADS[0])
    assert line.startswith("node-a #7 ")
    assert "blazeface_short v1/tflite 14.2 ms  2 det: face 0.91 [10,20,110,90]" in line
    assert "trace" not in line
    # A traced frame's line ends with its trace id, to look it up in Jaeger or Tempo.
    assert format_detections(PAYLOADS[4]).endswith("[300,200,350,260]  trace 4bf92f3577b34da6a3ce929d0e0e4736")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"x" * 2000, "payload of 2000 bytes is over the 1000-byte limit"),
        (b"\xff\xfe", "payload is not UTF-8"),
        (b"{nope", "payload is not JSON (object keys must be strings (byte 1))"),
        (b"on\x07line", "text payload has control characters"),
        (b'{"schema": "edgerun.detections/1", "node": 1}', "node: Expected `str`, got `int`"),
        (b'{"schema": "edgerun.detections/1", "node": "n", "seq": true}', "seq: Expected `int`, got `bool`"),
        (b'{"schema": "edgerun.detections/1", "node": "n", "seq": -1}', "seq: Expected `int` >= 0"),
        (
            b'{"schema": "edgerun.detections/1", "node": "n", "seq": 1, "ts": 2, "model": {"name": "m"},'
            b' "latency_ms": null, "detections": [{"label": "a", "score": NaN, "box": [1, 2, 3, 4]}]}',
            "payload is not JSON (invalid character (byte 150))",  # JSON has no NaN
        ),
        (
            b'{"schema": "edgerun.detections/1", "node": "n", "seq": 1, "ts": 2,'
            b' "model": {"name": "m", "version": 1, "engine": "e"}, "latency_ms": null,'
            b' "detections": [{"label": "a", "class_id": 0, "score": 1.5, "box": [1, 2, 3, 4]}]}',
            "detections[0].score: Expected `float` <= 1.0",
        ),
        (
            b'{"schema": "edgerun.detections/1", "node": "n", "seq": 1, "ts": 2,'
            b' "model": {"name": "m", "version": 1, "engine": "e"}, "latency_ms": null,'
            b' "detections": [{"label": "a", "class_id": 0, "score": 0.5, "box": [1, 2, 3]}]}',
            "detections[0].box: Expected `array` of length 4, got 3",
        ),
        (b'{"schema": "edgerun.detections/1", "node": "n", "seq": 1}', "Object missing required field `ts`"),
        (
            b'{"schema": "edgerun.detections/1", "node": "n", "seq": 1, "ts": 2, "frame": {"width": 1,'
            b' "height": 1, "source": "x"}, "model": {"name": "m", "version": 1, "engine": "e"}, "latency_ms": null,'
            b' "pose": null, "detections": [], "trace_id": "abc"}',
            "trace_id: Expected `str` matching regex '^[0-9a-f]{32}$'",
        ),
    ],
)
def test_decode_rejects_with_exact_reason(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as err:
        decode_message(data, max_bytes=1000)
    assert str(err.value) == message


def test_decode_survives_deep_nesting() -> None:
    with pytest.raises(ValueError, match="^payload JSON is nested too deeply$"):
        decode_message(b"[" * 200_000 + b"]" * 200_000)


def test_nan_latency_is_null_on_the_native_type() -> None:
    pytest.importorskip("cyclonedds")
    from edgerun.sinks.dds import payload_to_native

    sample = payload_to_native(PAYLOADS[2])
    assert math.isnan(sample.latency_ms) and sample.pose == [] and sample.detections == []


def test_listen_reads_fleet_objects_of_both_versions_and_names_a_bad_one() -> None:
    v2 = {
        "schema": "edgerun.object/2",
        "id": "9f2c41d07b3e8a15",
        "label": "face",
        "lat": 53.1172073,
        "lon": -4.1297391,
        "alt_m": 100.0,
        "uncertainty_m": 0.61,
        "owner": "drone-2",
        "seen_by": ["a", "b"],
    }
    kind, obj = decode_message(json.dumps(v2).encode())
    assert kind == "object"
    assert (
        format_object(obj) == "object 9f2c41d07b3e8a15 face at 53.1172073, -4.1297391 +-0.6 m  owner drone-2, seen by 2"
    )
    v1 = {"schema": "edgerun.object/1", "id": "x", "label": "face", "east_m": 17.42, "north_m": 23.05}
    kind, obj = decode_message(json.dumps(v1).encode())
    assert kind == "object" and "E 17.4 N 23.1 m (local, edgerun.object/1)" in format_object(obj)
    with pytest.raises(ValueError, match="lat"):
        decode_message(json.dumps({**v2, "lat": 123.0}).encode())

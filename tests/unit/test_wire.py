"""The wire Structs agree with the published JSON Schemas, with every producer, and with each other."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerun import wire
from edgerun.config import JsonlSinkConfig, MqttSinkConfig
from edgerun.ota import transport_mqtt
from edgerun.sinks.jsonl import JsonlSink
from edgerun.types import DetectionBatch, Detections, FrameMeta, Pose
from swarm import dedup

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = Path(__file__).resolve().parents[2] / "edgerun" / "schema"
DETECTIONS = jsonschema.Draft202012Validator(json.loads((SCHEMAS / "detections-v1.json").read_text()))
OBJECT = jsonschema.Draft202012Validator(json.loads((SCHEMAS / "object-v2.json").read_text()))

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@st.composite
def batches(draw: Any) -> DetectionBatch:
    n = draw(st.integers(0, 4))
    keypoints = draw(st.sampled_from([0, 1, 6]))
    boxes = np.array(
        draw(st.lists(st.lists(finite, min_size=4, max_size=4), min_size=n, max_size=n)) or np.zeros((0, 4)), np.float32
    ).reshape(n, 4)
    det = Detections(
        boxes=boxes,
        scores=np.array(draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)), np.float32).reshape(n),
        class_ids=np.array(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), np.int32).reshape(n),
        keypoints=np.full((n, keypoints, 2), draw(finite), np.float32) if keypoints else None,
    )
    pose = Pose(*draw(st.lists(finite, min_size=7, max_size=7))) if draw(st.booleans()) else None
    meta = FrameMeta(
        seq=draw(st.integers(0, 2**40)),
        source=draw(st.text(max_size=8)),
        width=640,
        height=480,
        wall_time=draw(st.floats(0, 4e9)),
        t_capture=100.0,
        pose=pose,
    )
    return DetectionBatch(draw(st.text(max_size=8)), meta, det, ("face", "person"), "m", 1, "tflite")


@given(batch=batches(), publish=st.one_of(st.none(), st.floats(100.0, 200.0)))
def test_every_detections_struct_a_node_makes_is_valid_and_round_trips(batch: DetectionBatch, publish: Any) -> None:
    body = msgspec.json.encode(batch.to_wire(publish))
    DETECTIONS.validate(json.loads(body))
    assert msgspec.json.encode(msgspec.json.decode(body, type=wire.Detections)) == body
    assert json.loads(body) == batch.to_payload(publish)


def fleet_object(**changes: Any) -> dict[str, Any]:
    obj = dedup.FleetObject(
        id="5f0c2a9d11e04b7a",
        label="person",
        lat=53.1171234,
        lon=-4.1298765,
        alt_m=101.5,
        uncertainty_m=0.4,
        first_seen=1.0,
        last_seen=2.0,
        score=0.9,
        owner="d1",
        seen_by=("d1", "d2"),
        ts=2.5,
    )
    return {**obj.to_payload(), **changes}


def test_a_fleet_object_from_swarm_is_valid_and_round_trips() -> None:
    payload = fleet_object()
    OBJECT.validate(payload)
    assert msgspec.to_builtins(msgspec.convert(payload, wire.FleetObject)) == payload
    assert wire.OBJECT_SCHEMA == dedup.OBJECT_SCHEMA == OBJECT.schema["properties"]["schema"]["const"]
    # the node adds its local east/north beside lat/lon, with the frame's origin
    local = fleet_object(east_m=12.5, north_m=-3.25, origin=[53.117, -4.13, 100.0])
    OBJECT.validate(local)
    assert msgspec.to_builtins(msgspec.convert(local, wire.FleetObject)) == local


def test_version_1_objects_stay_readable_and_each_version_needs_its_position() -> None:
    v1 = {"schema": "edgerun.object/1", "id": "5f0c2a9d11e04b7a", "label": "person", "east_m": 1.0, "north_m": 2.0}
    assert msgspec.convert(v1, wire.ObjectReport).east_m == 1.0
    v2 = fleet_object()
    assert msgspec.convert(v2, wire.ObjectReport).lat == v2["lat"]
    for bad in ({**v1, "east_m": None}, {k: v for k, v in v2.items() if k != "lat"}, {**v2, "lat": 91.0}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, wire.ObjectReport)


def detections_payload() -> dict[str, Any]:
    meta = FrameMeta(seq=1, source="replay", width=640, height=480, wall_time=1.0, t_capture=0.0, pose=Pose(1, 2, 3))
    det = Detections(
        np.array([[1, 2, 3, 4]], np.float32),
        np.array([0.5], np.float32),
        np.array([0], np.int32),
        np.ones((1, 2, 2), np.float32),
    )
    return DetectionBatch("n", meta, det, ("face",), "m", 1, "tflite").to_payload(0.5)


def mutate(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    target: Any = doc
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is KeyError:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("schema", "edgerun.detections/2"),
        ("node", 5),
        ("seq", -1),
        ("seq", True),
        ("seq", KeyError),
        ("ts", "now"),
        ("frame.width", -1),
        ("frame", KeyError),
        ("model.version", 1.5),
        ("model.engine", KeyError),
        ("latency_ms", -1.0),
        ("pose.yaw_deg", "north"),
        ("pose.hfov_deg", KeyError),
        ("detections", {}),
        ("detections.0.score", 1.01),
        ("detections.0.box", [1, 2, 3]),
        ("detections.0.label", None),
        ("detections.0.keypoints.0", [1.0]),
        ("pose", KeyError),
    ],
)
def test_what_the_detections_schema_rejects_the_struct_rejects(path: str, value: Any) -> None:
    bad = mutate(detections_payload(), path, value)
    assert not DETECTIONS.is_valid(bad)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps(bad), type=wire.Detections)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("schema", "edgerun.object/1"),
        ("lat", 90.5),
        ("lon", -181.0),
        ("lat", KeyError),
        ("alt_m", "high"),
        ("id", "5F0C2A9D11E04B7A"),
        ("id", "abc"),
        ("label", ""),
        ("label", "x" * 33),
        ("uncertainty_m", -0.1),
        ("score", 1.5),
        ("owner", ""),
        ("seen_by", []),
        ("seen_by", ["d1", "d1"]),
        ("seen_by", [""]),
        ("ts", KeyError),
        ("east_m", "far"),
        ("origin", [1.0, 2.0]),
    ],
)
def test_what_the_object_schema_rejects_the_struct_rejects(path: str, value: Any) -> None:
    bad = mutate(fleet_object(), path, value)
    assert not OBJECT.is_valid(bad)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps(bad), type=wire.FleetObject)


def test_additive_fields_are_accepted_within_version_1() -> None:
    payload = {**detections_payload(), "extra": {"new": 1}}
    assert DETECTIONS.is_valid(payload)
    assert msgspec.json.decode(json.dumps(payload), type=wire.Detections).node == "n"


def test_the_event_envelope_wins_and_names_the_node() -> None:
    event = wire.event_payload("d1", "health", {"state": "running", "kind": "x", "node": "evil", "ts": -1}, ts=5.0)
    assert event == {"schema": wire.EVENT_SCHEMA, "node": "d1", "kind": "health", "ts": 5.0, "state": "running"}
    assert msgspec.convert(event, wire.EventEnvelope).node == "d1"


def test_jsonl_events_carry_the_same_envelope_as_mqtt(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"

    async def run() -> None:
        sink = JsonlSink(JsonlSinkConfig(path=str(out)), "d7")
        await sink.start()
        sink.publish_event("swarm", {"change": "join", "kind": "dead", "schema": "nope"})
        await sink.close()

    asyncio.run(run())
    (event,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (event["schema"], event["node"], event["kind"]) == (wire.EVENT_SCHEMA, "d7", "swarm")
    assert event["change"] == "join"
    assert list(event)[:4] == ["schema", "node", "kind", "ts"]


def test_topics_and_ids_outside_wire_agree_with_it() -> None:
    assert MqttSinkConfig().fleet_topic == wire.FLEET_OBJECTS_TOPIC
    assert transport_mqtt.TOPIC_PREFIX == wire.RELEASES_PREFIX
    assert transport_mqtt.RELEASE_SCHEMA == wire.RELEASE_SCHEMA
    assert transport_mqtt.release_topic("m") == wire.release_topic("m") == "edgerun/fleet/releases/m"
    assert transport_mqtt.file_topic("m", "f", "3") == wire.release_file_topic("m", "f", "3")
    assert wire.rollout_topic("m") == "edgerun/fleet/rollouts/m"
    assert wire.node_topic("d1", "detections") == wire.node_topic_prefix("d1") + "detections"
    release = transport_mqtt.encode_release(b"manifest", "sig", None, None)
    assert msgspec.json.decode(release, type=wire.ReleaseEnvelope).manifest_sig == "sig"


def test_describe_names_the_field_and_what_was_expected() -> None:
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.json.decode(b'{"detections": [{"score": "x"}]}', type=wire.Detections)
    assert wire.describe(err.value) == "detections[0].score: Expected `float`, got `str`"
    assert wire.decode_status(b" online\n") == "online" and wire.decode_status(b"maybe") is None

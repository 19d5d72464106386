"""The station's fleet model: what it makes of each topic, how it bounds memory, and what it drops."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.station.footprint import footprint, pose_from_payload
from edgerun.station.model import FleetModel, parse_object

T0 = 1_800_000_000.0


def detections(node: str, east: float = 10.0, north: float = 12.0, yaw: float = 0.0, version: int = 1, n: int = 1):
    return json.dumps(
        {
            "schema": "edgerun.detections/1",
            "node": node,
            "seq": 1,
            "ts": T0,
            "frame": {"width": 640, "height": 480, "source": "replay"},
            "model": {"name": "blazeface_short", "version": version, "engine": "tflite"},
            "latency_ms": 3.0,
            "pose": {
                "east_m": east,
                "north_m": north,
                "up_m": 6.0,
                "yaw_deg": yaw,
                "pitch_deg": 0.0,
                "roll_deg": 0.0,
                "hfov_deg": 60.0,
            },
            "detections": [{"label": "face", "class_id": 0, "score": 0.9, "box": [10, 20, 100, 120]}] * n,
        }
    ).encode()


def metrics(node: str, ts: float, frames: int, dets: int, version: int = 1, state: str = "running"):
    return json.dumps(
        {
            "schema": "edgerun.metrics/1",
            "node": node,
            "ts": ts,
            "summary": {
                "model": "blazeface_short",
                "model_version": version,
                "engine": "tflite",
                "state": state,
                "frames": frames,
                "detections": dets,
                "fps": 9.0,
                "latency_p99_ms": 42.5,
                "dropped": 3,
            },
            "mqtt": {},
        }
    ).encode()


def obj(i: int, last_seen: float, **extra):
    return {
        "schema": "edgerun.object/1",
        "id": f"o{i}",
        "label": "face",
        "east_m": 1.0 + i,
        "north_m": 2.0,
        "uncertainty_m": 0.5,
        "first_seen": last_seen - 5,
        "last_seen": last_seen,
        "score": 0.8,
        "owner": "d1",
        "seen_by": ["d1", "d2", "d3"],
        "ts": last_seen,
        **extra,
    }


def test_detections_give_position_heading_footprint_and_a_trail():
    m = FleetModel()
    for i in range(5):
        m.ingest("edgerun/d1/detections", detections("d1", east=10.0 + i), T0 + i)
    node = m.nodes["d1"]
    assert node.pose == {"east_m": 14.0, "north_m": 12.0, "up_m": 6.0, "yaw_deg": 0.0, "hfov_deg": 60.0}
    assert [p[1] for p in node.trail] == [10.0, 11.0, 12.0, 13.0, 14.0]
    # 6 m up, 60 degrees across 640 px: 6.93 m wide, 5.2 m tall, nose (image top) to the north
    (e1, n1), (e2, _), _, (_, n4) = node.footprint
    assert e2 - e1 == pytest.approx(6.93, abs=0.02) and n1 - n4 == pytest.approx(5.2, abs=0.02)
    assert n1 > 12.0 > n4
    assert (node.model, node.model_version, node.engine, len(node.boxes)) == ("blazeface_short", 1, "tflite", 1)
    assert m.snapshot(T0 + 5)["nodes"]["d1"]["state"] == "online"


def test_trail_keeps_one_point_a_second_and_only_the_last_minutes():
    m = FleetModel(trail_s=10.0)
    for i in range(100):
        m.ingest("edgerun/d1/detections", detections("d1", east=float(i)), T0 + i * 0.5)
    trail = m.nodes["d1"].trail
    assert len(trail) <= 11
    assert trail[-1][0] - trail[0][0] <= 10.0


def test_footprint_turns_with_yaw_and_vanishes_above_the_horizon():
    pose = pose_from_payload(
        {"east_m": 0, "north_m": 0, "up_m": 6, "yaw_deg": 90, "pitch_deg": 0, "roll_deg": 0, "hfov_deg": 60}
    )
    corners = footprint(pose, 640, 480)
    # heading east: the image top (nose) is the eastern edge, the image's left is north
    top_left, top_right = corners[0], corners[1]
    assert top_left[0] > 0 and top_right[0] > 0 and top_left[1] > top_right[1]
    tilted = pose_from_payload({"east_m": 0, "north_m": 0, "up_m": 6, "pitch_deg": 80, "hfov_deg": 60})
    assert footprint(tilted, 640, 480) is None
    assert pose_from_payload({"east_m": "x", "north_m": 0, "up_m": 1}) is None
    assert pose_from_payload(None) is None


def test_metrics_rates_are_measured_per_interval_and_restart_on_a_new_model():
    m = FleetModel()
    m.ingest("edgerun/d1/metrics", metrics("d1", T0, 100, 50), T0)
    assert m.nodes["d1"].fps == 9.0  # the node's own average until two samples exist
    m.ingest("edgerun/d1/metrics", metrics("d1", T0 + 2, 120, 60), T0 + 2)
    node = m.nodes["d1"]
    assert node.fps == 10.0 and node.detection_rate == 0.5
    assert (node.p99_ms, node.dropped, node.health) == (42.5, 3, "running")
    m.ingest("edgerun/d1/metrics", metrics("d1", T0 + 4, 140, 60, version=2), T0 + 4)
    assert node.fps is None and node.detection_rate is None  # v2 is judged on v2's frames only
    m.ingest("edgerun/d1/metrics", metrics("d1", T0 + 6, 150, 60, version=2), T0 + 6)
    assert node.fps == 5.0 and node.detection_rate == 0.0


def test_status_will_marks_dead_a_clean_stop_is_not_and_silence_goes_stale():
    m = FleetModel(stale_s=10.0)
    for node in ("d1", "d2", "d3"):
        m.ingest(f"edgerun/{node}/status", b"online", T0)
        m.ingest(f"edgerun/{node}/detections", detections(node), T0)
    m.ingest("edgerun/d1/status", b"offline", T0 + 1)  # the broker's will: no "stopping" before it
    m.ingest(
        "edgerun/d2/events",
        json.dumps(
            {"schema": "edgerun.event/1", "node": "d2", "kind": "health", "state": "stopping", "reasons": {}}
        ).encode(),
        T0 + 1,
    )
    m.ingest("edgerun/d2/status", b"offline", T0 + 1)
    states = {k: v["state"] for k, v in m.snapshot(T0 + 2)["nodes"].items()}
    assert states == {"d1": "dead", "d2": "stopped", "d3": "online"}
    assert m.snapshot(T0 + 11)["nodes"]["d3"]["state"] == "stale"
    texts = [e["text"] for e in m.events if e["node"] == "d1"]
    assert "offline (last will: connection lost)" in texts


def test_health_engine_and_ota_events_set_the_node_and_the_log():
    m = FleetModel()
    ev = {"schema": "edgerun.event/1", "node": "d1", "ts": T0}
    m.ingest(
        "edgerun/d1/events",
        json.dumps({**ev, "kind": "health", "state": "degraded", "reasons": {"engine": "tensorrt failed"}}).encode(),
        T0,
    )
    m.ingest(
        "edgerun/d1/events",
        json.dumps(
            {**ev, "kind": "engine", "event": "failover", "from": "tensorrt", "to": "tflite", "reason": "hang"}
        ).encode(),
        T0,
    )
    m.ingest(
        "edgerun/d1/events",
        json.dumps({**ev, "kind": "ota", "step": "rolled_back", "version": 2, "reason": "p99 too high"}).encode(),
        T0,
    )
    node = m.nodes["d1"]
    assert node.health == "degraded" and node.reasons == {"engine": "tensorrt failed"}
    assert node.engine == "tflite" and node.fallback
    assert node.ota_outcomes == {2: "rolled_back"}
    assert [e["level"] for e in m.events] == ["warn", "warn", "error"]
    assert m.events[2]["text"] == "ota rolled_back v2 p99 too high"


def test_swarm_view_counts_members_and_places_a_node_without_pose():
    m = FleetModel()
    view = {
        "schema": "edgerun.swarm/1",
        "node": "d1",
        "members": [
            {
                "name": "d1",
                "state": "alive",
                "incarnation": 3,
                "meta": {"east": 5.0, "north": 6.0, "http": "127.0.0.1:1"},
            },
            {"name": "d2", "state": "alive", "incarnation": 1, "meta": {}},
            {"name": "d3", "state": "dead", "incarnation": 2, "meta": {}},
        ],
    }
    m.ingest("edgerun/d1/swarm", json.dumps(view).encode(), T0)
    node = m.nodes["d1"]
    assert node.swarm_seen == 1 and node.pose["east_m"] == 5.0 and node.http == "127.0.0.1:1"


def test_objects_are_validated_and_bounded_by_least_recently_seen():
    m = FleetModel(max_objects=3)
    for i in range(5):
        m.ingest("edgerun/fleet/objects", json.dumps(obj(i, T0 + i)).encode(), T0 + i)
    assert sorted(m.objects) == ["o2", "o3", "o4"]
    assert m.objects["o4"]["seen_count"] == 3 and m.objects["o4"]["owner"] == "d1"
    m.ingest("edgerun/fleet/objects", json.dumps(obj(9, T0, east_m="north")).encode(), T0)
    assert m.dropped["bad_object"] == 1 and "o9" not in m.objects
    delta = m.take_delta(T0 + 10)
    assert sorted(o["id"] for o in delta["objects"]) == ["o2", "o3", "o4"]
    assert m.take_delta(T0 + 10) is None  # nothing changed since


@pytest.mark.parametrize(
    ("topic", "payload", "reason"),
    [
        ("edgerun/d1/detections", b"\xff\xfe", "malformed"),
        ("edgerun/d1/detections", b"[1, 2]", "malformed"),
        (
            "edgerun/d1/detections",
            json.dumps({"schema": "edgerun.detections/2", "node": "d1"}).encode(),
            "wrong_schema",
        ),
        ("edgerun/d1/detections", detections("d2"), "node_mismatch"),
        ("edgerun/d1/metrics", b"x" * (300 * 1024), "oversized"),
        ("edgerun/d1/status", b"maybe", "malformed"),
        ("edgerun/bad id!/status", b"online", "bad_node_id"),
        ("edgerun/d1/whatever", b"{}", "unknown_topic"),
        ("edgerun/d1/swarm", json.dumps({"schema": "edgerun.swarm/1", "members": 3}).encode(), "malformed"),
    ],
)
def test_bad_payloads_are_dropped_and_counted_by_reason(topic, payload, reason):
    m = FleetModel()
    m.ingest(topic, payload, T0)
    assert m.dropped == {reason: 1}
    assert "d1" not in m.nodes or m.nodes["d1"].model == ""


def test_node_count_is_bounded_forgetting_the_longest_silent_first():
    m = FleetModel(max_nodes=2, stale_s=10.0)
    for i in range(4):
        m.ingest(f"edgerun/n{i}/status", b"online", T0)
    assert sorted(m.nodes) == ["n0", "n1"] and m.dropped["too_many_nodes"] == 2  # both still live
    m.ingest("edgerun/n1/status", b"online", T0 + 20)
    m.take_delta(T0 + 20)
    m.ingest("edgerun/n5/status", b"online", T0 + 21)  # n0 went silent 21 s ago: it makes room
    assert sorted(m.nodes) == ["n1", "n5"]
    assert m.take_delta(T0 + 21)["removed_nodes"] == ["n0"]


def test_a_node_http_address_is_taken_only_as_host_and_port():
    m = FleetModel()
    for address, kept in (
        ("127.0.0.1:8089", "127.0.0.1:8089"),
        ("evil/path:1", "127.0.0.1:8089"),
        ("[::1]:80", "[::1]:80"),
        ("host:80/x?y", "[::1]:80"),
    ):
        doc = json.loads(metrics("d1", T0, 1, 1))
        doc["summary"]["http"] = address
        m.ingest("edgerun/d1/metrics", json.dumps(doc).encode(), T0)
        assert m.nodes["d1"].http == kept


def test_events_are_bounded_and_deltas_carry_only_new_ones():
    m = FleetModel(max_events=10)
    ev = {"schema": "edgerun.event/1", "node": "d1", "ts": T0, "kind": "swarm", "event": "join", "member": "d2"}
    for _ in range(25):
        m.ingest("edgerun/d1/events", json.dumps(ev).encode(), T0)
    assert len(m.events) == 10
    assert len(m.take_delta(T0)["events"]) == 10
    m.ingest("edgerun/d1/events", json.dumps(ev).encode(), T0)
    assert len(m.take_delta(T0)["events"]) == 1
    assert m.events[-1]["text"] == "swarm event=join member=d2"


def test_objects_come_from_the_stream_and_from_each_objects_retained_topic():
    """A station started after the finds reads each object's retained latest (edgerun/fleet/objects/<id>);
    version 2 objects carry lat/lon, version 1 ones their east/north only."""
    m = FleetModel()
    v2 = {**obj(1, T0), "schema": "edgerun.object/2", "lat": 53.1172073, "lon": -4.1297391, "alt_m": 100.0}
    m.ingest("edgerun/fleet/objects/o1", json.dumps(v2).encode(), T0)
    m.ingest("edgerun/fleet/objects", json.dumps(obj(2, T0)).encode(), T0)
    m.ingest("edgerun/fleet/objects/o3/image", json.dumps(obj(3, T0)).encode(), T0)  # not an object topic
    assert sorted(m.objects) == ["o1", "o2"]
    assert (m.objects["o1"]["lat"], m.objects["o1"]["lon"], m.objects["o1"]["east_m"]) == (53.1172073, -4.1297391, 2.0)
    assert m.objects["o2"]["lat"] is None and m.objects["o2"]["east_m"] == 3.0


def test_parse_object_accepts_a_seen_by_count():
    parsed = parse_object({"id": 7, "label": "person", "east_m": 1, "north_m": 2, "seen_by": 4})
    assert parsed["id"] == "7" and parsed["seen_count"] == 4 and parsed["seen_by"] == []
    assert parse_object({"id": "x", "label": "face", "east_m": float("nan"), "north_m": 0}) is None


def test_a_silent_node_is_dead_only_when_live_peers_say_so():
    m = FleetModel(stale_s=10.0)

    def view(reporter: str, states: dict[str, str]) -> bytes:
        members = [{"name": reporter, "state": "alive", "incarnation": 1, "meta": {}}]
        members += [{"name": k, "state": v, "incarnation": 1, "meta": {}} for k, v in states.items()]
        return json.dumps({"schema": "edgerun.swarm/1", "node": reporter, "members": members}).encode()

    for node in ("d1", "d2", "d3"):
        m.ingest(f"edgerun/{node}/detections", detections(node), T0)
    # d3 falls silent on MQTT; at first its peers still hear it over gossip (out of the broker's reach)
    m.ingest("edgerun/d1/swarm", view("d1", {"d2": "alive", "d3": "alive"}), T0 + 11)
    m.ingest("edgerun/d2/swarm", view("d2", {"d1": "alive", "d3": "alive"}), T0 + 11)
    m.ingest("edgerun/d1/detections", detections("d1"), T0 + 11)
    m.ingest("edgerun/d2/detections", detections("d2"), T0 + 11)
    assert m.snapshot(T0 + 12)["nodes"]["d3"]["state"] == "stale"
    m.ingest("edgerun/d1/swarm", view("d1", {"d2": "alive", "d3": "dead"}), T0 + 13)
    m.ingest("edgerun/d2/swarm", view("d2", {"d1": "alive", "d3": "dead"}), T0 + 13)
    assert m.snapshot(T0 + 14)["nodes"]["d3"]["state"] == "dead"
    assert m.snapshot(T0 + 14)["nodes"]["d1"]["state"] == "online"


def test_a_node_the_broker_does_not_hear_is_shown_from_its_peers_gossip():
    m = FleetModel(stale_s=10.0)
    meta = {
        "model": "blazeface_short",
        "version": 2,
        "engine": "tflite",
        "fallback": True,
        "health": "degraded",
        "fps": 7.5,
        "east": 3.0,
        "north": 4.0,
        "yaw": 90.0,
    }
    view = {
        "schema": "edgerun.swarm/1",
        "node": "d1",
        "members": [
            {"name": "d1", "state": "alive", "incarnation": 1, "meta": {}},
            {"name": "d9", "state": "alive", "incarnation": 4, "meta": meta},
        ],
    }
    m.ingest("edgerun/d1/detections", detections("d1"), T0)
    m.ingest("edgerun/d1/swarm", json.dumps(view).encode(), T0)
    d9 = m.snapshot(T0)["nodes"]["d9"]
    assert d9["via_swarm"] and d9["state"] == "stale"
    assert (d9["model"], d9["model_version"], d9["engine"], d9["fallback"], d9["fps"]) == (
        "blazeface_short",
        2,
        "tflite",
        True,
        7.5,
    )
    assert d9["pose"]["east_m"] == 3.0 and d9["pose"]["yaw_deg"] == 90.0
    m.ingest("edgerun/d9/detections", detections("d9", version=3), T0 + 1)  # heard directly again
    d9 = m.snapshot(T0 + 1)["nodes"]["d9"]
    assert not d9["via_swarm"] and d9["model_version"] == 3 and d9["state"] == "degraded"  # last health known
    m.ingest("edgerun/d1/swarm", json.dumps(view).encode(), T0 + 2)  # gossip does not override fresh data
    assert m.nodes["d9"].model_version == 3


def test_deeply_nested_json_is_dropped_not_raised():
    m = FleetModel()
    deep = b"[" * 120_000 + b"]" * 120_000
    m.ingest("edgerun/d1/detections", deep, T0)
    m.ingest("edgerun/fleet/objects", deep, T0)
    assert m.dropped == {"malformed": 2}


@settings(max_examples=500, deadline=None)
@given(
    topic=st.sampled_from(
        [
            "edgerun/d1/detections",
            "edgerun/d1/events",
            "edgerun/d1/status",
            "edgerun/d1/metrics",
            "edgerun/d1/swarm",
            "edgerun/fleet/objects",
            "edgerun/fleet/releases/m",
            "edgerun/fleet/rollouts/m",
            "edgerun/station/events",
            "x/y",
        ]
    ),
    payload=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none()
            | st.booleans()
            | st.floats()
            | st.integers()
            | st.text(max_size=20)
            | st.sampled_from(
                [
                    "edgerun.detections/1",
                    "edgerun.metrics/1",
                    "edgerun.swarm/1",
                    "edgerun.object/1",
                    "d1",
                    "health",
                    "engine",
                    "ota",
                    "model",
                    "alive",
                    "dead",
                    "failover",
                    "rolled_back",
                ]
            ),
            lambda kids: (
                st.lists(kids, max_size=4)
                | st.dictionaries(
                    st.sampled_from(
                        [
                            "schema",
                            "node",
                            "pose",
                            "frame",
                            "model",
                            "detections",
                            "box",
                            "summary",
                            "members",
                            "meta",
                            "id",
                            "label",
                            "east_m",
                            "north_m",
                            "seen_by",
                            "kind",
                            "state",
                            "reasons",
                            "version",
                            "ts",
                        ]
                    ),
                    kids,
                    max_size=6,
                )
            ),
            max_leaves=30,
        ).map(lambda v: json.dumps(v).encode()),
    ),
)
def test_no_payload_makes_the_model_raise(topic, payload):
    m = FleetModel()
    m.ingest(topic, payload, T0)
    m.take_delta(T0 + 1)
    json.dumps(m.snapshot(T0 + 1), default=str)

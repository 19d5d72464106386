"""The DDS sink with real Cyclone DDS participants in other processes.

Every participant here, in this process or a child, is created with the
loopback-only config (interface lo, multicast off, 127.0.0.1 peer) and a
random domain id, so nothing leaves the machine and parallel runs never mix.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from brokers import PYTHON, dds_domain_id, loopback_config, make_batch, python_env

pytest.importorskip("cyclonedds")

from edgerun.config import DdsSinkConfig
from edgerun.sinks import sink_class
from edgerun.sinks.dds import DdsSink, stamp_of

NODE = "test-node"

# A ROS 2 subscriber as another vendor would write it: its own type definitions with the
# ROS DDS names and vision_msgs 4.x layout, nothing imported from edgerun.
ROS2_SUBSCRIBER = textwrap.dedent(
    """
    import json, math, sys, time
    from dataclasses import dataclass, field
    from cyclonedds.domain import Domain, DomainParticipant
    from cyclonedds.idl import IdlStruct
    from cyclonedds.idl.types import array, float64, int32, sequence, uint32
    from cyclonedds.qos import Policy, Qos
    from cyclonedds.sub import DataReader
    from cyclonedds.topic import Topic

    @dataclass
    class Time(IdlStruct, typename="builtin_interfaces::msg::dds_::Time_"):
        sec: int32
        nanosec: uint32

    @dataclass
    class Header(IdlStruct, typename="std_msgs::msg::dds_::Header_"):
        stamp: Time
        frame_id: str

    @dataclass
    class Point2D(IdlStruct, typename="vision_msgs::msg::dds_::Point2D_"):
        x: float64
        y: float64

    @dataclass
    class Pose2D(IdlStruct, typename="vision_msgs::msg::dds_::Pose2D_"):
        position: Point2D
        theta: float64

    @dataclass
    class BoundingBox2D(IdlStruct, typename="vision_msgs::msg::dds_::BoundingBox2D_"):
        center: Pose2D
        size_x: float64
        size_y: float64

    @dataclass
    class ObjectHypothesis(IdlStruct, typename="vision_msgs::msg::dds_::ObjectHypothesis_"):
        class_id: str
        score: float64

    @dataclass
    class Point(IdlStruct, typename="geometry_msgs::msg::dds_::Point_"):
        x: float64
        y: float64
        z: float64

    @dataclass
    class Quaternion(IdlStruct, typename="geometry_msgs::msg::dds_::Quaternion_"):
        x: float64
        y: float64
        z: float64
        w: float64

    @dataclass
    class Pose(IdlStruct, typename="geometry_msgs::msg::dds_::Pose_"):
        position: Point
        orientation: Quaternion

    @dataclass
    class PoseWithCovariance(IdlStruct, typename="geometry_msgs::msg::dds_::PoseWithCovariance_"):
        pose: Pose
        covariance: array[float64, 36]

    @dataclass
    class ObjectHypothesisWithPose(IdlStruct, typename="vision_msgs::msg::dds_::ObjectHypothesisWithPose_"):
        hypothesis: ObjectHypothesis
        pose: PoseWithCovariance

    @dataclass
    class Detection2D(IdlStruct, typename="vision_msgs::msg::dds_::Detection2D_"):
        header: Header
        results: sequence[ObjectHypothesisWithPose]
        bbox: BoundingBox2D
        id: str

    @dataclass
    class Detection2DArray(IdlStruct, typename="vision_msgs::msg::dds_::Detection2DArray_"):
        header: Header
        detections: sequence[Detection2D]

    config, domain_id, topic_name, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    domain = Domain(domain_id, config)
    participant = DomainParticipant(domain_id)
    # rmw_cyclonedds' sensor-data subscription: best effort, XCDR1.
    qos = Qos(Policy.Reliability.BestEffort, Policy.History.KeepLast(50),
              Policy.DataRepresentation(use_cdrv0_representation=True))
    reader = DataReader(participant, Topic(participant, topic_name, Detection2DArray, qos=qos), qos=qos)
    print("READY", flush=True)
    got, deadline = 0, time.monotonic() + 60
    while got < count and time.monotonic() < deadline:
        for msg in reader.take(N=10):
            if not isinstance(msg, Detection2DArray):
                continue
            got += 1
            print(json.dumps({
                "stamp": [msg.header.stamp.sec, msg.header.stamp.nanosec],
                "frame_id": msg.header.frame_id,
                "detections": [{
                    "header_frame_id": d.header.frame_id,
                    "class_id": d.results[0].hypothesis.class_id,
                    "score": d.results[0].hypothesis.score,
                    "center": [d.bbox.center.position.x, d.bbox.center.position.y],
                    "theta": d.bbox.center.theta,
                    "size": [d.bbox.size_x, d.bbox.size_y],
                    "orientation_w": d.results[0].pose.pose.orientation.w,
                    "covariance_len": len(d.results[0].pose.covariance),
                    "id": d.id,
                } for d in msg.detections],
            }), flush=True)
        time.sleep(0.01)
    sys.exit(0 if got >= count else 1)
    """
)


async def publish_while(sink: DdsSink, procs: list[subprocess.Popen[str]], sent: dict[Any, dict[str, Any]]) -> None:
    """Write a batch every 50 ms until every reader process has exited (discovery takes its own time)."""
    seq = 0
    while any(p.poll() is None for p in procs) and seq < 1200:
        batch = make_batch(seq, node_id=NODE, keypoints=2 if seq % 2 else 0, pose=seq % 3 != 0)
        t_submit = time.monotonic()
        sent[seq] = batch.to_payload(t_submit)
        sink.submit(batch, t_submit)
        seq += 1
        await asyncio.sleep(0.05)


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=30))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_registered_by_key() -> None:
    assert sink_class("dds") is DdsSink


def test_ros2_subscriber_with_its_own_types_receives_detection2darray(tmp_path: Path) -> None:
    domain = dds_domain_id()
    script = tmp_path / "ros2_subscriber.py"
    script.write_text(ROS2_SUBSCRIBER)
    topic = "rt/test_node/detections"  # ROS namespace from the node id, "-" made "_"
    sub = subprocess.Popen(
        [PYTHON, str(script), loopback_config(), str(domain), topic, "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    listener = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "edgerun.commands.listen",
            "--dds",
            "--ros2",
            "--domain",
            str(domain),
            "--count",
            "2",
            "--seconds",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    procs = [sub, listener]
    sent: dict[Any, dict[str, Any]] = {}
    try:
        assert sub.stdout is not None and sub.stdout.readline().strip() == "READY"

        async def go() -> DdsSink:
            sink = DdsSink(DdsSinkConfig(enabled=True, domain_id=domain, ros2=True, frame_id="cam0"), NODE)
            await sink.start()
            assert sink.stats.connected and sink.status_reason == "" and sink.ros2_topic == topic
            await publish_while(sink, procs, sent)
            await sink.close(1.0)
            return sink

        sink = asyncio.run(go())
    finally:
        outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sink.stats.errors == 0
    by_stamp = {tuple(stamp_of(p["ts"])): p for p in sent.values()}
    lines = [json.loads(line) for line in outs[0][0].splitlines()]
    assert len(lines) == 3
    for msg in lines:
        expected = by_stamp[tuple(msg["stamp"])]
        assert msg["frame_id"] == "cam0"
        assert len(msg["detections"]) == len(expected["detections"])
        for got, want in zip(msg["detections"], expected["detections"]):
            x1, y1, x2, y2 = want["box"]
            assert got["class_id"] == want["label"] and got["score"] == want["score"]
            assert got["center"] == pytest.approx([(x1 + x2) / 2, (y1 + y2) / 2])
            assert got["size"] == pytest.approx([x2 - x1, y2 - y1])
            assert (got["theta"], got["orientation_w"], got["covariance_len"]) == (0.0, 1.0, 36)
            assert got["header_frame_id"] == "cam0"
    human = outs[1][0].splitlines()
    assert len(human) == 2 and all(line.startswith(f"{topic} [cam0] ") and " 2 det: face " in line for line in human)


def test_native_topic_round_trips_through_the_listener() -> None:
    domain = dds_domain_id()
    listener = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "edgerun.commands.listen",
            "--dds",
            "--json",
            "--domain",
            str(domain),
            "--count",
            "4",
            "--seconds",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    sent: dict[Any, dict[str, Any]] = {}
    try:

        async def go() -> DdsSink:
            sink = DdsSink(DdsSinkConfig(enabled=True, domain_id=domain, reliable=True), NODE)
            await sink.start()
            await publish_while(sink, [listener], sent)
            await sink.close(1.0)
            return sink

        sink = asyncio.run(go())
    finally:
        outs = finish([listener])
    assert listener.returncode == 0, outs
    received = [json.loads(line) for line in outs[0][0].splitlines()]
    assert len(received) == 4
    for payload in received:
        assert payload == sent[payload["seq"]]  # every field, exactly: the native type carries the payload
    seqs = [p["seq"] for p in received]
    assert seqs == sorted(seqs)
    assert sink.stats.sent == len(sent) and sink.stats.dropped == 0


def test_qos_profiles() -> None:
    from cyclonedds.qos import Policy
    from cyclonedds.util import duration

    domain = dds_domain_id()

    async def go(**kw: Any) -> Any:
        sink = DdsSink(DdsSinkConfig(enabled=True, domain_id=domain, ros2=True, **kw), NODE)
        await sink.start()
        qos = (sink._native_writer.get_qos(), sink._ros2_writer.get_qos())
        await sink.close(0.5)
        return qos

    native_qos, ros_qos = asyncio.run(go())
    for qos in (native_qos, ros_qos):
        assert qos[Policy.Reliability] == Policy.Reliability.BestEffort
        assert qos[Policy.History] == Policy.History.KeepLast(5)
    assert ros_qos[Policy.DataRepresentation].use_cdrv0_representation
    native_qos, _ = asyncio.run(go(reliable=True, max_blocking_ms=7))
    assert native_qos[Policy.Reliability] == Policy.Reliability.Reliable(max_blocking_time=duration(milliseconds=7))
    assert native_qos[Policy.History] == Policy.History.KeepLast(10)


def test_missing_interface_is_an_outage_not_a_crash() -> None:
    async def go() -> tuple[bool, str, int, int]:
        sink = DdsSink(DdsSinkConfig(enabled=True, domain_id=dds_domain_id(), interface="nosuchif0", outbox=4), NODE)
        await sink.start()  # must not raise
        for seq in range(6):
            sink.submit(make_batch(seq), time.monotonic())
        state = (sink.stats.connected, sink.status_reason, sink.stats.dropped, len(sink._outbox))
        await sink.close(0.2)
        return state

    connected, reason, dropped, queued = asyncio.run(go())
    assert not connected
    assert reason.startswith("dds domain ") and "nosuchif0: cannot start Cyclone DDS" in reason
    assert (dropped, queued) == (2, 4)


class _BlockedWriter:
    """Fault injection: a reliable write held up by a stalled reader, until the test releases it.

    Cyclone's KEEP_LAST writers do not block on a stalled reader (only KEEP_ALL ones do), so
    the stall is injected around the real writer; the released writes go through it.
    """

    def __init__(self, real: Any) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release_timed_out = False

    def write(self, sample: Any, timestamp: int = 0) -> None:
        self.entered.set()
        if not self.release.wait(10.0):
            self.release_timed_out = True
        self.real.write(sample, timestamp=timestamp)


def test_a_blocked_write_never_holds_the_event_loop() -> None:
    async def go() -> tuple[DdsSink, _BlockedWriter, int]:
        sink = DdsSink(DdsSinkConfig(enabled=True, domain_id=dds_domain_id(), reliable=True, outbox=4), NODE)
        await sink.start()
        blocked = _BlockedWriter(sink._native_writer)
        sink._native_writer = blocked
        sink.submit(make_batch(0), time.monotonic())
        # The loop keeps running while the writer is stuck: this wait is served by the loop itself.
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, blocked.entered.wait, 10.0)
        for seq in range(1, 8):  # 7 more into an outbox of 4: the 3 oldest are dropped and counted
            sink.submit(make_batch(seq), time.monotonic())
            await asyncio.sleep(0)
        queued_while_blocked = len(sink._outbox)
        blocked.release.set()  # released by the loop: proof that the loop was not the one blocked
        await sink.close(5.0)
        return sink, blocked, queued_while_blocked

    sink, blocked, queued = asyncio.run(go())
    assert not blocked.release_timed_out
    assert queued == 4
    assert (sink.stats.submitted, sink.stats.sent, sink.stats.dropped) == (8, 5, 3)
    assert sink._writer is None  # the writer thread ended with close()


def test_dds_enabled_without_cyclonedds_is_a_config_error(tmp_path: Path, blazeface_bundle: Any) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        f'[node]\nlog_level = "warning"\n[model]\nbundle = "{blazeface_bundle.root}"\n'
        "[source]\nfps = 0.0\n[source.replay]\nframes = 2\n[sinks.jsonl]\nenabled = false\n"
        "[service]\nhttp_enabled = false\n[sinks.dds]\nenabled = true\n"
    )
    # Cyclone is installed here: hide it the way a missing package looks (import fails).
    code = (
        "import sys; sys.modules['cyclonedds'] = None; from edgerun.cli import main; "
        f"sys.exit(main(['run', '-c', {str(config)!r}]))"
    )
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, env=python_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edgerun: error: sinks.dds.enabled: Cyclone DDS is not installed")
    assert "pip install 'edgerun[dds]'" in lines[0]


def test_fleet_objects_reach_a_dds_reader_keyed_by_id() -> None:
    """A fleet object written by the sink arrives at another participant's reader field for field."""
    from cyclonedds.domain import DomainParticipant
    from cyclonedds.sub import DataReader
    from cyclonedds.topic import Topic

    from edgerun.sinks.dds import open_domain, release_domain, writer_qos
    from edgerun.sinks.idl import native

    domain = dds_domain_id()
    obj = {
        "schema": "edgerun.object/2",
        "id": "5f0c2a9d11e04b7a",
        "label": "person",
        "lat": 53.1171234,
        "lon": -4.1298765,
        "alt_m": 100.0,
        "east_m": 12.5,
        "north_m": -3.25,
        "origin": [53.117, -4.13, 100.0],
        "uncertainty_m": 1.1,
        "first_seen": 1795000000.5,
        "last_seen": 1795000004.25,
        "score": 0.91,
        "owner": "drone-2",
        "seen_by": ["drone-1", "drone-2"],
        "ts": 1795000004.5,
    }

    async def go() -> tuple[DdsSink, list[Any]]:
        sink = DdsSink(DdsSinkConfig(enabled=True, domain_id=domain), NODE)
        await sink.start()
        participant = DomainParticipant(domain)
        qos = writer_qos(True, 1, 5)
        reader = DataReader(participant, Topic(participant, "edgerun/objects", native.FleetObject, qos=qos), qos=qos)
        got: list[Any] = []
        for _ in range(200):  # until discovery matched the reader and the writer
            sink.publish_object(obj)
            await asyncio.sleep(0.05)
            got = reader.take(N=10)
            if got:
                break
        await sink.close(1.0)
        return sink, got

    open_domain(domain, loopback_config())
    try:
        sink, got = asyncio.run(go())
    finally:
        release_domain(domain)
    assert got, "no fleet object arrived"
    sample = got[0]
    assert (sample.id, sample.owner, list(sample.seen_by), sample.label) == (
        obj["id"],
        obj["owner"],
        obj["seen_by"],
        obj["label"],
    )
    assert (sample.east_m, sample.north_m, sample.score) == (obj["east_m"], obj["north_m"], obj["score"])
    assert (sample.lat, sample.lon, sample.alt_m) == (obj["lat"], obj["lon"], obj["alt_m"])
    assert sink.counters()["objects_sent"] >= 1 and sink.counters()["objects_dropped"] == 0


def test_listen_dds_without_cyclonedds_is_one_line() -> None:
    code = (
        "import sys; sys.modules['cyclonedds'] = None; from edgerun.cli import main; "
        "sys.exit(main(['listen', '--dds', '--seconds', '1']))"
    )
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, env=python_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgerun: error: listen --dds: Cyclone DDS is not installed")

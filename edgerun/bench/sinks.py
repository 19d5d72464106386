"""``edgerun bench --sinks``: what publishing costs, per sink, on loopback.

For MQTT QoS 0, MQTT QoS 1 (each against a private mosquitto) and DDS (native
topic, best effort, loopback only) this measures, in one run:

* ``publish_batches_per_s``: batches the sink hands off per second with its outbox kept full
  (QoS 0: written to the socket; QoS 1: acknowledged by the broker; DDS: written).
* ``sustained_batches_per_s``: batches a subscriber in another process receives per second in
  that same saturated window (``delivered_fraction`` = sustained / publish).
* ``latency_ms_p50`` / ``latency_ms_p99``: submit to receipt at that subscriber, with the
  batches paced at ``latency_rate_per_s`` (100/s), the added latency of the sink path.

The subscriber runs as ``python -m edgerun.bench.sinks subscribe ...`` so it does not share
the publisher's GIL; both sides read CLOCK_MONOTONIC, which is one clock across processes
on Linux. Batches look like BlazeFace output (3 faces, 6 keypoints each).

``dds_stall`` measures what a stalled reader costs the event loop: a reliable DDS sink
(native and ROS 2 writers) publishes at ``STALL_RATE_PER_S`` to a real reliable reader
(KeepAll, small resource limits) in another process that is stopped with SIGSTOP, so it
neither takes samples nor acknowledges them; a probe task on the loop sleeps 1 ms over and
over and records how late it wakes (``loop_lag_ms_*``). ``--dds-sink FILE`` runs the same
measurement against another revision's ``dds.py`` (before/after comparisons).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import random
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgerun.types import DetectionBatch, Detections, FrameMeta, Pose

LATENCY_RATE_PER_S = 100.0
STALL_RATE_PER_S = 500.0
_BENCH_NODE = "bench-node"


def synthetic_batch(seq: int, n: int = 3, keypoints: int = 6) -> DetectionBatch:
    """A BlazeFace-sized batch whose numbers depend on ``seq``."""
    rng = np.random.default_rng(seq)
    x1 = rng.uniform(0, 560, n)
    y1 = rng.uniform(0, 400, n)
    boxes = np.stack([x1, y1, x1 + 60, y1 + 70], axis=1).astype(np.float32)
    det = Detections(
        boxes=boxes,
        scores=rng.uniform(0.5, 1.0, n).astype(np.float32),
        class_ids=np.zeros(n, np.int32),
        keypoints=rng.uniform(0, 480, (n, keypoints, 2)).astype(np.float32) if keypoints else None,
    )
    meta = FrameMeta(
        seq=seq,
        source="replay",
        width=640,
        height=480,
        wall_time=time.time(),
        t_capture=time.monotonic(),
        pose=Pose(3.1, -2.0, 6.0, 0.0, 3.0, 0.5),
    )
    return DetectionBatch(_BENCH_NODE, meta, det, ("face",), "blazeface_short", 1, "tflite")


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values), q)), 3) if values else None


# -- the subscriber process ----------------------------------------------------------------------


class _LineSink:
    """Collects "seq t_recv" lines and flushes them in chunks, so receiving is not a syscall per message."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._flush_loop, daemon=True).start()

    def add(self, seq: int, t: float) -> None:
        with self._lock:
            self._lines.append(f"{seq} {t:.6f}\n")

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if lines:
            sys.stdout.write("".join(lines))
            sys.stdout.flush()

    def _flush_loop(self) -> None:
        while not self._stop.wait(0.05):
            self.flush()


def _subscribe_mqtt(port: int, topic: str, qos: int) -> None:
    import msgspec

    from edgerun.mqtt_client import new_client

    class SeqOnly(msgspec.Struct):
        seq: int

    decoder = msgspec.json.Decoder(SeqOnly)
    out = _LineSink()
    client = new_client(id_prefix="edgerun-bench-subscriber")

    def on_connect(c: Any, u: Any, f: Any, rc: Any, p: Any) -> None:
        c.subscribe(topic, qos)

    def on_subscribe(c: Any, u: Any, mid: Any, rcs: Any, p: Any) -> None:
        print("READY", flush=True)

    def on_message(c: Any, u: Any, msg: Any) -> None:
        t = time.monotonic()
        try:
            out.add(decoder.decode(msg.payload).seq, t)
        except msgspec.DecodeError:
            pass

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.loop_forever()


def _stalled_dds_reader(domain_id: int) -> None:
    """A reliable reader that will be stopped (SIGSTOP): KeepAll with room for 16 samples, native and ROS 2."""
    from cyclonedds.domain import DomainParticipant
    from cyclonedds.qos import Policy, Qos
    from cyclonedds.sub import DataReader
    from cyclonedds.topic import Topic
    from cyclonedds.util import duration

    from edgerun.sinks.dds import loopback_config, open_domain, ros2_namespace
    from edgerun.sinks.idl import native, ros2

    open_domain(domain_id, loopback_config())
    participant = DomainParticipant(domain_id)
    qos = Qos(
        Policy.Reliability.Reliable(duration(seconds=1)), Policy.History.KeepAll, Policy.ResourceLimits(max_samples=16)
    )
    ros_qos = Qos(
        Policy.Reliability.Reliable(duration(seconds=1)),
        Policy.History.KeepAll,
        Policy.ResourceLimits(max_samples=16),
        Policy.DataRepresentation(use_cdrv0_representation=True),
    )
    ros_topic = Topic(participant, ros2.topic_name(ros2_namespace("", _BENCH_NODE)), ros2.Detection2DArray, qos=ros_qos)
    readers = [
        DataReader(participant, Topic(participant, native.TOPIC, native.DetectionBatch, qos=qos), qos=qos),
        DataReader(participant, ros_topic, qos=ros_qos),
    ]
    print("READY", flush=True)
    while readers:
        time.sleep(1.0)


def _subscribe_dds(domain_id: int) -> None:
    from cyclonedds.core import InstanceState, ReadCondition, SampleState, ViewState, WaitSet
    from cyclonedds.domain import DomainParticipant
    from cyclonedds.qos import Policy, Qos
    from cyclonedds.sub import DataReader
    from cyclonedds.topic import Topic
    from cyclonedds.util import duration

    from edgerun.sinks.dds import loopback_config, open_domain
    from edgerun.sinks.idl import native

    open_domain(domain_id, loopback_config())
    participant = DomainParticipant(domain_id)
    qos = Qos(Policy.Reliability.BestEffort, Policy.History.KeepLast(1000))
    reader = DataReader(participant, Topic(participant, native.TOPIC, native.DetectionBatch, qos=qos), qos=qos)
    waitset = WaitSet(participant)
    waitset.attach(ReadCondition(reader, SampleState.NotRead | ViewState.Any | InstanceState.Any))
    out = _LineSink()
    print("READY", flush=True)
    while True:
        waitset.wait(duration(milliseconds=100))
        t = time.monotonic()
        for sample in reader.take(N=256):
            if isinstance(sample, native.DetectionBatch):
                out.add(sample.seq, t)


# -- the publisher side ------------------------------------------------------------------------


@dataclass
class _Receipts:
    """What the subscriber process reported: seq -> receive time."""

    times: dict[int, float] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def received_between(self, seqs: range, t0: float, t1: float) -> int:
        return sum(1 for s in seqs if t0 <= self.times.get(s, -1.0) <= t1)


@contextlib.asynccontextmanager
async def _subscriber(*args: str) -> AsyncIterator[_Receipts]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edgerun.bench.sinks",
        "subscribe",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    receipts = _Receipts()

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode().strip()
            if line == "READY":
                receipts.ready.set()
                continue
            seq, _, t = line.partition(" ")
            receipts.times.setdefault(int(seq), float(t))

    reader = asyncio.create_task(read())
    try:
        await asyncio.wait_for(receipts.ready.wait(), 30)
        yield receipts
    finally:
        proc.kill()
        await proc.wait()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def _measure(sink: Any, receipts: _Receipts, seconds: float, first_seq: int) -> dict[str, Any]:
    """Saturate the sink for ``seconds``, then pace it at 100/s for ``seconds`` and time each batch."""
    settle = min(1.0, 0.2 + seconds)  # for what is in flight to arrive; short in CI's short form
    # Warm-up: until the subscriber sees batches (DDS discovery, broker subscription).
    seq = first_seq
    deadline = time.monotonic() + 20
    while not receipts.times and time.monotonic() < deadline:
        sink.submit(synthetic_batch(seq), time.monotonic())
        seq += 1
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)

    templates = [synthetic_batch(i) for i in range(64)]
    payload_bytes = len(json.dumps(templates[0].to_payload(0.0), separators=(",", ":")))
    capacity = sink._outbox.capacity
    start_seq = seq = max(seq, first_seq) + 1000
    sent0, dropped0 = sink.stats.sent, sink.stats.dropped
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        # Keep the outbox well stocked but never full: this phase measures the sink, not drop-oldest.
        while len(sink._outbox) < capacity // 2:
            template = templates[seq % len(templates)]
            batch = dataclasses.replace(template, meta=dataclasses.replace(template.meta, seq=seq))
            sink.submit(batch, time.monotonic())
            seq += 1
        await asyncio.sleep(0.001)
    t1 = time.monotonic()
    published = sink.stats.sent - sent0
    saturated = range(start_seq, seq)
    await asyncio.sleep(settle)
    received = receipts.received_between(saturated, t0, t1)
    dropped = sink.stats.dropped - dropped0
    # Clear what the saturation left queued before timing single batches.
    while len(sink._outbox) or getattr(sink, "_inflight", None):
        if time.monotonic() - t1 > 30:
            break
        await asyncio.sleep(0.01)

    seq += 1000
    submitted: dict[int, float] = {}
    period = 1.0 / LATENCY_RATE_PER_S
    t_next = time.monotonic()
    t_end = t_next + seconds
    while t_next < t_end:
        batch = synthetic_batch(seq)
        now = time.monotonic()
        submitted[seq] = now
        sink.submit(batch, now)
        seq += 1
        t_next += period
        await asyncio.sleep(max(0.0, t_next - time.monotonic()))
    await asyncio.sleep(settle)
    latencies = [(receipts.times[s] - t) * 1000.0 for s, t in submitted.items() if s in receipts.times]
    return {
        "publish_batches_per_s": round(published / (t1 - t0), 1),
        "sustained_batches_per_s": round(received / (t1 - t0), 1),
        "delivered_fraction": round(received / max(1, published), 4),
        "saturation_dropped": dropped,
        "latency_rate_per_s": LATENCY_RATE_PER_S,
        "latency_ms_p50": _percentile(latencies, 50),
        "latency_ms_p99": _percentile(latencies, 99),
        "latency_delivered_fraction": round(len(latencies) / max(1, len(submitted)), 4),
        "payload_bytes": payload_bytes,
    }


async def _bench_mqtt(port: int, qos: int, seconds: float) -> dict[str, Any]:
    from edgerun.config import MqttSinkConfig
    from edgerun.sinks.mqtt import MqttSink

    topic = f"edgerun/{_BENCH_NODE}/detections"
    cfg = MqttSinkConfig(
        enabled=True,
        host="127.0.0.1",
        port=port,
        qos_detections=qos,
        outbox=2000,
        metrics_interval_s=0.0,
        message_expiry_s=0,
    )
    async with _subscriber("mqtt", "--port", str(port), "--topic", topic, "--qos", str(qos)) as receipts:
        sink = MqttSink(cfg, _BENCH_NODE)
        await sink.start()
        if not sink.stats.connected:
            raise RuntimeError(sink.status_reason)
        try:
            result = await _measure(sink, receipts, seconds, first_seq=0)
        finally:
            await sink.close(1.0)
    result["inflight_limit"] = sink.inflight_limit
    return result


async def _bench_dds(seconds: float) -> dict[str, Any]:
    from edgerun.config import DdsSinkConfig
    from edgerun.sinks.dds import DdsSink

    domain = random.SystemRandom().randint(1, 230)
    cfg = DdsSinkConfig(enabled=True, domain_id=domain, outbox=2000)
    async with _subscriber("dds", "--domain", str(domain)) as receipts:
        sink = DdsSink(cfg, _BENCH_NODE)
        await sink.start()
        try:
            result = await _measure(sink, receipts, seconds, first_seq=0)
        finally:
            await sink.close(1.0)
    result["domain_id"] = domain
    return result


def _dds_sink_class(module_file: str | None) -> Any:
    """This revision's DdsSink, or the one in another revision's ``dds.py`` (for before/after runs)."""
    if module_file is None:
        from edgerun.sinks.dds import DdsSink

        return DdsSink
    spec = importlib.util.spec_from_file_location("edgerun_bench_other_dds", module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DdsSink


async def bench_dds_stall(
    seconds: float = 3.0, max_blocking_ms: int = 5, sink_module: str | None = None
) -> dict[str, Any]:
    """How late the event loop runs while a reliable DDS sink publishes to a stopped reader."""
    from edgerun.config import DdsSinkConfig

    sink_cls = _dds_sink_class(sink_module)
    domain = random.SystemRandom().randint(1, 230)
    cfg = DdsSinkConfig(
        enabled=True,
        domain_id=domain,
        reliable=True,
        ros2=True,
        ros2_namespace=_BENCH_NODE,
        max_blocking_ms=max_blocking_ms,
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edgerun.bench.sinks",
        "subscribe",
        "dds-stalled",
        "--domain",
        str(domain),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    lags: list[float] = []
    sink = sink_cls(cfg, _BENCH_NODE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"READY":
            raise RuntimeError("the stalled DDS reader did not start")
        await sink.start()
        # Matched when the writers see the reader (discovery on loopback takes a moment).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            matched = [w.get_matched_subscriptions() for w in (sink._native_writer, sink._ros2_writer)]
            if all(matched):
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the DDS writers never matched the reader")
        proc.send_signal(signal.SIGSTOP)  # the reader neither takes nor acknowledges from now on
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.001)
                lags.append((time.monotonic() - t - 0.001) * 1000.0)

        probing = asyncio.create_task(probe())
        period = 1.0 / STALL_RATE_PER_S
        seq, t0 = 0, time.monotonic()
        t_next = t0
        while time.monotonic() - t0 < seconds:
            sink.submit(synthetic_batch(seq), time.monotonic())
            seq += 1
            t_next += period
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
        done.set()
        await probing
        elapsed = time.monotonic() - t0
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        await proc.wait()
        await sink.close(0.5)
    ordered = sorted(lags)
    return {
        "sink_module": sink_module or "edgerun.sinks.dds",
        "seconds": round(elapsed, 2),
        "rate_per_s": STALL_RATE_PER_S,
        "writers": 2,
        "max_blocking_ms": max_blocking_ms,
        "submitted": seq,
        "sent": sink.stats.sent,
        "dropped": sink.stats.dropped,
        "write_timeouts": getattr(sink, "write_timeouts", None),
        "loop_lag_ms_p50": _percentile(ordered, 50),
        "loop_lag_ms_p99": _percentile(ordered, 99),
        "loop_lag_ms_max": round(ordered[-1], 3) if ordered else None,
        "loop_wakeups": len(ordered),
    }


async def bench_sinks(seconds: float = 3.0) -> dict[str, Any]:
    """Throughput and added latency of the MQTT (QoS 0, QoS 1) and DDS sinks on loopback."""
    from edgerun.sinks.mosquitto import run_mosquitto

    sinks: dict[str, Any] = {}
    with run_mosquitto() as broker:
        for qos in (0, 1):
            sinks[f"mqtt_qos{qos}"] = await _bench_mqtt(broker.port, qos, seconds)
    sinks["dds"] = await _bench_dds(seconds)
    return {
        "seconds": seconds,
        "sinks": sinks,
        # Per-sink saturation throughput at a subscriber, the number to compare across machines.
        "sustained_batches_per_s": {key: r["sustained_batches_per_s"] for key, r in sinks.items()},
        "dds_stall": await bench_dds_stall(min(seconds, 3.0)),
    }


def format_table(result: dict[str, Any]) -> str:
    cols = [
        ("publish/s", "publish_batches_per_s"),
        ("sustained/s", "sustained_batches_per_s"),
        ("delivered", "delivered_fraction"),
        ("p50 ms", "latency_ms_p50"),
        ("p99 ms", "latency_ms_p99"),
    ]
    lines = ["sink       " + "".join(f"{name:>13}" for name, _ in cols)]
    for key, r in result["sinks"].items():
        lines.append(f"{key:<11}" + "".join(f"{r[k]!s:>13}" for _, k in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgerun.bench.sinks")
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("subscribe", help="(internal) the subscriber process")
    s.add_argument("kind", choices=["mqtt", "dds", "dds-stalled"])
    s.add_argument("--port", type=int, default=1883)
    s.add_argument("--topic", default=f"edgerun/{_BENCH_NODE}/detections")
    s.add_argument("--qos", type=int, default=0)
    s.add_argument("--domain", type=int, default=0)
    st = sub.add_parser("stall", help="only the stalled-reader DDS measurement")
    st.add_argument("--dds-sink", default=None, metavar="FILE", help="another revision's edgerun/sinks/dds.py")
    st.add_argument("--max-blocking-ms", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    if args.command == "subscribe":
        try:
            if args.kind == "mqtt":
                _subscribe_mqtt(args.port, args.topic, args.qos)
            elif args.kind == "dds-stalled":
                _stalled_dds_reader(args.domain)
            else:
                _subscribe_dds(args.domain)
        except KeyboardInterrupt:
            pass
        return 0
    if args.command == "stall":
        stall = asyncio.run(bench_dds_stall(args.seconds, args.max_blocking_ms, args.dds_sink))
        print(json.dumps(stall, indent=2))
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(stall, f, indent=2)
        return 0
    result = asyncio.run(bench_sinks(args.seconds))
    print(format_table(result))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

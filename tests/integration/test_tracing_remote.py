"""A frame inferred on a neighbour (offloading) is one trace across both nodes.

Two FrameTracers with their own node ids stand for the origin and the helper, each with its own OTLP exporter
sending real protobuf over HTTP to one receiver built on the opentelemetry-proto messages, as two nodes would send
to one collector. The origin fixes its frame's ids with ``begin()`` and hands the helper the ``traceparent`` (as the
offload request carries it); the helper records its ``infer`` span from it on a thread of its own (as the offload
server's serving threads do), and the receiver must see one trace whose span tree joins the two.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgerun.config import TracingConfig
from edgerun.testing.otlp import OtlpReceiver, ReceivedSpan, run_otlp_receiver
from edgerun.tracing import FrameTraceIds, FrameTracer
from edgerun.types import DetectionBatch, Detections, FrameMeta

STAGES = ["capture", "preprocess", "infer", "decode", "publish"]
SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "edgerun" / "schema" / "detections-v1.json").read_text())


def tracer(receiver: OtlpReceiver, node_id: str, ratio: float = 1.0, seed: int = 0) -> FrameTracer:
    import random

    cfg = TracingConfig(
        enabled=True, endpoint=receiver.endpoint, sample_ratio=ratio, export_interval_s=0.2, export_timeout_s=2.0
    )
    return FrameTracer(cfg, node_id, rng=random.Random(seed))


def published_batch(engine: str, trace: FrameTraceIds | None, seq: int = 7) -> tuple[DetectionBatch, float]:
    """A frame as the pipeline hands it to the node: stamps of each stage on the monotonic clock, one face."""
    t0 = time.monotonic() - 0.05
    meta = FrameMeta(seq=seq, source="replay", width=640, height=480, wall_time=time.time() - 0.05, t_capture=t0)
    detections = Detections(
        boxes=np.array([[10.0, 20.0, 110.0, 90.0]], np.float32),
        scores=np.array([0.9], np.float32),
        class_ids=np.array([0], np.int32),
    )
    stamps = {"read": t0 - 0.002, "preprocessed": t0 + 0.003, "inferred": t0 + 0.021, "decoded": t0 + 0.022}
    batch = DetectionBatch(
        "drone-1", meta, detections, ("face",), "blazeface_short", 1, engine, stamps=stamps, trace=trace
    )
    return batch, t0 + 0.023


def wall_ns(batch: DetectionBatch, t_mono: float) -> int:
    return int((t_mono + batch.meta.wall_time - batch.meta.t_capture) * 1e9)


def by_name(spans: list[ReceivedSpan], node: str) -> dict[str, ReceivedSpan]:
    mine = [s for s in spans if s.resource["service.instance.id"] == node]
    assert len({s.name for s in mine}) == len(mine), "one span per name and node"
    return {s.name: s for s in mine}


def check_origin_tree(spans: dict[str, ReceivedSpan], ids: FrameTraceIds) -> None:
    """The origin's frame: root ``frame`` with the ids begin() gave, the five stages tiling it."""
    root = spans["frame"]
    assert (root.trace_id, root.span_id, root.parent_id) == (ids.trace_id_hex, f"{ids.root_span_id:016x}", "")
    stages = sorted((s for s in spans.values() if s.parent_id == root.span_id), key=lambda s: s.start_ns)
    assert [s.name for s in stages] == STAGES
    assert stages[0].start_ns == root.start_ns and stages[-1].end_ns == root.end_ns
    for before, after in zip(stages, stages[1:]):
        assert before.end_ns == after.start_ns
    assert spans["infer"].span_id == f"{ids.infer_span_id:016x}"


def test_a_frame_inferred_on_a_helper_is_one_trace_across_both_nodes() -> None:
    with run_otlp_receiver() as receiver:
        origin = tracer(receiver, "drone-1", seed=1)
        helper = tracer(receiver, "jetson-2", seed=2)
        sent: list[FrameTraceIds | None] = []
        # The origin's infer worker decides and fixes the ids when it sends the frame, off the loop.
        worker = threading.Thread(target=lambda: sent.append(origin.begin()))
        worker.start()
        worker.join()
        ids = sent[0]
        assert ids is not None
        batch, t_published = published_batch("remote:jetson-2", ids)
        # The helper's serving thread infers inside the origin's infer stage and records it from the traceparent.
        start = wall_ns(batch, batch.stamps["preprocessed"] + 0.004)
        end = wall_ns(batch, batch.stamps["inferred"] - 0.004)
        recorded: list[bool] = []
        serving = threading.Thread(
            target=lambda: recorded.append(
                helper.remote_infer(
                    ids.traceparent(), start, end, {"edgerun.engine": "tensorrt", "edgerun.remote.origin": "drone-1"}
                )
            )
        )
        serving.start()
        serving.join()
        # A frame of the origin's own, traced beside it, keeps its infer span local.
        local_ids = origin.begin()
        assert local_ids is not None and local_ids.trace_id != ids.trace_id
        local, t_local = published_batch("tflite", local_ids, seq=8)
        origin.frame(batch, t_published, ["jsonl"])
        origin.frame(local, t_local, ["jsonl"])
        origin.close()
        helper.close()
        traces = receiver.traces()
    assert recorded == [True]
    assert set(traces) == {ids.trace_id_hex, local_ids.trace_id_hex}
    spans = traces[ids.trace_id_hex]
    assert {s.resource["service.instance.id"] for s in spans} == {"drone-1", "jetson-2"}
    mine = by_name(spans, "drone-1")
    check_origin_tree(mine, ids)
    client = mine["infer"]
    assert client.kind == "SPAN_KIND_CLIENT"
    assert client.attributes == {"edgerun.engine": "remote:jetson-2", "edgerun.remote.helper": "jetson-2"}
    (server,) = by_name(spans, "jetson-2").values()
    assert server.name == "infer" and server.kind == "SPAN_KIND_SERVER"
    assert server.parent_id == client.span_id and server.span_id not in {s.span_id for s in mine.values()}
    assert (server.start_ns, server.end_ns) == (start, end)
    assert server.attributes == {
        "edgerun.engine": "tensorrt",
        "edgerun.remote.origin": "drone-1",
        "edgerun.node": "jetson-2",
    }
    assert len(spans) == 1 + len(STAGES) + 1, "the origin's frame and the helper's infer, nothing else"
    assert helper.counts.snapshot()["remote_spans"] == 1
    # The local frame: the same tree, its infer span an internal one with no helper.
    local_spans = by_name(traces[local_ids.trace_id_hex], "drone-1")
    check_origin_tree(local_spans, local_ids)
    assert local_spans["infer"].kind == "SPAN_KIND_INTERNAL"
    assert local_spans["infer"].attributes == {"edgerun.engine": "tflite"}
    # Each payload names its frame's trace, and validates against the published schema.
    jsonschema = pytest.importorskip("jsonschema")
    for frame, frame_ids in ((batch, ids), (local, local_ids)):
        payload = json.loads(json.dumps(frame.to_payload(t_published)))
        jsonschema.validate(payload, SCHEMA)
        assert payload["trace_id"] == frame_ids.trace_id_hex


GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
MALFORMED = [
    "garbage",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # W3C ids are lowercase
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # the invalid trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # the invalid span id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the forbidden version
    GOOD + "-extra",  # version 00 has exactly four fields
    GOOD + "-" + "a" * 600,  # longer than any traceparent
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\x00",
    "\u00e9" * 55,
]


def test_garbage_traceparents_record_nothing_and_are_counted() -> None:
    with run_otlp_receiver() as receiver:
        helper = tracer(receiver, "jetson-2")
        t = time.time_ns()
        attrs = {"edgerun.engine": "onnx", "edgerun.remote.origin": "drone-1"}
        results = [helper.remote_infer(parent, t, t + 1000, attrs) for parent in MALFORMED]
        results.append(helper.remote_infer(GOOD[:-2] + "00", t, t + 1000, attrs))  # the origin does not record it
        results.append(helper.remote_infer("", t, t + 1000, attrs))  # no trace: an untraced frame, not counted
        counts = helper.counts.snapshot()
        assert results == [False] * (len(MALFORMED) + 2)
        assert counts["traceparents_dropped"] == {"malformed": len(MALFORMED), "unsampled": 1}
        assert counts["remote_spans"] == 0
        # The tracer goes on: the next good traceparent is recorded, and it is the only span the collector gets.
        assert helper.remote_infer(GOOD, t, t + 1000, attrs)
        helper.close()
        spans = list(receiver.spans)
    assert [(s.trace_id, s.parent_id, s.name) for s in spans] == [
        ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "infer")
    ]


def test_the_receiver_in_its_own_process_counts_what_arrived() -> None:
    """The bench's receiver (decoding outside the measured process) gets what a tracer exports, and stops."""
    from edgerun.testing.otlp import run_otlp_receiver_process

    with run_otlp_receiver_process() as receiver:
        assert receiver.span_count() == 0
        helper = FrameTracer(TracingConfig(enabled=True, endpoint=receiver.endpoint), "jetson-2")
        t = time.time_ns()
        attrs = {"edgerun.engine": "onnx", "edgerun.remote.origin": "drone-1"}
        assert all(helper.remote_infer(GOOD, t, t + 1000, attrs) for _ in range(3))
        helper.close()  # flushes: the spans are at the receiver when it returns
        assert receiver.span_count() == 3

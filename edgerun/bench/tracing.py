"""``edgerun bench --tracing``: what tracing frames costs a node, at 1 % and 100 % sampling, side by side.

A whole node in this process runs flat out over a preloaded clip (so any CPU tracing takes shows as frames per
second), once with tracing off, once at 1 % and once at 100 % sampling, exporting real OTLP to a receiver on
loopback (in a process of its own: decoding the spans is the collector's work, not the node's); the three
alternate for ``rounds`` rounds so load drifting on a shared machine hits all alike, and each reports its
median. Beside frames per second, each reports the CPU time the node's process spent per frame (all its threads,
the exporter's included), which other work on a shared machine disturbs far less than it disturbs the frame
rate. The receiver counts the spans that arrived, so the 100 % run also shows that every frame made it out.

Then the two calls offloading adds, timed alone: ``begin()`` (an origin's infer worker deciding and fixing a sent
frame's ids) and ``remote_infer()`` (a helper recording its span from the request's traceparent, its export
included in what the receiver counts).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from edgerun.bench.pipeline import _median, _node_fps, clip_dir, emit_result, resolve_bundle
from edgerun.testing.otlp import run_otlp_receiver_process

RATIOS = {"off": None, "sample_1pct": 0.01, "sample_100pct": 1.0}


def bench_tracing(model: str | None, seconds: float, rounds: int = 3) -> dict[str, Any]:
    bundle = resolve_bundle(model)
    with (
        tempfile.TemporaryDirectory(prefix="edgerun-bench-tracing-") as tmpdir,
        run_otlp_receiver_process() as receiver,
    ):
        clip = clip_dir(Path(tmpdir))
        base = {
            "node": {"id": "bench", "log_level": "warning"},
            "model": {"bundle": str(bundle.root)},
            "service": {"http_enabled": False},
            "source": {"kind": "images", "path": str(clip), "preload": True, "fps": 0.0},
            "sinks": {"jsonl": {"enabled": False}},
        }
        fps: dict[str, list[float]] = {name: [] for name in RATIOS}
        cpu_ms: dict[str, list[float]] = {name: [] for name in RATIOS}
        frames: dict[str, int] = dict.fromkeys(RATIOS, 0)
        spans: dict[str, int] = dict.fromkeys(RATIOS, 0)
        names = list(RATIOS)
        for i in range(rounds):
            # Each round starts with another setting, so what a run leaves behind (threads winding down, a warm
            # cache) does not always land on the same one.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                ratio = RATIOS[name]
                tracing: dict[str, Any] = {"enabled": False}
                if ratio is not None:
                    tracing = {"enabled": True, "endpoint": receiver.endpoint, "sample_ratio": ratio}
                before = receiver.span_count()
                cpu = time.process_time()
                summary = _node_fps({**base, "tracing": tracing}, seconds / rounds)
                cpu = time.process_time() - cpu
                fps[name].append(summary["fps"])
                frames[name] += summary["frames"]
                # Start-up (model load) included, alike for all three: the ratios stay fair.
                cpu_ms[name].append(round(cpu * 1000.0 / max(1, summary["frames"]), 3))
                spans[name] += receiver.span_count() - before  # the node flushed its spans before it returned
        off = _median(fps["off"])
        off_cpu = _median(cpu_ms["off"])
        result: dict[str, Any] = {"model": bundle.name, "rounds": rounds, "seconds_per_run": round(seconds / rounds, 2)}
        for name in RATIOS:
            result[f"{name}_fps"] = _median(fps[name])
            result[f"{name}_cpu_ms_per_frame"] = _median(cpu_ms[name])
            result[f"{name}_frames"] = frames[name]
            result[f"{name}_spans_received"] = spans[name]
            if name != "off":
                result[f"{name}_fps_ratio"] = round(_median(fps[name]) / off, 3) if off else None
                result[f"{name}_cpu_ratio"] = round(_median(cpu_ms[name]) / off_cpu, 3) if off_cpu else None
        result["spans_per_traced_frame"] = 6
        result.update(_call_costs(receiver))
        result["fps_rounds"] = fps
        result["cpu_ms_per_frame_rounds"] = cpu_ms
        return result


def _call_costs(receiver: Any, calls: int = 2000) -> dict[str, Any]:
    """CPU microseconds of the calling thread per ``begin()``, per ``frame()`` of a sampled frame (its six spans
    made and queued) and per ``remote_infer()`` (medians of 5 batches; the export runs on the SDK's own thread,
    not counted here, but in the node's CPU per frame above), and the spans received of those calls."""
    import numpy as np

    from edgerun.config import TracingConfig
    from edgerun.tracing import FrameTracer
    from edgerun.types import DetectionBatch, Detections, FrameMeta

    cfg = TracingConfig(enabled=True, endpoint=receiver.endpoint, sample_ratio=1.0, export_interval_s=0.2)
    tracer = FrameTracer(cfg, "bench-helper", rng=random.Random(0))
    attributes = {"edgerun.engine": "tflite", "edgerun.remote.origin": "bench-origin"}
    detections = Detections(
        boxes=np.array([[10.0, 20.0, 110.0, 90.0]], np.float32),
        scores=np.array([0.9], np.float32),
        class_ids=np.array([0], np.int32),
    )
    before = receiver.span_count()
    begin_us: list[float] = []
    frame_us: list[float] = []
    remote_us: list[float] = []
    batch = calls // 5
    # Below the exporter's queue (4096 spans) with six spans a frame: nothing is dropped for a full queue.
    frames_per_batch = min(batch, 500)
    for _ in range(5):
        t = time.thread_time()
        ids = [tracer.begin() for _ in range(batch)]
        begin_us.append((time.thread_time() - t) / batch * 1e6)
        t0 = time.monotonic()
        batches = [
            DetectionBatch(
                "bench-origin",
                FrameMeta(seq=i, source="bench", width=640, height=480, wall_time=time.time(), t_capture=t0),
                detections,
                ("face",),
                "bench",
                1,
                "tflite",
                stamps={"read": t0 - 0.002, "preprocessed": t0 + 0.003, "inferred": t0 + 0.02, "decoded": t0 + 0.021},
                trace=ids[i],
            )
            for i in range(frames_per_batch)
        ]
        t = time.thread_time()
        for frame in batches:
            tracer.frame(frame, t0 + 0.022, ["mqtt"])
        frame_us.append((time.thread_time() - t) / frames_per_batch * 1e6)
        time.sleep(1.0)  # the exporter drains its queue
        parents = [i.traceparent() for i in ids if i is not None]
        now = time.time_ns()
        t = time.thread_time()
        for parent in parents:
            tracer.remote_infer(parent, now, now + 1_000_000, attributes)
        remote_us.append((time.thread_time() - t) / len(parents) * 1e6)
        time.sleep(0.5)
    tracer.close()
    return {
        "begin_us": _median(begin_us),
        "frame_us": _median(frame_us),
        "remote_infer_us": _median(remote_us),
        "calls_timed": {"begin": batch * 5, "frame": frames_per_batch * 5, "remote_infer": batch * 5},
        "call_spans_received": receiver.span_count() - before,
        "call_spans_sent": frames_per_batch * 5 * 6 + batch * 5,
    }


def run_tracing_bench_command(args: argparse.Namespace) -> int:
    seconds = max(6.0, args.seconds * 2)
    # Runs of about 4 s whatever the length: a longer bench is more rounds, which a shared machine's noise needs.
    result = bench_tracing(args.model, seconds, rounds=max(3, int(seconds // 4)))
    summary = "\n".join(f"{key}: {value}" for key, value in result.items() if not isinstance(value, dict))
    emit_result(result, args, summary=summary)
    return 0

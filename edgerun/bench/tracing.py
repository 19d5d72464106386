"""``edgerun bench --tracing``: what tracing frames costs a node, at 1 % and 100 % sampling, side by side.

A whole node in this process runs flat out over a preloaded clip (so any CPU tracing takes shows as frames per
second), once with tracing off, once at 1 % and once at 100 % sampling, exporting real OTLP to a receiver on
loopback; the three alternate for ``rounds`` rounds so load drifting on a shared machine hits all alike, and
each reports its median. The receiver counts the spans that arrived, so the 100 % run also shows that every
frame made it out.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from edgerun.bench.pipeline import _median, _node_fps, clip_dir, emit_result, resolve_bundle
from edgerun.testing.otlp import run_otlp_receiver

RATIOS = {"off": None, "sample_1pct": 0.01, "sample_100pct": 1.0}


def bench_tracing(model: str | None, seconds: float, rounds: int = 3) -> dict[str, Any]:
    bundle = resolve_bundle(model)
    with tempfile.TemporaryDirectory(prefix="edgerun-bench-tracing-") as tmpdir, run_otlp_receiver() as receiver:
        clip = clip_dir(Path(tmpdir))
        base = {
            "node": {"id": "bench", "log_level": "warning"},
            "model": {"bundle": str(bundle.root)},
            "service": {"http_enabled": False},
            "source": {"kind": "images", "path": str(clip), "preload": True, "fps": 0.0},
            "sinks": {"jsonl": {"enabled": False}},
        }
        fps: dict[str, list[float]] = {name: [] for name in RATIOS}
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
                before = len(receiver.spans)
                summary = _node_fps({**base, "tracing": tracing}, seconds / rounds)
                fps[name].append(summary["fps"])
                frames[name] += summary["frames"]
                spans[name] += len(receiver.spans) - before  # the node flushed its spans before it returned
        off = _median(fps["off"])
        result: dict[str, Any] = {"model": bundle.name, "rounds": rounds, "seconds_per_run": round(seconds / rounds, 2)}
        for name in RATIOS:
            result[f"{name}_fps"] = _median(fps[name])
            result[f"{name}_frames"] = frames[name]
            result[f"{name}_spans_received"] = spans[name]
            if name != "off":
                result[f"{name}_fps_ratio"] = round(_median(fps[name]) / off, 3) if off else None
        result["spans_per_traced_frame"] = 6
        result["fps_rounds"] = fps
        return result


def run_tracing_bench_command(args: argparse.Namespace) -> int:
    result = bench_tracing(args.model, max(6.0, args.seconds * 2))
    summary = "\n".join(f"{key}: {value}" for key, value in result.items() if not isinstance(value, dict))
    emit_result(result, args, summary=summary)
    return 0

"""``edgerun bench``: throughput, latency and memory of one bundle, measured side by side in one run.

This machine and the boards are shared and noisy, so every figure that matters
is a ratio of two measurements taken in the same run: the pipeline against the
bare ``invoke()`` ceiling, against the naive loop tutorials write, and against
its own slowest stage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

from edgerun.config import SourceConfig
from edgerun.decoders import decoder_class
from edgerun.decoders.base import Decoder
from edgerun.engines.base import Engine, EngineOptions, engine_class
from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.models.demo import DEMO_MODELS, ensure_demo_bundle
from edgerun.pipeline.runner import ModelInfo, ModelRuntime, Pipeline, PipelineSettings
from edgerun.pipeline.stats import PipelineStats
from edgerun.preprocess import Preprocessor
from edgerun.sources import make_source
from edgerun.sources.base import Source
from edgerun.types import DetectionBatch

LARGE_ALLOC_BYTES = 64 * 1024
CLIP_FRAMES = 48


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def resolve_bundle(model: str | None) -> ModelBundle:
    if model is None or model in DEMO_MODELS:
        return ensure_demo_bundle(model or "blazeface_short")
    return load_bundle(model)


def open_engine(bundle: ModelBundle, threads: int) -> Engine:
    path = bundle.variant_path("tflite")
    assert path is not None
    return engine_class("tflite")(path, EngineOptions(num_threads=threads))


def make_decoder(bundle: ModelBundle, engine: Engine) -> Decoder:
    spec = bundle.manifest.decoder
    return decoder_class(spec.kind)(dict(spec.params), engine.input_spec, engine.output_specs)


def timed_rate(fn: Callable[[], None], seconds: float, min_iters: int = 5) -> tuple[float, float]:
    """(calls per second, median seconds per call) of ``fn`` over about ``seconds``."""
    fn()  # warm-up
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < min_iters:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return len(times) / sum(times), float(np.median(times))


def clip_dir(tmp: Path) -> Path:
    """A short recorded clip (PNG frames of the replay flight) that the images source preloads."""
    out = tmp / "clip"
    out.mkdir(exist_ok=True)
    replay = make_source(SourceConfig(kind="replay", fps=0))
    replay.open()
    image = np.zeros((replay.height, replay.width, 3), np.uint8)
    for i in range(CLIP_FRAMES):
        replay.read(image, i)
        cv2.imwrite(str(out / f"{i:04d}.png"), image)
    replay.close()
    return out


def open_clip(path: Path) -> Source:
    source = make_source(SourceConfig(kind="images", path=str(path), preload=True, loop=True, fps=0))
    source.open()
    return source


# -- phases --------------------------------------------------------------------


def _bare_rate(bundle: ModelBundle, threads: int, seconds: float) -> tuple[float, float]:
    engine = open_engine(bundle, threads)
    tensor = engine.allocate_input()
    tensor[...] = 0.25
    outputs = engine.allocate_outputs()
    try:
        return timed_rate(lambda: engine.infer(tensor, outputs), seconds)
    finally:
        engine.close()


def bench_bare(bundle: ModelBundle, seconds: float) -> dict[str, Any]:
    """The ceiling: invoke() on a fixed tensor, for each thread count; the best wins."""
    per_threads = {}
    for threads in range(1, (os.cpu_count() or 1) + 1):
        fps, median = _bare_rate(bundle, threads, seconds)
        per_threads[threads] = {"fps": round(fps, 2), "median_ms": round(median * 1000, 3)}
    best = max(per_threads, key=lambda t: per_threads[t]["fps"])
    return {
        "bare_invoke_fps": per_threads[best]["fps"],
        "median_invoke_ms": per_threads[best]["median_ms"],
        "bare_best_threads": best,
        "bare_by_threads": per_threads,
    }


def _naive_rate(bundle: ModelBundle, clip: list[np.ndarray], threads: int, seconds: float) -> float:
    pre = bundle.manifest.preprocess
    mean = np.asarray(pre.mean, np.float32)
    std = np.asarray(pre.std, np.float32)
    engine = open_engine(bundle, threads)
    decoder = make_decoder(bundle, engine)
    h, w = engine.input_spec.image_hw
    interp = engine._interp
    in_index = interp.get_input_details()[0]["index"]
    out_indices = [d["index"] for d in interp.get_output_details()]
    counter = [0]

    def step() -> None:
        frame = clip[counter[0] % len(clip)].copy()  # "read" a frame
        counter[0] += 1
        fh, fw = frame.shape[:2]
        scale = min(w / fw, h / fh)
        nw, nh = round(fw * scale), round(fh * scale)
        resized = cv2.resize(frame, (nw, nh))
        canvas = np.zeros((h, w, 3), np.uint8)
        top, left = (h - nh) // 2, (w - nw) // 2
        canvas[top : top + nh, left : left + nw] = resized
        rgb = cv2.cvtColor(canvas, cv2.COLOR_BGR2RGB)
        tensor = ((rgb.astype(np.float32) - mean) / std)[None]
        interp.set_tensor(in_index, tensor)
        interp.invoke()
        outs = [interp.get_tensor(i) for i in out_indices]
        det = decoder.decode(outs)
        json.dumps({"boxes": det.boxes.tolist(), "scores": det.scores.tolist()})

    try:
        return timed_rate(step, seconds)[0]
    finally:
        engine.close()


def bench_naive(bundle: ModelBundle, clip: list[np.ndarray], seconds: float) -> dict[str, Any]:
    """The sequential loop tutorials write: read, resize, invoke, decode, serialise, one frame at a time."""
    per_threads = {t: round(_naive_rate(bundle, clip, t, seconds), 2) for t in range(1, (os.cpu_count() or 1) + 1)}
    best = max(per_threads, key=lambda t: per_threads[t])
    return {"naive_fps": per_threads[best], "naive_best_threads": best, "naive_by_threads": per_threads}


def bench_stages(bundle: ModelBundle, source: Source, threads: int, seconds: float) -> dict[str, Any]:
    """Each stage alone, on its own thread, so the pipeline can be compared with its slowest stage."""
    engine = open_engine(bundle, threads)
    decoder = make_decoder(bundle, engine)
    pre = Preprocessor(bundle.manifest.preprocess, engine.input_spec, source.width, source.height)
    image = np.zeros((source.height, source.width, 3), np.uint8)
    tensor = engine.allocate_input()
    outputs = engine.allocate_outputs()
    seq = [0]

    def capture() -> None:
        source.read(image, seq[0])
        seq[0] += 1

    capture()
    pre(image, tensor)
    engine.infer(tensor, outputs)
    rates = {
        "capture": timed_rate(capture, seconds)[0],
        "preprocess": timed_rate(lambda: pre(image, tensor), seconds)[0],
        "infer": timed_rate(lambda: engine.infer(tensor, outputs), seconds)[0],
        "decode": timed_rate(lambda: decoder.decode(outputs), seconds)[0],
    }
    large = count_large_allocs(capture, pre, engine, decoder, image, tensor, outputs, frames=60)
    engine.close()
    bottleneck = min(rates, key=lambda k: rates[k])
    return {
        "stage_fps": {k: round(v, 2) for k, v in rates.items()},
        "bottleneck_stage": bottleneck,
        "bottleneck_fps": round(rates[bottleneck], 2),
        "large_allocs_per_frame": large,
    }


def count_large_allocs(
    capture: Callable[[], None],
    pre: Preprocessor,
    engine: Engine,
    decoder: Decoder,
    image: np.ndarray,
    tensor: np.ndarray,
    outputs: list[np.ndarray],
    frames: int,
) -> float:
    """Stage calls per frame whose transient peak allocation reached 64 KiB (tracemalloc).

    tracemalloc sees numpy's and OpenCV's array buffers. A call whose peak stays
    below 64 KiB over its starting point cannot have made a 64 KiB allocation,
    so 0 here proves the steady state allocates nothing image-sized.
    """
    calls: list[Callable[[], Any]] = [
        capture,
        lambda: pre(image, tensor),
        lambda: engine.infer(tensor, outputs),
        lambda: decoder.decode(outputs),
    ]
    for call in calls:  # warm caches and lazily made scratch buffers first
        call()
    tracemalloc.start()
    large = 0
    try:
        for _ in range(frames):
            for call in calls:
                tracemalloc.reset_peak()
                before, _ = tracemalloc.get_traced_memory()
                call()
                _, peak = tracemalloc.get_traced_memory()
                large += peak - before >= LARGE_ALLOC_BYTES
    finally:
        tracemalloc.stop()
    return large / frames


def run_pipeline(
    bundle: ModelBundle,
    source: Source,
    threads: int,
    seconds: float,
    policy: str,
    pace_fps: float = 0.0,
    sample_rss: bool = False,
) -> dict[str, Any]:
    """The pipeline as the node runs it: stage threads, batches into an asyncio loop, JSON encoded there."""
    import msgspec

    engine = open_engine(bundle, threads)
    decoder = make_decoder(bundle, engine)
    pre = Preprocessor(bundle.manifest.preprocess, engine.input_spec, source.width, source.height)
    stats = PipelineStats()
    encoder = msgspec.json.Encoder()
    loop = asyncio.new_event_loop()
    published: list[float] = []
    warm_after = 1.0

    def on_loop(batch: DetectionBatch) -> None:
        now = time.monotonic()
        encoder.encode(batch.to_payload(now))
        stats.published += 1
        if now - t_start > warm_after:
            stats.end_to_end.observe(now - batch.meta.t_capture)
            published.append(now)

    pipeline = Pipeline(
        node_id="bench",
        source=source,
        runtime=ModelRuntime(engine, pre, decoder, ModelInfo(bundle.name, bundle.version, bundle.labels)),
        on_batch=lambda b: loop.call_soon_threadsafe(on_loop, b),
        settings=PipelineSettings(queue_depth=1, policy=policy, pace_fps=pace_fps),
        stats=stats,
    )
    rss_samples: list[tuple[float, float]] = []

    async def main() -> None:
        pipeline.start()
        end = t_start + seconds
        while time.monotonic() < end:
            await asyncio.sleep(0.25)
            if sample_rss:
                rss_samples.append((time.monotonic() - t_start, rss_mb()))
        pipeline.stop()
        await loop.run_in_executor(None, pipeline.join, 2.0)

    t_start = time.monotonic()
    loop.run_until_complete(main())
    loop.close()
    engine.close()
    span = (published[-1] - published[0]) if len(published) > 1 else float("nan")
    result = {
        "fps": round((len(published) - 1) / span, 2) if len(published) > 1 else 0.0,
        "latency_p50_ms": round(stats.end_to_end.percentile_ms(50), 3),
        "latency_p99_ms": round(stats.end_to_end.percentile_ms(99), 3),
        "dropped": stats.dropped_total,
        "frames": stats.published,
    }
    if sample_rss and rss_samples:
        # Growth from the end of warm-up (10% of the run) to the end.
        warm = [r for t, r in rss_samples if t >= seconds * 0.1] or [rss_samples[0][1]]
        result["rss_mb"] = round(rss_samples[-1][1], 1)
        result["rss_growth_mb"] = round(rss_samples[-1][1] - warm[0], 2)
    return result


def bench_cold_start(bundle: ModelBundle, image_dir: Path, tmp: Path) -> float:
    """Process start to the first detection, for a real ``edgerun run`` subprocess."""
    out = tmp / "cold.jsonl"
    cfg = tmp / "cold.toml"
    cfg.write_text(
        f"""[node]
id = "cold"
log_level = "warning"
[source]
kind = "images"
path = "{image_dir}"
fps = 0
[model]
bundle = "{bundle.root}"
[sinks.jsonl]
path = "{out}"
[service]
http_enabled = false
"""
    )
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "edgerun", "run", "-c", str(cfg)], stdout=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < 60:
            if out.exists():
                for line in out.read_text().splitlines():
                    if '"label"' in line:
                        return round(time.monotonic() - t0, 3)
            if proc.poll() is not None:
                raise RuntimeError(f"cold-start node exited with {proc.returncode}")
            time.sleep(0.005)
        raise RuntimeError("cold-start node produced no detection within 60 s")
    finally:
        proc.terminate()
        proc.wait(5)


def detection_photo_dir(tmp: Path) -> Path:
    """A folder with one real photo the model finds something in (astronaut: a face and a person)."""
    from skimage import data

    folder = tmp / "photo"
    folder.mkdir(exist_ok=True)
    cv2.imwrite(str(folder / "astronaut.png"), cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR))
    return folder


def run_bench(model: str | None, seconds: float, soak_seconds: float | None = None) -> dict[str, Any]:
    bundle = resolve_bundle(model)
    result: dict[str, Any] = {"model": bundle.name, "model_version": bundle.version, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="edgerun-bench-") as tmpdir:
        tmp = Path(tmpdir)
        result["cold_start_s"] = bench_cold_start(bundle, detection_photo_dir(tmp), tmp)
        clip_path = clip_dir(tmp)
        source = open_clip(clip_path)
        clip = [cv2.imread(str(p)) for p in sorted(clip_path.glob("*.png"))]
        result.update(bench_bare(bundle, seconds / 2))
        result.update(bench_naive(bundle, clip, seconds / 2))
        runs = {}
        for threads in range(1, (os.cpu_count() or 1) + 1):
            runs[threads] = run_pipeline(bundle, source, threads, seconds, policy="block")
        best = max(runs, key=lambda t: runs[t]["fps"])
        result["pipeline_fps"] = runs[best]["fps"]
        result["pipeline_threads"] = best
        result["pipeline_by_threads"] = runs
        result.update(bench_stages(bundle, source, best, max(1.0, seconds / 4)))
        result["bottleneck_efficiency"] = round(result["pipeline_fps"] / result["bottleneck_fps"], 3)
        result["pipeline_vs_bare"] = round(result["pipeline_fps"] / result["bare_invoke_fps"], 3)
        result["pipeline_vs_naive"] = round(result["pipeline_fps"] / result["naive_fps"], 3)
        # Overload: a live camera at twice what the model can do; drop_oldest keeps latency bounded.
        overload = run_pipeline(
            bundle, source, best, seconds, policy="drop_oldest", pace_fps=2 * result["bare_invoke_fps"]
        )
        result["overload_source_fps"] = round(2 * result["bare_invoke_fps"], 2)
        result["overload_fps"] = overload["fps"]
        result["overload_p50_latency_ms"] = overload["latency_p50_ms"]
        result["overload_p99_latency_ms"] = overload["latency_p99_ms"]
        result["overload_dropped"] = overload["dropped"]
        result["overload_latency_bound_ms"] = round(3 * result["median_invoke_ms"] + 2, 3)
        soak = run_pipeline(
            bundle, source, best, soak_seconds or seconds, policy="drop_oldest", pace_fps=15.0, sample_rss=True
        )
        result["rss_mb"] = soak["rss_mb"]
        result["rss_growth_mb"] = soak["rss_growth_mb"]
        result["soak_seconds"] = soak_seconds or seconds
        source.close()
    return result


TABLE_COLUMNS = (
    ("model", "model"),
    ("bare_invoke_fps", "bare fps"),
    ("median_invoke_ms", "invoke ms"),
    ("naive_fps", "naive fps"),
    ("pipeline_fps", "pipeline fps"),
    ("pipeline_vs_bare", "pipe/bare"),
    ("pipeline_vs_naive", "pipe/naive"),
    ("bottleneck_stage", "bottleneck"),
    ("bottleneck_efficiency", "efficiency"),
    ("overload_p99_latency_ms", "overload p99 ms"),
    ("overload_latency_bound_ms", "bound ms"),
    ("large_allocs_per_frame", "big allocs/frame"),
    ("rss_mb", "rss MB"),
    ("rss_growth_mb", "rss growth MB"),
    ("cold_start_s", "cold start s"),
)


def format_table(results: list[dict[str, Any]]) -> str:
    header = "| " + " | ".join(title for _, title in TABLE_COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"
    rows = ["| " + " | ".join(str(r.get(key, "")) for key, _ in TABLE_COLUMNS) + " |" for r in results]
    return "\n".join([header, rule, *rows])


def run_bench_command(args: argparse.Namespace) -> int:
    if args.table is not None:
        results = [json.loads(Path(p).read_text()) for p in args.table]
        print(format_table(results))
        return 0
    result = run_bench(args.model, args.seconds, args.soak_seconds)
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0


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
import threading
import time
import tracemalloc
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

from edgerun.config import SourceConfig
from edgerun.decoders import decoder_class
from edgerun.decoders.base import Decoder
from edgerun.engines.base import Engine, EngineOptions, engine_class
from edgerun.engines.runtime import ModelInfo, ModelRuntime
from edgerun.engines.tflite import TFLiteEngine
from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.models.demo import DEMO_MODELS, ensure_demo_bundle
from edgerun.pipeline.runner import Pipeline, PipelineSettings
from edgerun.pipeline.stats import PipelineStats
from edgerun.preprocess import Preprocessor
from edgerun.progress import phases
from edgerun.sources import make_source
from edgerun.sources.base import Source
from edgerun.types import DetectionBatch

LARGE_ALLOC_BYTES = 64 * 1024
CLIP_FRAMES = 48


def resolve_bundle(model: str | None) -> ModelBundle:
    if model is None or model in DEMO_MODELS:
        return ensure_demo_bundle(model or "blazeface_short")
    return load_bundle(model)


def node_layout(policy: str, fallback: bool = False) -> tuple[int, int]:
    """(threads, replicas) the node gives its CPU engine under flow-control ``policy`` with default
    settings; ``fallback``: as the last resort behind an accelerator."""
    from edgerun.config import parse_config
    from edgerun.engines.factory import cpu_engine_layout

    return cpu_engine_layout(parse_config({"pipeline": {"policy": policy}}), fallback=fallback)


def open_engine(bundle: ModelBundle, threads: int, replicas: int = 1) -> Engine:
    """The CPU engine: ``replicas`` interpreters of ``threads`` threads (0: cores / replicas)."""
    path = bundle.variant_path("tflite")
    assert path is not None
    return engine_class("tflite")(path, EngineOptions(num_threads=threads, replicas=replicas))


def make_decoder(bundle: ModelBundle, engine: Engine) -> Decoder:
    spec = bundle.manifest.decoder
    return decoder_class(spec.kind)(dict(spec.params), engine.input_spec, engine.output_specs)


def timed_rate(fn: Callable[[], object], seconds: float, min_iters: int = 5) -> tuple[float, float]:
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


class CameraClip(Source):
    """A preloaded clip delivered the way a camera delivers frames, for the overload bench.

    ``read`` waits for the next tick of the device's own clock and copies the frame out, and
    ``synthetic_clock`` is False, so the pipeline treats it as live: a capture thread drains it
    and drops the stale frames, which is what a camera faster than the model costs. (A paced
    replay instead has its stale frames skipped undecoded by the workers.)
    """

    KEY = "bench-camera"
    synthetic_clock = False

    def __init__(self, clip: Source, fps: float) -> None:
        self.clip = clip
        self.width, self.height, self.fps = clip.width, clip.height, fps
        self._period = 1.0 / fps
        self._next = time.monotonic()

    @classmethod
    def from_config(cls, cfg: SourceConfig) -> Source:
        raise TypeError("CameraClip wraps an open source; it is not built from a config")

    def open(self) -> None:
        self._next = time.monotonic()

    def read(self, image: np.ndarray, seq: int) -> Any:
        delay = self._next - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._next = max(self._next + self._period, time.monotonic() - self._period)
        return self.clip.read(image, seq)


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


def _replicas_rate(bundle: ModelBundle, seconds: float) -> float:
    """``invoke()`` of the node's offline engine layout on fixed tensors, every replica busy at once."""
    engine = open_engine(bundle, *node_layout("block"))
    tensors = [engine.allocate_input() for _ in range(engine.concurrent_calls)]
    for tensor in tensors:
        tensor[...] = 0.25
    outputs = [engine.allocate_outputs() for _ in tensors]
    try:
        return side_by_side_rate([partial(engine.infer, t, o) for t, o in zip(tensors, outputs)], seconds)
    finally:
        engine.close()


def _naive_rate(bundle: ModelBundle, clip: list[np.ndarray], threads: int, seconds: float) -> float:
    pre = bundle.manifest.preprocess
    mean = np.asarray(pre.mean, np.float32)
    std = np.asarray(pre.std, np.float32)
    engine = open_engine(bundle, threads)
    assert isinstance(engine, TFLiteEngine)  # the naive loop drives the raw interpreter itself
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


def side_by_side_rate(calls: Sequence[Callable[[], object]], seconds: float) -> float:
    """Calls per second of all ``calls`` run at once, each looping on its own thread."""
    counts = [0] * len(calls)
    start = threading.Barrier(len(calls) + 1)
    stop = threading.Event()

    def loop(i: int) -> None:
        calls[i]()  # warm-up
        start.wait()
        while not stop.is_set():
            calls[i]()
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    done = sum(counts)
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    return done / elapsed


def bench_stages(bundle: ModelBundle, source: Source, seconds: float) -> dict[str, Any]:
    """Each stage alone, laid out as the node runs it, so the pipeline can be compared with its slowest stage.

    Capture is one thread; preprocess, infer and decode run on as many threads
    side by side as the pipeline has workers (one per interpreter replica),
    with the engine layout the node uses for offline input (policy block).
    """
    engine = open_engine(bundle, *node_layout("block"))
    workers = engine.concurrent_calls
    decoder = make_decoder(bundle, engine)
    pre = Preprocessor(bundle.manifest.preprocess, engine.input_spec, source.width, source.height)
    image = np.zeros((source.height, source.width, 3), np.uint8)
    seq = [0]

    def capture() -> None:
        source.read(image, seq[0])
        seq[0] += 1

    capture()
    pres = [pre] + [pre.clone() for _ in range(workers - 1)]
    decoders = [decoder] + [decoder.clone() for _ in range(workers - 1)]
    tensors = [engine.allocate_input() for _ in range(workers)]
    outputs = [engine.allocate_outputs() for _ in range(workers)]
    for i in range(workers):
        pres[i](image, tensors[i])
        engine.infer(tensors[i], outputs[i])
    per_worker = range(workers)
    rates = {
        "capture": timed_rate(capture, seconds)[0],
        "preprocess": side_by_side_rate([partial(pres[i], image, tensors[i]) for i in per_worker], seconds),
        "infer": side_by_side_rate([partial(engine.infer, tensors[i], outputs[i]) for i in per_worker], seconds),
        "decode": side_by_side_rate([partial(decoders[i].decode, outputs[i]) for i in per_worker], seconds),
    }
    large = count_large_allocs(capture, pre, engine, decoder, image, tensors[0], outputs[0], frames=60)
    engine.close()
    bottleneck = min(rates, key=lambda k: rates[k])
    return {
        "stage_fps": {k: round(v, 2) for k, v in rates.items()},
        "stage_workers": workers,
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
    layout: tuple[int, int],
    seconds: float,
    policy: str,
    pace_fps: float = 0.0,
    stage_threads: str = "auto",
) -> dict[str, Any]:
    """The pipeline as the node runs it: stage threads, batches into an asyncio loop, JSON encoded there.

    ``layout`` is (threads per interpreter, replicas), see ``node_layout``.
    """
    import msgspec

    engine = open_engine(bundle, *layout)
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
        settings=PipelineSettings(queue_depth=1, policy=policy, pace_fps=pace_fps, stage_threads=stage_threads),
        stats=stats,
    )

    async def main() -> None:
        pipeline.start()
        end = t_start + seconds
        while time.monotonic() < end:
            await asyncio.sleep(0.25)
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
    return result


def proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def bench_node_process(bundle: ModelBundle, image_dir: Path, tmp: Path, seconds: float) -> dict[str, Any]:
    """A real ``edgerun run`` subprocess: process start to first detection, then its RSS over ``seconds``.

    The source is a folder with one real photo, unpaced, so the node runs flat out
    (the worst case for memory churn); RSS growth is from the end of warm-up (10%
    of the run) to the end.
    """
    out = tmp / "node.jsonl"
    cfg = tmp / "node.toml"
    cfg.write_text(
        f"""[node]
id = "bench"
log_level = "warning"
[source]
kind = "images"
path = "{image_dir}"
fps = 0
preload = true
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
        cold_start = None
        while cold_start is None:
            if time.monotonic() - t0 > 60:
                raise RuntimeError("bench node produced no detection within 60 s")
            if proc.poll() is not None:
                raise RuntimeError(f"bench node exited with {proc.returncode}")
            if out.exists() and '"label"' in out.read_text():
                cold_start = time.monotonic() - t0
            else:
                time.sleep(0.005)
        samples: list[tuple[float, float]] = []
        t_run = time.monotonic()
        while time.monotonic() - t_run < seconds:
            time.sleep(0.5)
            samples.append((time.monotonic() - t_run, proc_rss_mb(proc.pid)))
            out.write_bytes(b"")  # keep the disk out of it: the file would grow for the whole soak
        warm = [r for t, r in samples if t >= seconds * 0.1] or [samples[0][1]]
        return {
            "cold_start_s": round(cold_start, 3),
            "rss_mb": round(max(r for _, r in samples), 1),
            "rss_growth_mb": round(samples[-1][1] - warm[0], 2),
            "soak_seconds": seconds,
        }
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


def _ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-round ratios."""
    return round(float(np.median([a / b for a, b in zip(numerators, denominators)])), 3)


def _read_frame(path: Path) -> np.ndarray:
    image = cv2.imread(str(path))
    if image is None:
        raise RuntimeError(f"cannot read the bench clip's frame {path}")
    return image


def _median(values: list[float]) -> float:
    return round(float(np.median(values)), 2)


def run_bench(model: str | None, seconds: float, soak_seconds: float | None = None, rounds: int = 5) -> dict[str, Any]:
    """All phases for one bundle. Thread counts are swept first; then bare, naive and pipeline
    run in interleaved rounds and each reports its median, so load drifting on a shared
    machine hits all three alike and their ratios stay fair."""
    bundle = resolve_bundle(model)
    cores = os.cpu_count() or 1
    result: dict[str, Any] = {"model": bundle.name, "model_version": bundle.version, "cores": cores}
    sweep_s = max(1.0, seconds / 4)
    round_s = max(1.5, seconds / rounds)
    with (
        tempfile.TemporaryDirectory(prefix="edgerun-bench-") as tmpdir,
        phases(f"bench {bundle.name}", rounds + 4) as progress,
    ):
        progress.step("thread sweep")
        tmp = Path(tmpdir)
        clip_path = clip_dir(tmp)
        source = open_clip(clip_path)
        clip = [_read_frame(p) for p in sorted(clip_path.glob("*.png"))]
        threads = range(1, cores + 1)
        bare_sweep = {t: round(_bare_rate(bundle, t, sweep_s)[0], 2) for t in threads}
        naive_sweep = {t: round(_naive_rate(bundle, clip, t, sweep_s), 2) for t in threads}
        # Every engine layout (threads per interpreter x replicas) in both stage layouts, for the record;
        # with policy block the node runs one single-threaded replica per core, stages fused.
        layouts = [(t, r) for t in threads for r in range(1, cores // t + 1)]
        pipe_sweep = {
            f"{t}x{r}-{mode}": run_pipeline(bundle, source, (t, r), sweep_s + 1.0, "block", stage_threads=mode)["fps"]
            for t, r in layouts
            for mode in ("separate", "fused")
        }
        bare_t = max(bare_sweep, key=bare_sweep.__getitem__)
        naive_t = max(naive_sweep, key=naive_sweep.__getitem__)
        pipe_layout, live_layout = node_layout("block"), node_layout("drop_oldest")
        result["threads_sweep_fps"] = {"bare": bare_sweep, "naive": naive_sweep, "pipeline": pipe_sweep}
        bare, medians, replicas, naive, pipe, pipe_p50 = [], [], [], [], [], []
        for i in range(rounds):
            progress.step(f"round {i + 1} of {rounds}: bare, replicas, naive, pipeline")
            fps, median = _bare_rate(bundle, bare_t, round_s)
            bare.append(fps)
            medians.append(median * 1000)
            replicas.append(_replicas_rate(bundle, round_s))
            naive.append(_naive_rate(bundle, clip, naive_t, round_s))
            run = run_pipeline(bundle, source, pipe_layout, round_s + 1.0, policy="block")
            pipe.append(run["fps"])
            pipe_p50.append(run["latency_p50_ms"])
        result.update(
            {
                "bare_invoke_fps": _median(bare),
                "median_invoke_ms": round(float(np.median(medians)), 3),
                "bare_threads": bare_t,
                "replicas_invoke_fps": _median(replicas),
                "naive_fps": _median(naive),
                "naive_threads": naive_t,
                "pipeline_fps": _median(pipe),
                "pipeline_layout": f"{pipe_layout[0]}x{pipe_layout[1]}",
                "pipeline_block_latency_p50_ms": _median(pipe_p50),
                "rounds": {
                    "bare": [round(x, 2) for x in bare],
                    "replicas": [round(x, 2) for x in replicas],
                    "naive": [round(x, 2) for x in naive],
                    "pipeline": pipe,
                },
            }
        )
        progress.step("stages")
        result.update(bench_stages(bundle, source, max(1.0, seconds / 4)))
        # Ratios are medians of per-round ratios: each round measures its phases back to back, so
        # load drifting on a shared machine cancels out. The infer stage alone (the replicas busy side
        # by side) was measured in every round; the other stages, far faster, once in bench_stages.
        others = [v for k, v in result["stage_fps"].items() if k != "infer"]
        ceilings = [min([r, *others]) for r in replicas]
        result["bottleneck_efficiency"] = _ratio(pipe, ceilings)
        result["pipeline_vs_bare"] = _ratio(pipe, bare)
        result["pipeline_vs_naive"] = _ratio(pipe, naive)
        # Overload: frames due at twice what the model can do; drop_oldest keeps latency bounded.
        # The node's live layout (one interpreter on every core): the clip replayed at that pace,
        # the same clip coming from a camera-like device (a capture thread reads and drops the
        # stale frames), and for the record the replay on the replicas.
        progress.step("overload")
        pace = 2 * result["bare_invoke_fps"]
        overload = run_pipeline(bundle, source, live_layout, seconds, policy="drop_oldest", pace_fps=pace)
        camera = run_pipeline(bundle, CameraClip(source, pace), live_layout, seconds, policy="drop_oldest")
        replicas_overload = run_pipeline(bundle, source, pipe_layout, seconds, policy="drop_oldest", pace_fps=pace)
        result["overload_layout"] = f"{live_layout[0]}x{live_layout[1]}"
        result["overload_replicas_fps"] = replicas_overload["fps"]
        result["overload_replicas_p50_latency_ms"] = replicas_overload["latency_p50_ms"]
        result["overload_replicas_p99_latency_ms"] = replicas_overload["latency_p99_ms"]
        result["overload_source_fps"] = round(2 * result["bare_invoke_fps"], 2)
        result["overload_fps"] = overload["fps"]
        result["overload_p50_latency_ms"] = overload["latency_p50_ms"]
        result["overload_p99_latency_ms"] = overload["latency_p99_ms"]
        result["overload_dropped"] = overload["dropped"]
        result["overload_camera_fps"] = camera["fps"]
        result["overload_camera_p50_latency_ms"] = camera["latency_p50_ms"]
        result["overload_camera_p99_latency_ms"] = camera["latency_p99_ms"]
        result["overload_latency_bound_ms"] = round(3 * result["median_invoke_ms"] + 2, 3)
        source.close()
        progress.step("node process")
        result.update(bench_node_process(bundle, detection_photo_dir(tmp), tmp, soak_seconds or seconds))
    return result


TABLE_COLUMNS = (
    ("model", "model"),
    ("bare_invoke_fps", "bare fps"),
    ("median_invoke_ms", "invoke ms"),
    ("replicas_invoke_fps", "replicas fps"),
    ("naive_fps", "naive fps"),
    ("pipeline_fps", "pipeline fps"),
    ("pipeline_vs_bare", "pipe/bare"),
    ("pipeline_vs_naive", "pipe/naive"),
    ("bottleneck_stage", "bottleneck"),
    ("bottleneck_efficiency", "efficiency"),
    ("overload_p99_latency_ms", "overload p99 ms"),
    ("overload_latency_bound_ms", "bound ms"),
    ("overload_camera_p99_latency_ms", "camera p99 ms"),
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


def emit_result(result: dict[str, Any], args: argparse.Namespace, summary: str | None = None) -> None:
    """Write a bench result where the options say: ``-o FILE`` writes its JSON there, ``--json`` prints it on
    stdout; with a file and no ``--json``, stdout gets only ``summary`` (a table a person reads), not the JSON
    a second time. With neither, the JSON goes to stdout: a result is never dropped."""
    text = json.dumps(result, indent=2)
    out = bench_out_path(args)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if getattr(args, "json_stdout", False) or not out:
        print(text)
    elif summary:
        print(summary)
    if out:
        print(f"wrote {out}", file=sys.stderr)


def bench_out_path(args: argparse.Namespace) -> str | None:
    """``-o/--out FILE``, or the old ``--json FILE`` spelling (``--json`` alone is the stdout switch)."""
    old = getattr(args, "json_file", None)
    return getattr(args, "out", None) or (old if isinstance(old, str) else None)


def run_bench_command(args: argparse.Namespace) -> int:
    if args.table is not None:
        results = [json.loads(Path(p).read_text()) for p in args.table]
        print(format_table(results))
        return 0
    result = run_bench(args.model, args.seconds, args.soak_seconds)
    emit_result(result, args, summary=format_table([result]))
    return 0


def _node_fps(config: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Run a whole Node in this process for ``seconds``; its summary."""
    from edgerun.config import parse_config
    from edgerun.node import Node

    node = Node(parse_config(config))
    asyncio.run(node.run(seconds=seconds, install_signals=False))
    return node.summary()


def bench_sink_overhead(bundle: ModelBundle, seconds: float, rounds: int = 3) -> dict[str, Any]:
    """Pipeline fps of a whole node with every sink on (JSONL, MQTT QoS 1, DDS) against no sink.

    Measured twice: at the demo's rate (replay at 15 fps; the sinks must not cost
    frames) and flat out (an unpaced clip; what the sinks cost in CPU shows as fps).
    Rounds alternate null/all so load drift on a shared machine hits both alike.
    """
    from edgerun.sinks.mosquitto import run_mosquitto

    with tempfile.TemporaryDirectory(prefix="edgerun-bench-sinks-") as tmpdir, run_mosquitto() as broker:
        tmp = Path(tmpdir)
        clip = clip_dir(tmp)
        base = {
            "node": {"id": "bench", "log_level": "warning"},
            "model": {"bundle": str(bundle.root)},
            "service": {"http_enabled": False},
        }
        sinks_on = {
            "jsonl": {"path": os.devnull},
            "mqtt": {"enabled": True, "port": broker.port, "qos_detections": 1},
            "dds": {"enabled": True, "domain_id": 17},
        }
        sinks_off = {"jsonl": {"enabled": False}}
        sources = {
            "demo_rate": {"kind": "replay", "fps": 15.0},
            "flat_out": {"kind": "images", "path": str(clip), "preload": True, "fps": 0.0},
        }
        result: dict[str, Any] = {}
        for name, source in sources.items():
            null, full = [], []
            for _ in range(rounds):
                null.append(_node_fps({**base, "source": source, "sinks": sinks_off}, seconds / rounds)["fps"])
                full.append(_node_fps({**base, "source": source, "sinks": sinks_on}, seconds / rounds)["fps"])
            result[f"{name}_null_fps"] = _median(null)
            result[f"{name}_all_sinks_fps"] = _median(full)
            result[f"{name}_fps_ratio"] = round(_median(full) / _median(null), 3) if _median(null) else None
        return result


def run_sinks_bench_command(args: argparse.Namespace) -> int:
    """``edgerun bench --sinks``: per-sink throughput and delivery latency, and what the sinks cost the pipeline."""
    from edgerun.bench.sinks import bench_sinks, format_table

    result = {"sinks": asyncio.run(bench_sinks(args.seconds))}
    result["pipeline"] = bench_sink_overhead(resolve_bundle(args.model), max(6.0, args.seconds * 2))
    pipeline = "\n".join(f"{key}: {value}" for key, value in result["pipeline"].items())
    emit_result(result, args, summary=f"{format_table(result['sinks'])}\n{pipeline}")
    return 0

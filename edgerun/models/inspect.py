"""``edgerun model inspect``: a bundle checked as a node checks it, and how fast its CPU variant warms up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from edgerun.decoders.base import output_fault
from edgerun.engines.base import EngineOptions, TensorSpec, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.errors import ModelError
from edgerun.models.bundle import load_bundle
from edgerun.sources.opencv import quiet_opencv


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": spec.name, "shape": list(spec.shape), "dtype": str(np.dtype(spec.dtype))}
    if spec.quantised:
        out["quantisation"] = {"scale": spec.scale, "zero_point": spec.zero_point}
    return out


def inspect_bundle(
    path: str, engine_key: str | None = None, warmup_runs: int = 5, image: str | Path | None = None
) -> dict[str, Any]:
    """What the bundle holds, checked as the node checks it: the decoder is built on the engine's real
    tensors and the labels are counted against its classes (ModelError, exit 2, when they disagree).

    With ``image``, the photo goes through the node's own preprocessing, engine and decoder, and the
    report lists what was detected in it (boxes in the photo's pixels).
    """
    frame = None
    if image is not None:
        with quiet_opencv():
            frame = cv2.imread(str(image), cv2.IMREAD_COLOR)
        if frame is None:
            raise ModelError(f"--image {image}: not a readable image")
    bundle = load_bundle(path)
    m = bundle.manifest
    engine_key = engine_key or bundle.cpu_engine
    model_path = bundle.variant_path(engine_key)
    if model_path is None:
        raise ModelError(f"{bundle.root}: no {engine_key} variant (has: {', '.join(m.variants)})")
    t0 = time.perf_counter()
    # The fallback as the node opens it: ONNX Runtime held to its CPU provider.
    device = "cpu" if engine_key == "onnx" and engine_key == bundle.cpu_engine else ""
    engine = engine_class(engine_key)(model_path, EngineOptions(device=device))
    load_ms = (time.perf_counter() - t0) * 1000
    in_h, in_w = engine.input_spec.image_hw if len(engine.input_spec.shape) == 4 else (1, 1)
    frame_size = (frame.shape[1], frame.shape[0]) if frame is not None else (in_w, in_h)
    try:
        runtime = build_runtime(bundle, engine, frame_size)
    except BaseException:
        engine.close()
        raise
    tensor = engine.allocate_input()
    tensor[...] = 0
    outputs = engine.allocate_outputs()
    detections: list[dict[str, Any]] = []
    if frame is not None:
        runtime.preprocessor(frame, tensor)
        det = runtime.decoder.decode(engine.infer(tensor, outputs))
        fault = output_fault(det, len(bundle.labels) or runtime.decoder.label_count or 0)
        if fault is not None:
            engine.close()
            raise ModelError(f"{bundle.name}: the model's output on the photo is no valid detection ({fault})")
        boxes = runtime.preprocessor.letterbox.boxes_to_source(det.boxes.copy())
        labels = bundle.labels
        for box, score, cls in zip(boxes, det.scores, det.class_ids):
            label = labels[cls] if 0 <= cls < len(labels) else str(int(cls))
            detections.append(
                {"label": label, "score": round(float(score), 4), "box": [round(float(v), 1) for v in box]}
            )
    t0 = time.perf_counter()
    engine.infer(tensor, outputs)
    first_ms = (time.perf_counter() - t0) * 1000
    times = []
    for _ in range(warmup_runs):
        t0 = time.perf_counter()
        engine.infer(tensor, outputs)
        times.append((time.perf_counter() - t0) * 1000)
    engine.close()
    return {
        "name": m.name,
        "version": m.version,
        "task": m.task,
        "labels": m.labels,
        "root": str(bundle.root),
        "variants": m.variants,
        "cpu_fallback": bundle.cpu_engine,
        "preprocess": {
            "resize": m.preprocess.resize,
            "color": m.preprocess.color,
            "mean": m.preprocess.mean,
            "std": m.preprocess.std,
        },
        "decoder": {"kind": m.decoder.kind, "params": m.decoder.params, "classes": runtime.decoder.label_count},
        "engine": engine_key,
        "input": _tensor(engine.input_spec),
        "outputs": [_tensor(s) for s in engine.output_specs],
        "timing_ms": {
            "load": round(load_ms, 2),
            "first_inference": round(first_ms, 2),
            "warm_median": round(float(np.median(times)), 3),
        },
        "image": None
        if image is None
        else {"path": str(image), "detections": detections, "dropped": dict(runtime.decoder.dropped)},
    }


# An ImageNet classifier has 1000 labels: the header line shows the first ones and the count.
SHOWN_LABELS = 20


def _labels(labels: list[str]) -> str:
    if len(labels) <= SHOWN_LABELS:
        return ", ".join(labels) or "-"
    return f"{', '.join(labels[:SHOWN_LABELS])}, ... ({len(labels)} in all)"


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['name']} v{r['version']} ({r['task']}), labels {_labels(r['labels'])}",
        f"  bundle   {r['root']}  variants: {', '.join(f'{k}={v}' for k, v in r['variants'].items())}",
        f"  fallback {r['cpu_fallback']} (the CPU engine a node falls back to)",
        f"  input    {_fmt(r['input'])}",
    ]
    lines += [f"  output   {_fmt(o)}" for o in r["outputs"]]
    pre = r["preprocess"]
    lines.append(f"  prep     {pre['resize']} {pre['color']} mean {pre['mean']} std {pre['std']}")
    dec = r["decoder"]
    classes = f", {dec['classes']} classes" if dec["classes"] is not None else ""
    lines.append(f"  decoder  {dec['kind']} ({len(dec['params'])} params{classes})")
    t = r["timing_ms"]
    lines.append(
        f"  timing   load {t['load']} ms, first inference {t['first_inference']} ms,"
        f" warm median {t['warm_median']} ms on {r['engine']}"
    )
    if r.get("image") is not None:
        found = r["image"]["detections"]
        dropped = r["image"].get("dropped") or {}
        refused = f", {sum(dropped.values())} row(s) dropped ({', '.join(sorted(dropped))})" if dropped else ""
        lines.append(f"  image    {r['image']['path']}: {len(found)} detection(s){refused}")
        lines += [f"           {d['label']} {d['score']:.3f} at {d['box']}" for d in found]
    return "\n".join(lines)


def _fmt(t: dict[str, Any]) -> str:
    q = t.get("quantisation")
    qs = f" q(scale={q['scale']:.6g}, zp={q['zero_point']})" if q else ""
    return f"{t['name']} {t['shape']} {t['dtype']}{qs}"

"""``edgerun model inspect``: what a bundle holds and how fast its CPU variant warms up."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from edgerun.decoders import decoder_class
from edgerun.engines.base import EngineOptions, TensorSpec, engine_class
from edgerun.errors import ModelError
from edgerun.models.bundle import load_bundle


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": spec.name, "shape": list(spec.shape), "dtype": str(np.dtype(spec.dtype))}
    if spec.quantised:
        out["quantisation"] = {"scale": spec.scale, "zero_point": spec.zero_point}
    return out


def inspect_bundle(path: str, engine_key: str | None = None, warmup_runs: int = 5) -> dict[str, Any]:
    """What the bundle holds, checked as the node checks it: the decoder is built on the engine's real
    tensors and the labels are counted against its classes (ModelError, exit 2, when they disagree)."""
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
    try:
        decoder = decoder_class(m.decoder.kind)(dict(m.decoder.params), engine.input_spec, engine.output_specs)
        decoder.check_labels(bundle.labels)
    except BaseException:
        engine.close()
        raise
    tensor = engine.allocate_input()
    tensor[...] = 0
    outputs = engine.allocate_outputs()
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
        "decoder": {"kind": m.decoder.kind, "params": m.decoder.params, "classes": decoder.label_count},
        "engine": engine_key,
        "input": _tensor(engine.input_spec),
        "outputs": [_tensor(s) for s in engine.output_specs],
        "timing_ms": {
            "load": round(load_ms, 2),
            "first_inference": round(first_ms, 2),
            "warm_median": round(float(np.median(times)), 3),
        },
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['name']} v{r['version']} ({r['task']}), labels {', '.join(r['labels']) or '-'}",
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
    return "\n".join(lines)


def _fmt(t: dict[str, Any]) -> str:
    q = t.get("quantisation")
    qs = f" q(scale={q['scale']:.6g}, zp={q['zero_point']})" if q else ""
    return f"{t['name']} {t['shape']} {t['dtype']}{qs}"

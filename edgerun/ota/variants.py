"""Derived versions of a real TFLite model, for delta benchmarks and update tests.

A fine-tune changes weights, not the graph, so a "new version" is made by
editing the weight buffers of the .tflite flatbuffer in place: only the
output heads (a retrained head), or every weight by a small relative amount
(a dense fine-tune). The buffers are found through the TFLite flatbuffer
schema (the ``tflite`` package), so the edited model still loads and runs.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edgerun.models.bundle import ModelBundle, load_bundle, write_manifest
from edgerun.ota.errors import OtaError
from edgerun.tomlfile import tomllib  # tomli on Python 3.10

# TensorType enum values of the TFLite schema.
FLOAT_TYPES = {0: np.float32, 1: np.float16}


@dataclass(frozen=True)
class WeightBuffer:
    name: str
    dtype: type
    offset: int
    nbytes: int


def weight_buffers(data: bytes) -> list[WeightBuffer]:
    """Float constant tensors stored inside the flatbuffer, with their byte ranges."""
    try:
        import tflite
    except ImportError:
        raise OtaError("deriving model variants needs the tflite package (pip install tflite)") from None
    model = tflite.Model.GetRootAsModel(data, 0)
    out: dict[int, WeightBuffer] = {}
    for s in range(model.SubgraphsLength()):
        graph = model.Subgraphs(s)
        for t in range(graph.TensorsLength()):
            tensor = graph.Tensors(t)
            dtype = FLOAT_TYPES.get(tensor.Type())
            index = tensor.Buffer()
            if dtype is None or index in out or index == 0:
                continue
            buf = model.Buffers(index)
            table = buf._tab
            field = table.Offset(4)  # Buffer.data
            if field == 0:
                continue
            length = table.VectorLen(field)
            if length:
                out[index] = WeightBuffer(tensor.Name().decode(), dtype, table.Vector(field), length)
    return sorted(out.values(), key=lambda w: w.offset)


def perturb_weights(data: bytes, select: Callable[[str], bool], relative: float, seed: int = 0) -> tuple[bytes, int]:
    """A copy of ``data`` with the selected weight tensors scaled by (1 + relative * N(0, 1)); (bytes, changed)."""
    rng = np.random.default_rng(seed)
    out = bytearray(data)
    changed = 0
    for w in weight_buffers(data):
        if not select(w.name):
            continue
        view: np.ndarray = np.frombuffer(
            out, dtype=w.dtype, count=w.nbytes // np.dtype(w.dtype).itemsize, offset=w.offset
        )
        values = view.astype(np.float64)
        values *= 1.0 + relative * rng.standard_normal(values.shape)
        view[...] = values.astype(w.dtype)
        changed += w.nbytes
    return bytes(out), changed


def derive_bundle(base: ModelBundle, out_dir: Path, version: int, model: bytes) -> ModelBundle:
    """A copy of ``base`` at ``version`` whose tflite variant is ``model``."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    manifest = tomllib.loads((base.root / "model.toml").read_text())
    manifest["version"] = version
    variant = base.manifest.variants["tflite"]
    manifest["variants"] = {"tflite": variant}
    manifest.get("provenance", {}).pop("sha256", None)
    (out_dir / variant).write_bytes(model)
    write_manifest(out_dir, manifest)
    return load_bundle(out_dir)


def is_head(name: str) -> bool:
    """The output heads of MediaPipe's SSD detectors (BlazeFace, pose detector)."""
    return any(part in name for part in ("classificator", "classifier", "regressor"))

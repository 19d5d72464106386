"""The inference back-end contract and the registry that finds back ends by key.

A back end is one module with one ``Engine`` subclass. Its heavy vendor import
(TensorRT, pycuda, onnxruntime) happens inside ``open``/``__init__`` so a node
without that SDK can still import edgerun and fall back to another engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgerun.errors import EngineError
from edgerun.registry import resolve


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape, dtype, layout and affine quantisation of one model tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: str = "NHWC"  # "NHWC", "NCHW" or "" for non-image tensors
    scale: float = 0.0  # 0.0 means not quantised
    zero_point: int = 0

    @property
    def quantised(self) -> bool:
        return self.scale != 0.0 and np.issubdtype(self.dtype, np.integer)

    @property
    def image_hw(self) -> tuple[int, int]:
        """(height, width) of an image input tensor."""
        if self.layout == "NCHW":
            return int(self.shape[2]), int(self.shape[3])
        return int(self.shape[1]), int(self.shape[2])

    def dequantise(self, raw: np.ndarray) -> np.ndarray:
        """Float values of a tensor, undoing affine quantisation if any."""
        if not self.quantised:
            return raw
        return (raw.astype(np.float32) - np.float32(self.zero_point)) * np.float32(self.scale)


@dataclass(slots=True)
class EngineOptions:
    """Back-end-neutral settings handed to every engine."""

    num_threads: int = 0  # 0: the back end's own choice (usually all cores)
    replicas: int = 0  # CPU back ends: model instances run side by side; 0: the back end's choice
    device: str = ""  # back-end device selector: "usb:0", "pci:0", "cuda:0", ...
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """One loaded model on one back end.

    ``infer`` may be called from up to ``concurrent_calls`` threads at once; the
    pipeline serialises calls to an engine that says 1 (most drivers' execution
    contexts are not thread-safe).
    """

    KEY: ClassVar[str]
    input_spec: TensorSpec
    output_specs: list[TensorSpec]
    # CPU threads the back end computes on; the pipeline fuses its stages onto one
    # thread when this covers every core (0: an accelerator does the work).
    cpu_threads: int = 0
    concurrent_calls: int = 1

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        self.model_path = Path(model_path)
        self.options = options

    def allocate_input(self) -> np.ndarray:
        """A buffer for one input tensor; pinned/mapped host memory where the back end can."""
        return aligned_empty(self.input_spec.shape, self.input_spec.dtype)

    def allocate_outputs(self) -> list[np.ndarray]:
        """Buffers that ``infer`` can fill so steady state allocates nothing."""
        return [aligned_empty(s.shape, s.dtype) for s in self.output_specs]

    @abstractmethod
    def infer(self, tensor: np.ndarray, outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Run the model on ``tensor``; write into ``outputs`` when given and return them."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the back end's resources."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``align``-byte boundary (SIMD, DMA)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


# key -> "module:Class"; modules import lazily so a missing SDK is not an import error.
ENGINE_MODULES: dict[str, str] = {
    "tflite": "edgerun.engines.tflite:TFLiteEngine",
    "edgetpu": "edgerun.engines.tflite:EdgeTPUEngine",
    "onnx": "edgerun.engines.onnx:OnnxEngine",
    "tensorrt": "edgerun.engines.tensorrt:TensorRTEngine",
}


def engine_class(key: str) -> type[Engine]:
    """The Engine subclass registered under ``key``."""
    return resolve(ENGINE_MODULES, key, "unknown engine", EngineError)

"""ONNX Runtime, on the best execution provider the installed build offers.

The ``onnxruntime`` wheel on PyPI has the CPU provider only; ``onnxruntime-gpu``
adds CUDA and TensorRT, ``onnxruntime-openvino`` adds OpenVINO (Intel iGPU/NPU).
We take the first provider of ``PROVIDER_PREFERENCE`` that the build has, with
CPU always last, so one bundle and one config run on every node. Outputs are
written straight into the caller's buffers through an I/O binding, so steady
state allocates nothing.

The TensorRT provider builds a TensorRT engine for the graph when a session
opens, which takes minutes on a Jetson; its engine cache
(``trt_engine_cache_enable``/``trt_engine_cache_path``) keeps the built engines
under the node's state directory (``<state>/onnx-trt-cache``), so a restart, a
re-probe after a failover or an OTA swap back to a known model loads instead of
rebuilding. ONNX Runtime keys the files by the model and the GPU, and rebuilds
when the TensorRT version changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.engines.base import Engine, EngineOptions, TensorSpec
from edgerun.errors import EngineError, ModelError

log = logging.getLogger(__name__)

PROVIDER_PREFERENCE = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "OpenVINOExecutionProvider",
    "CPUExecutionProvider",
)

# ONNX Runtime's type strings -> numpy dtypes (the ones image models use).
_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(uint8)": np.uint8,
    "tensor(int8)": np.int8,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(bool)": np.bool_,
}


def onnxruntime_module() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise EngineError("onnxruntime is not installed: pip install edgerun[onnx]") from None
    return onnxruntime


def image_layout(shape: tuple[int, ...]) -> str:
    """NCHW when the channel axis (1 or 3 wide) comes right after the batch, else NHWC."""
    if len(shape) != 4:
        return ""
    if shape[1] in (1, 3) and shape[3] not in (1, 3):
        return "NCHW"
    return "NHWC"


TRT_CACHE_DIR = "onnx-trt-cache"


def choose_providers(available: list[str], device: str, trt_cache: Path | None = None) -> list[Any]:
    """Providers in our order of preference among ``available``; ``device`` "cuda:N" picks the GPU.

    ``trt_cache``: where the TensorRT provider keeps the engines it builds (None: no cache).
    """
    device_id = 0
    if device.startswith("cuda:"):
        try:
            device_id = int(device.split(":", 1)[1])
        except ValueError:
            raise EngineError(f"engine.device {device!r}: expected cuda:N") from None
    chosen: list[Any] = []
    for name in PROVIDER_PREFERENCE:
        if name not in available:
            continue
        if device == "cpu" and name != "CPUExecutionProvider":
            continue
        if name == "TensorrtExecutionProvider" and trt_cache is not None:
            cache = {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(trt_cache)}
            chosen.append((name, {"device_id": device_id, **cache}))
        elif name in ("TensorrtExecutionProvider", "CUDAExecutionProvider"):
            chosen.append((name, {"device_id": device_id}))
        else:
            chosen.append(name)
    return chosen


def _fixed_shape(name: str, shape: list[Any], path: Path) -> tuple[int, ...]:
    """A concrete shape: a symbolic batch becomes 1; other symbolic dimensions are an error."""
    dims: list[int] = []
    for i, dim in enumerate(shape):
        if isinstance(dim, int) and dim > 0:
            dims.append(dim)
        elif i == 0:
            dims.append(1)
        else:
            raise ModelError(f"{path}: tensor {name!r} has a dynamic dimension {i} ({dim!r}); export a fixed size")
    return tuple(dims)


def _dtype(type_str: str, name: str, path: Path) -> np.dtype:
    try:
        return np.dtype(_DTYPES[type_str])
    except KeyError:
        raise ModelError(f"{path}: tensor {name!r} has unsupported type {type_str}") from None


def trt_cache_dir(options: EngineOptions) -> Path | None:
    """``<state dir>/onnx-trt-cache``, made if missing; None (no cache, a warning) where it cannot be."""
    from edgerun.engines.breadcrumb import default_state_dir

    state = options.extra.get("state_dir")
    path = (Path(state) if state else default_state_dir()) / TRT_CACHE_DIR
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("onnx: no TensorRT engine cache in %s (%s); engines are rebuilt at every open", path, err)
        return None
    return path


class OnnxEngine(Engine):
    """A .onnx model through ONNX Runtime on the best provider available here."""

    KEY = "onnx"

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        super().__init__(model_path, options)
        if not self.model_path.is_file():
            raise ModelError(f"model file {self.model_path} not found")
        ort = onnxruntime_module()
        available = ort.get_available_providers()
        trt_cache = None
        if "TensorrtExecutionProvider" in available:
            trt_cache = trt_cache_dir(options)
        providers = options.extra.get("providers") or choose_providers(available, options.device, trt_cache)
        if not providers:
            raise EngineError(f"onnxruntime {ort.__version__} offers no usable execution provider")
        sess_options = ort.SessionOptions()
        if options.num_threads:
            sess_options.intra_op_num_threads = options.num_threads
        sess_options.log_severity_level = 3  # errors only: provider fallbacks are reported by us
        try:
            self._session = ort.InferenceSession(str(self.model_path), sess_options, providers=providers)
        except Exception as err:  # onnxruntime raises its own pybind exception types
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(f"{self.model_path}: not a loadable ONNX model ({first})") from None
        self.providers: list[str] = list(self._session.get_providers())
        on_cpu = self.providers[:1] == ["CPUExecutionProvider"]
        self.cpu_threads = (options.num_threads or (os.cpu_count() or 1)) if on_cpu else 0
        inputs = self._session.get_inputs()
        if len(inputs) != 1:
            raise ModelError(f"{self.model_path}: expected 1 input tensor, found {len(inputs)}")
        shape = _fixed_shape(inputs[0].name, inputs[0].shape, self.model_path)
        self.input_spec = TensorSpec(
            name=inputs[0].name,
            shape=shape,
            dtype=_dtype(inputs[0].type, inputs[0].name, self.model_path),
            layout=image_layout(shape),
        )
        self.output_specs = [
            TensorSpec(
                name=o.name,
                shape=_fixed_shape(o.name, o.shape, self.model_path),
                dtype=_dtype(o.type, o.name, self.model_path),
                layout="",
            )
            for o in self._session.get_outputs()
        ]
        self._binding = self._session.io_binding()
        self._bound: tuple[int, ...] = ()
        log.debug("onnx %s on %s", self.model_path.name, ", ".join(self.providers))

    @property
    def provider(self) -> str:
        """The provider that runs most of the graph (the first one the session kept)."""
        return self.providers[0] if self.providers else ""

    def infer(self, tensor: np.ndarray, outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        if outputs is None:
            outputs = self.allocate_outputs()
        binding = self._binding
        # Rebind only when the caller hands other buffers (each frame slot owns its own).
        key = (tensor.ctypes.data, *(o.ctypes.data for o in outputs))
        if key != self._bound:
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            binding.bind_cpu_input(self.input_spec.name, tensor)
            for spec, out in zip(self.output_specs, outputs):
                binding.bind_output(spec.name, "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
            self._bound = key
        self._session.run_with_iobinding(binding)
        return outputs

    def close(self) -> None:
        self._binding = None
        self._session = None
        self._bound = ()

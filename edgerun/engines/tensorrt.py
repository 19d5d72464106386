"""TensorRT 10 engines (``model.engine``, built by ``edgerun model build-trt``) through pycuda.

TensorRT 10 is what JetPack 6.1 and 6.2 ship (10.3); JetPack 6.0 ships TensorRT 8.6,
which this engine refuses (``tensorrt_modules``), and NVIDIA has no TensorRT 11 for
JetPack. TensorRT and pycuda are imported only when an engine opens.

The engine gets its own CUDA context (blocking sync, so a waiting thread
sleeps instead of spinning a core the other stages need) and pushes it around
every call, so it can be opened on one thread and run on another (failover
opens on its supervisor thread and infers on the engine's worker thread) and
closed on a third: pycuda's ``detach`` releases only a context that is current
on the calling thread (or one made on it), so ``CudaContext.close`` pushes it
first.

At open, engines whose I/O the node cannot feed are refused as a ``ModelError``
(a person must rebuild the engine; failover does not re-probe it): output shapes
that depend on the data (-1 once the input shape is set), data types numpy has
no type for (BF16, FP8, INT4, FP4), vectorised (non-linear) tensor formats and
tensors that live on the host (shape tensors).

Host buffers for the frame pool come from pycuda's page-locked memory:

* **Integrated GPU** (Jetson: CPU and GPU share DRAM): input and outputs are
  allocated *mapped* (``host_alloc_flags.DEVICEMAP``) and their device
  pointers are handed to TensorRT, so the preprocessed frame is read by the
  GPU where it lies and results appear in the slot without any copy.
* **Discrete GPU**: pinned host buffers, one device buffer per tensor, and
  async host-to-device / device-to-host copies on the engine's stream around
  ``execute_async_v3``.

A buffer the engine did not allocate (plain numpy) still works, through a
synchronous copy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.engines.base import Engine, EngineOptions, TensorSpec
from edgerun.engines.onnx import image_layout
from edgerun.errors import EngineError, ModelError

log = logging.getLogger(__name__)

_TRT_LOGGER: Any = None


def tensorrt_modules() -> tuple[Any, Any]:
    """(tensorrt, pycuda.driver), or EngineError naming what is missing."""
    try:
        import tensorrt as trt
    except ImportError as err:
        raise EngineError(f"TensorRT Python bindings not importable ({err}); install tensorrt>=10") from None
    try:
        import pycuda.driver as cuda
    except ImportError as err:
        raise EngineError(f"pycuda not importable ({err}); pip install edgerun[tensorrt]") from None
    if int(trt.__version__.split(".")[0]) < 10:
        raise EngineError(f"TensorRT {trt.__version__} found; edgerun needs TensorRT 10 (named I/O tensors)")
    return trt, cuda


def trt_logger(trt: Any) -> Any:
    global _TRT_LOGGER
    if _TRT_LOGGER is None:
        _TRT_LOGGER = trt.Logger(trt.Logger.WARNING)
    return _TRT_LOGGER


def cuda_device_index(device: str) -> int:
    """``""`` or ``"cuda:N"`` -> N."""
    if not device:
        return 0
    if device.startswith("cuda:"):
        try:
            return int(device.split(":", 1)[1])
        except ValueError:
            pass
    raise EngineError(f"engine.device {device!r}: expected cuda:N for TensorRT")


class CudaContext:
    """A CUDA context of our own, made current around each use: ``with ctx:``; ``close()`` from any thread."""

    def __init__(self, cuda: Any, index: int) -> None:
        try:
            cuda.init()
            count = cuda.Device.count()
        except cuda.Error as err:
            raise EngineError(f"CUDA driver unavailable: {err}") from None
        if index >= count:
            raise EngineError(f"CUDA device {index} not found ({count} present)")
        self.cuda = cuda
        self.device = cuda.Device(index)
        self.integrated = bool(self.device.get_attribute(cuda.device_attribute.INTEGRATED)) and bool(
            self.device.get_attribute(cuda.device_attribute.CAN_MAP_HOST_MEMORY)
        )
        flags = cuda.ctx_flags.SCHED_BLOCKING_SYNC | cuda.ctx_flags.MAP_HOST
        self.context = self.device.make_context(flags)  # made current on this thread...
        self.context.pop()  # ...and released: every use pushes it

    def __enter__(self) -> CudaContext:
        self.context.push()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cuda.Context.pop()

    def close(self) -> None:
        """Destroy the context. Off the thread that made it, pycuda's ``detach`` silently does nothing
        unless the context is current, which leaked one context per failover retire, OTA swap and stop."""
        self.context.push()
        self.context.detach()  # current here, so it is destroyed (and popped with it)


class TensorRTEngine(Engine):
    """A serialised TensorRT 10 engine on one NVIDIA GPU."""

    KEY = "tensorrt"

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        super().__init__(model_path, options)
        if not self.model_path.is_file():
            raise ModelError(f"model file {self.model_path} not found")
        trt, cuda = tensorrt_modules()
        self._trt, self._cuda = trt, cuda
        self._ctx = CudaContext(cuda, cuda_device_index(options.device))
        self.zero_copy = self._ctx.integrated
        self.cpu_threads = 0  # the GPU computes
        # host data pointer -> device pointer (mapped) or 0 (pinned only), for buffers we allocated
        self._pinned: dict[int, int] = {}
        self._keep: list[np.ndarray] = []
        try:
            with self._ctx:
                self._load()
        except BaseException:
            with self._ctx:
                self._release()  # TensorRT objects and buffers go while their context is current
            self._ctx.close()
            raise

    def _load(self) -> None:
        trt, cuda = self._trt, self._cuda
        self._runtime = trt.Runtime(trt_logger(trt))
        engine = self._runtime.deserialize_cuda_engine(self.model_path.read_bytes())
        if engine is None:
            raise ModelError(
                f"{self.model_path}: not a TensorRT {trt.__version__} engine for this GPU "
                "(engines are tied to the TensorRT version and GPU they were built on; rebuild with "
                "edgerun model build-trt)"
            )
        self._engine = engine
        self._context = engine.create_execution_context()
        self.input_spec, self.output_specs = io_specs(trt, engine, self._context, self.model_path)
        self._stream = cuda.Stream()
        # Device-side buffers: the targets of the copies on a discrete GPU, and the fallback for
        # host buffers we did not allocate on an integrated one.
        self._device_in = cuda.mem_alloc(max(1, _nbytes(self.input_spec)))
        self._device_out = [cuda.mem_alloc(max(1, _nbytes(s))) for s in self.output_specs]
        self._bound: tuple[int, ...] = ()

    # -- buffers ----------------------------------------------------------------------

    def _host_buffer(self, spec: TensorSpec) -> np.ndarray:
        cuda = self._cuda
        with self._ctx:
            if self.zero_copy:
                flags = cuda.host_alloc_flags.DEVICEMAP | cuda.host_alloc_flags.PORTABLE
                array = cuda.pagelocked_empty(spec.shape, spec.dtype, mem_flags=flags)
                device_ptr = int(array.base.get_device_pointer())
            else:
                array = cuda.pagelocked_empty(spec.shape, spec.dtype, mem_flags=cuda.host_alloc_flags.PORTABLE)
                device_ptr = 0
        self._pinned[array.ctypes.data] = device_ptr
        self._keep.append(array)  # the pointer table must not outlive the memory
        return array

    def allocate_input(self) -> np.ndarray:
        return self._host_buffer(self.input_spec)

    def allocate_outputs(self) -> list[np.ndarray]:
        return [self._host_buffer(s) for s in self.output_specs]

    # -- inference -------------------------------------------------------------------

    def infer(self, tensor: np.ndarray, outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        if outputs is None:
            outputs = self.allocate_outputs()
        cuda, context, stream = self._cuda, self._context, self._stream
        pinned = self._pinned
        in_host = tensor.ctypes.data
        out_hosts = [o.ctypes.data for o in outputs]
        with self._ctx:
            # Where TensorRT reads and writes: the mapped host buffers themselves, or our device buffers.
            in_dev = pinned.get(in_host, 0) if self.zero_copy else 0
            out_devs = [pinned.get(h, 0) if self.zero_copy else 0 for h in out_hosts]
            addresses = (in_dev or int(self._device_in), *(d or int(b) for d, b in zip(out_devs, self._device_out)))
            if addresses != self._bound:
                context.set_tensor_address(self.input_spec.name, addresses[0])
                for spec, address in zip(self.output_specs, addresses[1:]):
                    context.set_tensor_address(spec.name, address)
                self._bound = addresses
            if not in_dev:
                if in_host in pinned:
                    cuda.memcpy_htod_async(self._device_in, tensor, stream)
                else:
                    cuda.memcpy_htod(self._device_in, np.ascontiguousarray(tensor))
            if not context.execute_async_v3(stream.handle):
                raise EngineError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            for out, host, dev, buf in zip(outputs, out_hosts, out_devs, self._device_out):
                if not dev:
                    if host in pinned:
                        cuda.memcpy_dtoh_async(out, buf, stream)
                    else:
                        stream.synchronize()
                        cuda.memcpy_dtoh(out, buf)
            stream.synchronize()
        return outputs

    def _release(self) -> None:
        self._context = None
        self._engine = None
        self._runtime = None
        self._device_in = None
        self._device_out = []
        self._stream = None
        self._pinned.clear()
        self._keep.clear()

    def close(self) -> None:
        """Release everything; callable from any thread (failover retires engines on its own threads)."""
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            return
        with ctx:
            self._release()
        ctx.close()
        self._ctx = None  # type: ignore[assignment]  # closed: the getattr above sees None and returns


# TensorRT data types that numpy has a type for, by trt.DataType member name; the rest
# (BF16, FP8, INT4, FP4) cannot be fed or read through numpy buffers.
NUMPY_DTYPES: dict[str, type] = {
    "FLOAT": np.float32,
    "HALF": np.float16,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
}


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value)).rpartition(".")[2]


def numpy_dtype(trt: Any, dtype: Any, what: str) -> np.dtype:
    """The numpy dtype of a TensorRT data type, or ModelError naming the tensor (``what``)."""
    for name, np_type in NUMPY_DTYPES.items():
        if getattr(trt.DataType, name, None) == dtype:
            return np.dtype(np_type)
    raise ModelError(
        f"{what} has data type {_enum_name(dtype)}, which numpy cannot hold; "
        "rebuild the engine with FP32, FP16 or integer I/O (edgerun model build-trt keeps the ONNX I/O types)"
    )


def io_specs(trt: Any, engine: Any, context: Any, path: Path) -> tuple[TensorSpec, list[TensorSpec]]:
    """The input and output specs of a deserialised engine, or ModelError for I/O the node cannot serve.

    Sets the input shape on ``context`` (batch 1 at the profile's preferred size) when it is dynamic.
    """
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    if len(inputs) != 1:
        raise ModelError(f"{path}: expected 1 input tensor, found {len(inputs)}")
    for n in names:
        location = engine.get_tensor_location(n)
        if location != trt.TensorLocation.DEVICE:
            raise ModelError(
                f"{path}: tensor {n!r} lives on the host ({_enum_name(location)}: a shape tensor); "
                "edgerun feeds device buffers only"
            )
        fmt = engine.get_tensor_format(n)
        if fmt != trt.TensorFormat.LINEAR:
            raise ModelError(
                f"{path}: tensor {n!r} has the vectorised format {_enum_name(fmt)}; edgerun reads and writes "
                "linear (row-major) buffers: rebuild without I/O format constraints"
            )
    name = inputs[0]
    shape = tuple(int(d) for d in engine.get_tensor_shape(name))
    if any(d < 0 for d in shape):
        # Dynamic dimensions: batch 1 at the optimisation profile's preferred size.
        _, opt, _ = engine.get_tensor_profile_shape(name, 0)
        shape = (1, *(int(d) for d in tuple(opt)[1:]))
        context.set_input_shape(name, shape)
    input_spec = TensorSpec(
        name=name,
        shape=shape,
        dtype=numpy_dtype(trt, engine.get_tensor_dtype(name), f"{path}: input {name!r}"),
        layout=image_layout(shape),
    )
    output_specs = []
    for n in outputs:
        out_shape = tuple(int(d) for d in context.get_tensor_shape(n))
        if any(d < 0 for d in out_shape):
            raise ModelError(
                f"{path}: output {n!r} has a data-dependent shape {out_shape} (e.g. NonZero or NMS inside the "
                "engine); export the model with fixed-size outputs and decode on the host"
            )
        dtype = numpy_dtype(trt, engine.get_tensor_dtype(n), f"{path}: output {n!r}")
        output_specs.append(TensorSpec(name=n, shape=out_shape, dtype=dtype, layout=""))
    return input_spec, output_specs


def _nbytes(spec: TensorSpec) -> int:
    return int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize


def device_report() -> dict[str, Any]:
    """What ``edgerun doctor`` says about TensorRT here, without loading a model."""
    try:
        trt, cuda = tensorrt_modules()
    except EngineError as err:
        return {"ok": False, "why": str(err)}
    try:
        cuda.init()
        devices = []
        for i in range(cuda.Device.count()):
            dev = cuda.Device(i)
            major, minor = dev.compute_capability()
            kind = "integrated, zero-copy" if dev.get_attribute(cuda.device_attribute.INTEGRATED) else "discrete"
            devices.append(f"cuda:{i} {dev.name()} (sm_{major}{minor}, {kind})")
    except Exception as err:
        return {"ok": False, "why": f"CUDA unavailable ({err})", "version": trt.__version__}
    if not devices:
        return {"ok": False, "why": "no CUDA device found", "version": trt.__version__}
    return {"ok": True, "library": "tensorrt", "version": trt.__version__, "devices": devices}

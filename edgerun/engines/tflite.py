"""TFLite on the CPU (XNNPACK) and on the Edge TPU, through LiteRT or the legacy tflite-runtime.

``ai_edge_litert`` is the maintained runtime and works with numpy 2; the
``tflite_runtime`` wheels (last released 2023) still run on older boards with
numpy < 2, so we take whichever is installed, LiteRT first.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.engines.base import Engine, EngineOptions, TensorSpec
from edgerun.engines.native_stderr import native_stderr_to_log
from edgerun.engines.onnx import image_layout
from edgerun.errors import EngineError, ModelError

log = logging.getLogger(__name__)

EDGETPU_LIBRARY = "libedgetpu.so.1"


def tflite_module() -> Any:
    """The interpreter module: ``ai_edge_litert.interpreter`` or ``tflite_runtime.interpreter``."""
    try:
        from ai_edge_litert import interpreter
    except ImportError:
        try:
            from tflite_runtime import interpreter
        except ImportError:
            raise EngineError(
                "no TFLite runtime installed: pip install ai-edge-litert (or edgerun[legacy-tflite])"
            ) from None
    return interpreter


def _spec(detail: dict[str, Any], image: bool) -> TensorSpec:
    scale, zero_point = detail.get("quantization", (0.0, 0))
    shape = tuple(int(d) for d in detail["shape"])
    return TensorSpec(
        name=str(detail["name"]),
        shape=shape,
        dtype=np.dtype(detail["dtype"]),
        # LiteRT files converted straight from PyTorch (litert_torch, Ultralytics >= 8.4.83) keep NCHW inputs.
        layout=image_layout(shape) if image else "",
        scale=float(scale),
        zero_point=int(zero_point),
    )


class _Lane:
    """One interpreter and its tensor indices; used by one infer call at a time."""

    __slots__ = ("interp", "input_index", "output_indices")

    def __init__(self, interp: Any) -> None:
        self.interp = interp
        inputs = interp.get_input_details()
        self.input_index = int(inputs[0]["index"]) if inputs else -1  # the engine rejects models without one
        self.output_indices = [int(d["index"]) for d in interp.get_output_details()]

    def run(self, tensor: np.ndarray, outputs: list[np.ndarray] | None) -> list[np.ndarray]:
        interp = self.interp
        interp.set_tensor(self.input_index, tensor)
        interp.invoke()
        if outputs is None:
            return [interp.get_tensor(i) for i in self.output_indices]
        for index, out in zip(self.output_indices, outputs):
            # tensor() is a view into the interpreter; copy out at once and drop
            # the view, since invoke() refuses to run while views are alive.
            np.copyto(out, interp.tensor(index)())
        return outputs


class TFLiteEngine(Engine):
    """A .tflite model on the CPU; XNNPACK accelerates float and int8 kernels."""

    KEY = "tflite"

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        super().__init__(model_path, options)
        if not self.model_path.is_file():
            raise ModelError(f"model file {self.model_path} not found")
        module = tflite_module()
        delegates = self._delegates(module)
        threads, replicas = self._layout(options)
        # Replicas after the first share nothing but the model file; delegates are per interpreter
        # and an accelerator has one device, so only the CPU engine makes more than one.
        self._lanes = [self._open_interpreter(module, threads, delegates) for _ in range(replicas)]
        self._interp = self._lanes[0].interp  # the first replica, for callers that want the raw interpreter
        inputs = self._interp.get_input_details()
        if len(inputs) != 1:
            raise ModelError(f"{self.model_path}: expected 1 input tensor, found {len(inputs)}")
        self.input_spec = _spec(inputs[0], image=True)
        self.output_specs = [_spec(d, image=False) for d in self._interp.get_output_details()]
        # Free replicas, most recently used last: a lone caller keeps reusing one warm interpreter.
        self._free = list(self._lanes)
        self._free_cond = threading.Condition(threading.Lock())
        self.num_threads = threads
        self.replicas = replicas
        self.cpu_threads = threads * replicas
        self.concurrent_calls = replicas

    def _layout(self, options: EngineOptions) -> tuple[int, int]:
        """(threads per interpreter, interpreters): one interpreter unless asked for more, cores shared out.

        The node chooses replicas for its situation (``edgerun.engines.factory.cpu_engine_layout``).
        """
        cores = os.cpu_count() or 1
        replicas = options.replicas or 1
        return options.num_threads or max(1, cores // replicas), replicas

    def _open_interpreter(self, module: Any, threads: int, delegates: list[Any]) -> _Lane:
        try:
            # The runtime prints "INFO: Created TensorFlow Lite XNNPACK delegate" here; it belongs in the log.
            # Only for the CPU interpreter: an accelerator delegate's load can wedge (an Edge TPU that hangs),
            # and its open is then abandoned on a stuck thread, which must not keep the process's stderr.
            held: AbstractContextManager[None] = (
                nullcontext() if delegates else native_stderr_to_log(f"{self.model_path.name} ({self.KEY})")
            )
            with held:
                interp = module.Interpreter(
                    model_path=str(self.model_path),
                    num_threads=threads,
                    experimental_delegates=delegates or None,
                )
                interp.allocate_tensors()
        except (ValueError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(f"{self.model_path}: not a loadable TFLite model ({first})") from None
        return _Lane(interp)

    def _delegates(self, module: Any) -> list[Any]:
        return []

    def infer(self, tensor: np.ndarray, outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        with self._free_cond:
            while not self._free:
                self._free_cond.wait()
            lane = self._free.pop()
        try:
            return lane.run(tensor, outputs)
        finally:
            with self._free_cond:
                self._free.append(lane)
                self._free_cond.notify()

    def close(self) -> None:
        self._interp = None
        self._lanes = self._free = []


class EdgeTPUEngine(TFLiteEngine):
    """A model compiled for the Coral Edge TPU (``*_edgetpu.tflite``), run through libedgetpu."""

    KEY = "edgetpu"

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        super().__init__(model_path, options)
        self.cpu_threads = 0  # the TPU computes; the CPU only feeds it

    def _layout(self, options: EngineOptions) -> tuple[int, int]:
        return options.num_threads or (os.cpu_count() or 1), 1  # one device, one interpreter

    def _delegates(self, module: Any) -> list[Any]:
        delegate_options = {"device": self.options.device} if self.options.device else {}
        try:
            # Probe the library first: a failed load_delegate leaves a half-made
            # Delegate whose destructor prints a traceback at exit.
            ctypes.CDLL(EDGETPU_LIBRARY)
            return [module.load_delegate(EDGETPU_LIBRARY, delegate_options)]
        except (ValueError, OSError) as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else "not found"
            device = f" (device {self.options.device!r})" if self.options.device else ""
            raise EngineError(f"Edge TPU delegate {EDGETPU_LIBRARY} could not be loaded{device}: {detail}") from None

"""Engines that fail, hang, run slow or open slowly on command: tools for tests, ``edgerun bench`` and HIL.

None of these is a back end: they wrap or stand in for one so failover,
flow control and supervision can be exercised without a real broken
accelerator. Each says what it fakes in its docstring.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from edgerun.engines.base import Engine, EngineOptions
from edgerun.engines.tflite import TFLiteEngine
from edgerun.errors import EngineError

# The file whose presence makes ``OpenStallEngine`` block in its open (a subprocess node reads it).
OPEN_STALL_ENV = "EDGERUN_TEST_OPEN_STALL"


class InjectedFault(EngineError):
    """The failure a ``FaultInjectingEngine`` was told to produce."""


class FaultPlan:
    """What the fault-injecting engines of one back end do; shared by every instance, so a re-probe
    (a fresh engine) sees the fault until it is cleared, like a real dead device.

    ``arm("raise", after=N)``: the call N+1 from now and every later one raises.
    ``arm("hang", after=N)``: the call N+1 from now and every later one blocks until ``clear()``.
    ``delay_s``: every call takes at least this long (a slower device), whatever is armed.
    """

    def __init__(self, delay_s: float = 0.0) -> None:
        self.mode: str | None = None
        self.delay_s = delay_s
        self._countdown = 0
        self._lock = threading.Lock()
        self._release = threading.Event()
        self.calls = 0
        self.faults = 0
        self.t_fault = 0.0  # monotonic time the last injected fault began

    def arm(self, mode: str, after: int = 0) -> None:
        if mode not in ("raise", "hang"):
            raise ValueError(f"unknown fault mode {mode!r}")
        with self._lock:
            self._release.clear()
            self.mode, self._countdown = mode, after

    def clear(self) -> None:
        with self._lock:
            self.mode = None
            self._release.set()

    def before_call(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self.calls += 1
            mode = self.mode
            if mode is None:
                return
            if self._countdown > 0:
                self._countdown -= 1
                return
            self.faults += 1
            self.t_fault = time.monotonic()
            release = self._release
        if mode == "raise":
            raise InjectedFault("injected fault")
        release.wait()  # a wedged driver: returns only when the fault is cleared


class FaultInjectingEngine(Engine):
    """TEST TOOL: a real engine that fails on command (see ``FaultPlan``); registered under no key.

    ``concurrent_calls`` and ``cpu_threads`` are the inner engine's unless given: an accelerator
    stand-in says ``cpu_threads=0`` (it leaves the CPU free) and ``concurrent_calls=1`` (serial).
    """

    def __init__(
        self,
        inner: Engine,
        plan: FaultPlan,
        key: str | None = None,
        *,
        cpu_threads: int | None = None,
        concurrent_calls: int | None = None,
    ) -> None:
        self.inner = inner
        self.plan = plan
        self.KEY = key or inner.KEY  # type: ignore[misc]  # reports as the back end it stands in for
        self.model_path, self.options = inner.model_path, inner.options
        self.input_spec = inner.input_spec
        self.output_specs = inner.output_specs
        self.cpu_threads = getattr(inner, "cpu_threads", 0) if cpu_threads is None else cpu_threads
        self.concurrent_calls = getattr(inner, "concurrent_calls", 1) if concurrent_calls is None else concurrent_calls
        self.closed = False

    def allocate_input(self) -> np.ndarray:
        return self.inner.allocate_input()

    def allocate_outputs(self) -> list[np.ndarray]:
        return self.inner.allocate_outputs()

    def infer(self, tensor: np.ndarray, outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
        self.plan.before_call()
        return self.inner.infer(tensor, outputs)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class OpenStallEngine(TFLiteEngine):
    """TEST ENGINE: the real CPU TFLite engine standing in for an accelerator whose open is slow.

    While the file named by ``$EDGERUN_TEST_OPEN_STALL`` exists, the open blocks (a large TensorRT
    engine deserialising on a Nano); it writes ``<file>.opening`` first, so a test knows the node
    is inside the open. Register it under a key of ``ENGINE_MODULES`` in the node process.
    """

    KEY = "slowopen"

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        flag = os.environ.get(OPEN_STALL_ENV, "")
        if flag:
            Path(flag + ".opening").touch()
            while os.path.exists(flag):
                time.sleep(0.01)
        super().__init__(model_path, EngineOptions(num_threads=1))
        self.cpu_threads = 0  # an accelerator leaves the CPU to the other stages
        self.concurrent_calls = 1

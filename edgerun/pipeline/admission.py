"""Admission to the engine: a worker holds one of the serving engine's call slots before it takes a frame.

An engine that serves one call at a time (every accelerator today: TensorRT
execution contexts, an Edge TPU, a CUDA ONNX session) behind several workers
would otherwise have every worker take a frame and queue on the engine's lock:
each queued frame ages while it waits, so latency grows with the worker count
(measured with a 20 ms serial engine under ``drop_oldest``: p50 45 / 67 / 111 /
156 ms at 1 / 2 / 4 / 6 workers). With admission only as many workers hold a
frame as the engine takes calls; the others wait without a frame, and the
frame they take next is the freshest one. The slot count follows the serving
runtime (a failover from a serial accelerator to the CPU fallback's replicas
opens more slots; a switch back closes them).
"""

from __future__ import annotations

import threading


class EngineSlots:
    """A resizable counting gate; ``acquire`` returns a token for ``release``.

    When there are at least as many slots as workers nobody can wait, and the
    gate costs one attribute read: no lock on the frame path of CPU engines.
    """

    def __init__(self, limit: int, workers: int) -> None:
        self.workers = workers
        self._limit = max(1, limit)
        self._in_use = 0
        self._cond = threading.Condition(threading.Lock())

    @property
    def limit(self) -> int:
        return self._limit

    def resize(self, limit: int) -> None:
        """The serving runtime changed: ``limit`` calls at once from now on."""
        with self._cond:
            self._limit = max(1, limit)
            self._cond.notify_all()

    def acquire(self) -> bool:
        """Wait for a slot; the token says whether one was counted (False: the gate was open)."""
        if self._limit >= self.workers:
            return False
        with self._cond:
            while self._in_use >= self._limit:
                self._cond.wait()
            self._in_use += 1
        return True

    def release(self, token: bool) -> None:
        if not token:
            return
        with self._cond:
            self._in_use -= 1
            self._cond.notify()

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

# What ``EngineSlots.acquire`` hands out: the gate was open (nothing counted), a call slot of the local
# engine, or a place in the in-flight window of the helper this node offloads to (edgerun.offload).
OPEN, LOCAL, REMOTE = 0, 1, 2


class EngineSlots:
    """A resizable counting gate with two lanes; ``acquire`` returns a token for ``release``.

    The local lane has as many slots as the serving engine takes calls. The remote lane has as many
    as the offload window to a helper while one is chosen (0 otherwise): a worker holding a remote
    slot sends its frame to the helper. With ``prefer_remote`` the helper's lane fills first and the
    local engine takes what overflows; otherwise the local engine fills first and the helper takes
    the surplus frames that would have waited (and aged, or been dropped) for it.

    When there are at least as many local slots as workers and no remote lane, nobody can wait and
    the gate costs one attribute read: no lock on the frame path of CPU engines.
    """

    def __init__(self, limit: int, workers: int) -> None:
        self.workers = workers
        self._limit = max(1, limit)
        self._in_use = 0
        self._remote_limit = 0
        self._remote_in_use = 0
        self._prefer_remote = False
        self._cond = threading.Condition(threading.Lock())

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def remote_limit(self) -> int:
        return self._remote_limit

    def resize(self, limit: int) -> None:
        """The serving runtime changed: ``limit`` calls at once from now on."""
        with self._cond:
            self._limit = max(1, limit)
            self._cond.notify_all()

    def resize_remote(self, limit: int, prefer: bool = False) -> None:
        """The helper changed: ``limit`` frames in flight to it from now on (0: none), preferred or not."""
        with self._cond:
            self._remote_limit = max(0, limit)
            self._prefer_remote = prefer and limit > 0
            self._cond.notify_all()

    def acquire(self) -> int:
        """Wait for a slot; the token says which lane it is in (``OPEN``: the gate was open, nothing counted)."""
        if self._limit >= self.workers and self._remote_limit == 0:
            return OPEN
        with self._cond:
            while True:
                remote_free = self._remote_in_use < self._remote_limit
                if remote_free and self._prefer_remote:
                    self._remote_in_use += 1
                    return REMOTE
                if self._in_use < self._limit:
                    self._in_use += 1
                    return LOCAL
                if remote_free:
                    self._remote_in_use += 1
                    return REMOTE
                self._cond.wait()

    def release(self, token: int) -> None:
        if token == OPEN:
            return
        with self._cond:
            if token == REMOTE:
                self._remote_in_use -= 1
            else:
                self._in_use -= 1
            self._cond.notify()

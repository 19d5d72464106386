"""Watched engine calls: the thread an engine's calls run on, so a caller can stop waiting for a wedged driver.

``EngineWorker`` runs one engine's inferences on its own thread and gives up
on a call past its deadline (``EngineHang``), leaving the thread blocked in
the driver; ``call_with_timeout`` does the same for one-off calls (open,
close). Failover uses both for every engine it can leave.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from edgerun.engines.base import Engine
from edgerun.engines.breadcrumb import InFlight
from edgerun.errors import EngineError

log = logging.getLogger(__name__)


class EngineHang(EngineError):
    """An engine call overran its deadline (the driver is wedged)."""


def call_with_timeout(
    fn: Callable[[], Any], timeout: float, name: str, on_late: Callable[[Any], None] | None = None
) -> Any:
    """``fn()`` on a throw-away daemon thread; EngineHang if it does not return in time.

    ``on_late`` gets what ``fn`` returns after the caller gave up (an engine opened too
    late must still be closed, or its device memory and context leak).
    """
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            value = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err
            return
        with lock:
            late = box.get("abandoned", False)
            box["value"] = value
        if late and on_late is not None:
            try:
                on_late(value)
            except Exception as err:  # nobody waits for this thread any more: say it and end
                log.warning("%s: cleaning up a late result failed: %s", name, err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    with lock:  # decided under the lock: a value set after this is handed to on_late
        if "value" not in box and "error" not in box:
            box["abandoned"] = True
            raise EngineHang(f"{name} did not return within {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class EngineWorker:
    """One engine's calls, run on its own thread so the caller can stop waiting.

    ``call`` hands the job over with two locks used as binary semaphores (the
    cheapest wake-up CPython has; ~10 us a round trip) and waits at most the
    deadline. On a timeout the worker is abandoned: it stays blocked in the
    driver, and if the call ever returns the thread just ends.
    """

    def __init__(self, engine: Engine, name: str, inflight: InFlight | None = None) -> None:
        self.engine = engine
        self.inflight = inflight
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: tuple[np.ndarray, list[np.ndarray]] | None = None
        self._error: BaseException | None = None
        self.abandoned = False
        self._closed = False
        self.started_at = 0.0  # monotonic start of the call in flight; 0.0 when idle
        self._thread = threading.Thread(target=self._run, name=f"edgerun-engine-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine, inflight = self.engine, self.inflight
        while True:
            self._go.acquire()
            if self._closed:
                return
            job = self._job
            assert job is not None
            error: BaseException | None = None
            try:
                if inflight is not None:
                    with inflight:
                        engine.infer(job[0], job[1])
                else:
                    engine.infer(job[0], job[1])
            except BaseException as err:  # handed to the caller
                error = err
            self._error = error
            self._job = None
            if self.abandoned:
                return
            self._done.release()

    def call(self, tensor: np.ndarray, outputs: list[np.ndarray], deadline_s: float) -> None:
        """Run one inference; raises the engine's exception, or EngineHang past ``deadline_s``."""
        if self.abandoned or self._closed:
            raise EngineError("engine worker is no longer in service")
        self._job = (tensor, outputs)
        self.started_at = time.monotonic()
        self._go.release()
        if not self._done.acquire(timeout=deadline_s):
            self.abandoned = True
            raise EngineHang(f"inference ran past its {deadline_s * 1000:.0f} ms deadline")
        self.started_at = 0.0
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """End an idle worker's thread (an abandoned one ends by itself if its call returns)."""
        if self.abandoned or self._closed:
            return
        self._closed = True
        self._go.release()

"""The one owner of what serves: which model runtime the pipeline runs, and who may change it.

Three things change the serving runtime: failover (an engine dies, or a better
one recovers), an OTA swap to a new model, and the OTA rollback. They all go
through ``ServingController``:

* an **owner** (a ``Failover`` over one model's engines) is in charge at a
  time; ``activate(owner, runtime)`` serves ``runtime`` from the next frame
  only if ``owner`` is in charge, so a failover that was swapped out can never
  swap its model back in;
* ``swap(runtime, owner)`` hands the pipeline to another model and its owner
  (OTA update or rollback): the old owner stops re-probing, the new one starts,
  and the old runtime is retired (no frame in flight uses it) but left open so
  the caller can swap it back or close it;
* ``retire(runtime)`` waits until no frame in flight uses a runtime;
* it is the pipeline's ``InferGuard``: every engine call goes to the owner in
  charge, which watches it (deadline, faults).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, NamedTuple, Protocol

import numpy as np

from edgerun.engines.runtime import ModelRuntime
from edgerun.pipeline.runner import Pipeline

log = logging.getLogger(__name__)

RETIRE_TIMEOUT_S = 5.0


class ServingOwner(Protocol):
    """What the controller needs of a runtime's owner (``edgerun.engines.failover.Failover``)."""

    def infer(self, runtime: ModelRuntime, tensor: np.ndarray, outputs: list[np.ndarray]) -> None: ...

    def attach(self, serving: ServingController) -> None: ...

    def detach(self) -> None: ...

    def close(self) -> None: ...  # the node closes the owner in charge when it stops


class Served(NamedTuple):
    """A model being served: its runtime and the owner that watches its engines (None: called directly)."""

    runtime: ModelRuntime
    owner: ServingOwner | None


class ServingController:
    """Owns the pipeline's serving runtime; failover and OTA ask it to activate, swap or retire."""

    def __init__(
        self,
        *,
        retire_timeout_s: float = RETIRE_TIMEOUT_S,
        on_swap: Callable[[ModelRuntime], None] | None = None,
    ) -> None:
        self.retire_timeout_s = retire_timeout_s
        self._on_swap = on_swap
        self._lock = threading.Lock()
        self.pipeline: Pipeline | None = None
        self.owner: ServingOwner | None = None

    # -- reads (any thread) ------------------------------------------------------

    @property
    def runtime(self) -> ModelRuntime | None:
        pipeline = self.pipeline
        return pipeline.runtime if pipeline is not None else None

    def current(self) -> Served:
        with self._lock:
            assert self.pipeline is not None, "nothing is served yet"
            return Served(self.pipeline.runtime, self.owner)

    def in_charge(self, owner: ServingOwner) -> bool:
        """True while ``owner`` decides what serves (or before any pipeline is served)."""
        with self._lock:
            return self.pipeline is None or self.owner is owner

    # -- the frame path (infer threads) ---------------------------------------------

    def infer(self, runtime: ModelRuntime, tensor: np.ndarray, outputs: list[np.ndarray]) -> None:
        owner = self.owner
        if owner is None:
            runtime.engine.infer(tensor, outputs)
        else:
            owner.infer(runtime, tensor, outputs)

    # -- changes -----------------------------------------------------------------------

    def serve(self, pipeline: Pipeline, owner: ServingOwner | None) -> None:
        """Start serving ``pipeline`` (built with ``infer_guard=self``) under ``owner``."""
        with self._lock:
            self.pipeline, self.owner = pipeline, owner
        if owner is not None:
            owner.attach(self)

    def activate(self, owner: ServingOwner, runtime: ModelRuntime) -> bool:
        """Serve ``runtime`` from the next frame if ``owner`` is in charge; False (nothing done) if not."""
        with self._lock:
            if self.pipeline is not None and self.owner is not owner:
                return False
            if self.pipeline is not None and self.pipeline.runtime is not runtime:
                self.pipeline.swap_runtime(runtime)
            return True

    def prepare(self, runtime: ModelRuntime) -> None:
        """Make the buffers serving ``runtime`` needs now, so activating it later allocates nothing."""
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline.prepare(runtime)

    def retire(self, runtime: ModelRuntime, timeout: float | None = None) -> bool:
        """Wait until no frame in flight uses ``runtime`` and drop its buffers; False on timeout."""
        pipeline = self.pipeline
        if pipeline is None:
            return True
        return pipeline.retire(runtime, self.retire_timeout_s if timeout is None else timeout)

    def swap(self, runtime: ModelRuntime, owner: ServingOwner | None) -> Served:
        """Hand the pipeline to ``runtime`` under ``owner`` (blocking: call it off the event loop).

        Returns what served before, retired but still open: the caller swaps it back or closes it.
        """
        with self._lock:
            pipeline = self.pipeline
            assert pipeline is not None, "nothing is served yet"
            old = Served(pipeline.runtime, self.owner)
            self.owner = owner  # from here the old owner's decisions are refused
            pipeline.swap_runtime(runtime)
        if old.owner is not None and old.owner is not owner:
            old.owner.detach()  # stops its re-probing; its engines stay open
        if owner is not None and owner is not old.owner:
            owner.attach(self)
        if old.runtime is not runtime and not self.retire(old.runtime):
            log.warning("frames on the replaced model did not finish within %.1f s", self.retire_timeout_s)
        if self._on_swap is not None:
            self._on_swap(runtime)
        return old

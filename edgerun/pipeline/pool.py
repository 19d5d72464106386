"""The fixed ring of frame slots made at start, and the bounded hand-offs between stages.

A slot owns every per-frame buffer: the captured image, the model input tensor
(allocated by the engine, so it can be pinned or mapped memory) and the output
tensors. Stages pass slots, never arrays, so steady state allocates nothing
image-sized.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from edgerun.types import FrameMeta

DROP_OLDEST = "drop_oldest"
DROP_NEWEST = "drop_newest"
BLOCK = "block"
POLICIES = (DROP_OLDEST, DROP_NEWEST, BLOCK)


class RuntimeLike(Protocol):
    engine: Any


@dataclass(eq=False)
class FrameSlot:
    """One frame's buffers and what the stages learned about it.

    Tensor buffers are per model runtime (a swap may change the input shape or
    the back end's memory kind); ``bind`` points ``tensor``/``outputs`` at the
    buffers of the runtime this frame is prepared for.
    """

    index: int
    image: np.ndarray
    tensor: np.ndarray | None = None
    outputs: list[np.ndarray] = field(default_factory=list)
    runtime: Any = None  # the ModelRuntime this frame is bound to while in flight
    meta: FrameMeta | None = None
    # Monotonic end time of each stage for this frame (and when its read began); written in place, no per-frame dict.
    t_read: float = 0.0
    t_preprocessed: float = 0.0
    t_inferred: float = 0.0
    engine_key: str = ""
    ticket: int = -1  # output order, given when a worker takes the frame; -1 before
    whole: bool = False  # separate layout on a CPU engine: one infer thread does the whole frame
    remote: bool = False  # sent to a helper (edgerun.offload): it infers and decodes, this node publishes
    remote_detections: Any = None  # the helper's Detections, normalised to the model input like a decoder's
    trace: Any = None  # edgerun.tracing.FrameTraceIds when the frame's trace was begun before publishing
    # Keyed by the runtime object itself (not id()), so a dead runtime's id cannot be reused.
    _buffers: dict[Any, tuple[np.ndarray, list[np.ndarray]]] = field(default_factory=dict)

    def buffers_for(self, runtime: RuntimeLike) -> tuple[np.ndarray, list[np.ndarray]]:
        """This slot's input and output buffers for ``runtime``, made by its engine on first use."""
        if runtime not in self._buffers:
            engine = runtime.engine
            self._buffers[runtime] = (engine.allocate_input(), engine.allocate_outputs())
        return self._buffers[runtime]

    def bind(self, runtime: RuntimeLike) -> None:
        self.runtime = runtime
        self.tensor, self.outputs = self.buffers_for(runtime)

    def forget(self, runtime: RuntimeLike) -> None:
        self._buffers.pop(runtime, None)


class FramePool:
    """A fixed set of slots; ``acquire`` blocks until one is free."""

    def __init__(self, size: int, make_slot: Callable[[int], FrameSlot]) -> None:
        if size < 1:
            raise ValueError("pool size must be >= 1")
        self.slots = [make_slot(i) for i in range(size)]
        self._free = collections.deque(self.slots)
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> FrameSlot | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                return None
            return self._free.popleft()

    def release(self, slot: FrameSlot) -> None:
        slot.meta = None
        slot.runtime = None
        slot.ticket = -1
        slot.whole = False
        slot.remote = False
        slot.remote_detections = None
        slot.trace = None
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    @property
    def free(self) -> int:
        return len(self._free)


class Handoff:
    """A bounded FIFO of slots between two stage threads, with a flow-control policy.

    ``drop_oldest`` evicts the oldest waiting slot to make room (freshest frame
    wins, latency stays bounded), ``drop_newest`` refuses the new one, ``block``
    waits for room (offline files: nothing is lost). Evicted slots go to
    ``on_drop`` so the caller can count them and return them to the pool.
    """

    def __init__(self, capacity: int, policy: str, on_drop: Callable[[FrameSlot, str], None]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown flow-control policy {policy!r}")
        self.capacity = capacity
        self.policy = policy
        self._on_drop = on_drop
        self._items: collections.deque[FrameSlot] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, slot: FrameSlot) -> bool:
        """Hand a slot on; returns False if it was dropped (or the hand-off is closed)."""
        dropped: FrameSlot | None = None
        with self._cond:
            if self.policy == BLOCK:
                self._cond.wait_for(lambda: len(self._items) < self.capacity or self._closed)
            if self._closed:
                dropped = slot
            elif len(self._items) >= self.capacity:
                if self.policy == DROP_NEWEST:
                    dropped = slot
                else:
                    dropped = self._items.popleft()
            if dropped is not slot:
                self._items.append(slot)
                self._cond.notify_all()
        if dropped is not None:
            self._on_drop(dropped, "shutdown" if self._closed else self.policy)
        return dropped is not slot

    def get(self, timeout: float | None = None) -> FrameSlot | None:
        """The oldest waiting slot; None when closed and empty (or on timeout)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed, timeout):
                return None
            if not self._items:
                return None
            slot = self._items.popleft()
            self._cond.notify_all()
            return slot

    def wait_for_room(self) -> bool:
        """Block until a put would not drop or wait; False once closed.

        The stage feeding a blocking hand-off calls this *before* taking its next
        input, so it always works on the freshest frame instead of holding a
        stale one while the next stage is busy.
        """
        with self._cond:
            self._cond.wait_for(lambda: len(self._items) < self.capacity or self._closed)
            return not self._closed

    def close(self) -> None:
        """No more puts; getters drain what is left, then see None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)

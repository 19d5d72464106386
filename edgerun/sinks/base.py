"""The contract for anything that takes detection batches off the event loop.

Sinks run on the node's asyncio loop. ``submit`` must never block: each sink
keeps a bounded outbox that drops the oldest batch when full and counts it, so
a dead broker or a slow disk costs memory that is bounded and drops that are
visible in /metrics, never a stalled pipeline.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from edgerun.types import DetectionBatch


@dataclass(slots=True)
class SinkStats:
    """Counters every sink exposes; /metrics reads them at scrape time."""

    submitted: int = 0
    sent: int = 0
    dropped: int = 0  # evicted from a full outbox, never delivered
    errors: int = 0
    connected: bool = True


class Outbox:
    """A bounded FIFO that evicts the oldest item when full, counting each eviction."""

    def __init__(self, capacity: int, stats: SinkStats) -> None:
        if capacity < 1:
            raise ValueError("outbox capacity must be >= 1")
        self._items: collections.deque[Any] = collections.deque()
        self.capacity = capacity
        self._stats = stats

    def put(self, item: Any) -> None:
        if len(self._items) >= self.capacity:
            self._items.popleft()
            self._stats.dropped += 1
        self._items.append(item)

    def pop(self) -> Any:
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class Sink(ABC):
    """A destination for detection batches and node events."""

    KEY: ClassVar[str]

    def __init__(self) -> None:
        self.stats = SinkStats()

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect or open; must not raise for a destination that is merely unreachable."""

    @abstractmethod
    def submit(self, batch: DetectionBatch, t_submit: float) -> None:
        """Queue one batch for delivery. Called on the loop; never blocks."""

    def publish_event(self, kind: str, data: dict[str, Any]) -> None:  # noqa: B027
        """Queue a node event (state change, failover, OTA step). Optional."""

    # Whether publish_object calls on_delivered once the far end confirmed it (MQTT: the broker's PUBACK). The swarm
    # lets peers stay quiet about an object only once a confirming sink has it (at-least-once reporting).
    confirms_objects: ClassVar[bool] = False

    def publish_object(  # noqa: B027
        self, payload: dict[str, Any], on_delivered: Callable[[], None] | None = None
    ) -> None:
        """Queue a fleet object this node owns (schema ``edgerun.object/2``). Optional. A sink that
        ``confirms_objects`` calls ``on_delivered`` (on the loop) once it is delivered; others ignore it."""

    # Whether publish_object_image carries pictures (only MQTT: a JSON Lines file or a DDS topic of JPEGs helps
    # nobody). A node with no such sink crops nothing.
    carries_images: ClassVar[bool] = False

    def publish_object_image(self, object_id: str, jpeg: bytes, properties: list[tuple[str, str]]) -> bool:
        """Publish the picture of a fleet object this node owns (retained, replacing the last); False when this
        sink carries no pictures."""
        return False

    def publish_swarm_view(self, view: dict[str, Any]) -> None:  # noqa: B027
        """Publish this node's view of the swarm (schema ``edgerun.swarm/1``), replacing the last. Optional."""

    @abstractmethod
    async def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued (within ``timeout`` seconds) and release resources."""

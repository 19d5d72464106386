"""memberlist's TransmitLimitedQueue: the updates a member piggybacks on its packets, each sent a bounded
number of times, least-sent first, a newer update under the same key replacing the queued older one."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

MAX_QUEUED_BROADCASTS = 1024


@dataclass
class _Queued:
    data: bytes
    transmits: int
    order: int


class BroadcastQueue:
    """memberlist's TransmitLimitedQueue: least-sent first (newest first among equals), bounded retransmits.

    Queuing under a key that is already queued replaces the older item (newer state about a member, a newer
    payload of an app key); the replacement starts again at zero transmits.
    """

    def __init__(self, max_items: int = MAX_QUEUED_BROADCASTS) -> None:
        self._items: dict[Hashable, _Queued] = {}
        self._order = 0
        self._max_items = max_items
        self.pruned = 0

    def __len__(self) -> int:
        return len(self._items)

    def queue(self, key: Hashable, data: bytes) -> None:
        self._order += 1
        self._items.pop(key, None)
        self._items[key] = _Queued(data, 0, self._order)
        if len(self._items) > self._max_items:
            # Like memberlist's Prune: drop the items that have been sent the most (oldest among equals).
            victim = max(self._items, key=lambda k: (self._items[k].transmits, -self._items[k].order))
            del self._items[victim]
            self.pruned += 1

    def transmits(self, key: Hashable) -> int | None:
        item = self._items.get(key)
        return None if item is None else item.transmits

    def take(self, space: int, max_count: int, transmit_limit: int) -> list[bytes]:
        """Items that fit in ``space`` bytes (at most ``max_count``), each counted as sent once more."""
        if not self._items or space <= 0 or max_count <= 0:
            return []
        taken: list[bytes] = []
        ranked = sorted(self._items.items(), key=lambda kv: (kv[1].transmits, -kv[1].order))
        for key, item in ranked:
            if len(item.data) > space:
                continue
            taken.append(item.data)
            space -= len(item.data)
            item.transmits += 1
            if item.transmits >= transmit_limit:
                del self._items[key]
            if len(taken) >= max_count or space <= 0:
                break
        return taken


def retransmit_limit(retransmit_mult: int, n: int) -> int:
    """How many times one update is sent: ``mult * ceil(log10(n + 1))`` (memberlist util.go)."""
    return retransmit_mult * math.ceil(math.log10(n + 1.0))

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgerun.pipeline.pool import BLOCK, DROP_NEWEST, DROP_OLDEST, FramePool, FrameSlot, Handoff


def _slots(n: int) -> list[FrameSlot]:
    return [FrameSlot(i, np.zeros(1)) for i in range(n)]


def test_drop_oldest_evicts_the_oldest_waiting_slot():
    dropped: list[tuple[int, str]] = []
    h = Handoff(2, DROP_OLDEST, lambda s, r: dropped.append((s.index, r)))
    a, b, c = _slots(3)
    assert h.put(a) and h.put(b)
    assert h.put(c)  # the new one is accepted...
    assert dropped == [(0, "drop_oldest")]  # ...and the oldest went
    assert [h.get().index, h.get().index] == [1, 2]


def test_drop_newest_refuses_the_new_slot():
    dropped: list[tuple[int, str]] = []
    h = Handoff(1, DROP_NEWEST, lambda s, r: dropped.append((s.index, r)))
    a, b = _slots(2)
    assert h.put(a)
    assert not h.put(b)
    assert dropped == [(1, "drop_newest")]
    assert h.get() is a


def test_block_waits_for_room_and_loses_nothing():
    h = Handoff(1, BLOCK, lambda s, r: pytest.fail("block must not drop"))
    slots = _slots(20)
    got: list[int] = []

    def consumer() -> None:
        while (slot := h.get()) is not None:
            got.append(slot.index)
            time.sleep(0.001)

    t = threading.Thread(target=consumer)
    t.start()
    for s in slots:
        assert h.put(s)
        assert len(h) <= 1
    h.close()
    t.join(5)
    assert got == list(range(20))


def test_close_drains_then_returns_none():
    h = Handoff(3, DROP_OLDEST, lambda s, r: None)
    a, b = _slots(2)
    h.put(a)
    h.put(b)
    h.close()
    assert h.get() is a and h.get() is b and h.get() is None
    assert not h.wait_for_room()


def test_put_after_close_is_counted_as_shutdown():
    dropped: list[str] = []
    h = Handoff(1, BLOCK, lambda s, r: dropped.append(r))
    h.close()
    assert not h.put(_slots(1)[0])
    assert dropped == ["shutdown"]


def test_pool_acquire_blocks_until_release():
    pool = FramePool(1, lambda i: _slots(1)[0])
    slot = pool.acquire()
    assert pool.acquire(timeout=0.05) is None
    threading.Timer(0.05, pool.release, args=(slot,)).start()
    assert pool.acquire(timeout=5) is slot

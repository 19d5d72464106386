"""The origin's offload lane: which frames go to a helper, and what each kind of failure costs.

Real parts throughout: an ``OffloadClient`` on a real asyncio loop (in its own thread, as the node's loop
is to the pipeline's workers) talking over loopback TCP to a real ``OffloadServer``. The server's serve
function is the fault injector (slow, busy, a fixed answer), said where it is one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edgerun.config import OffloadConfig
from edgerun.engines.runtime import FrameLost, ServeLocally
from edgerun.offload.chooser import HelperCandidate, HelperChooser
from edgerun.offload.client import OffloadClient
from edgerun.offload.lane import LATE_STREAK, OffloadLane
from edgerun.offload.server import OffloadServer, ServeResult
from edgerun.pipeline.admission import LOCAL, OPEN, REMOTE, EngineSlots
from edgerun.testing.ports import LOOPBACK
from edgerun.types import Detections
from swarm.keyring import Keyring, generate_key

MODEL = "0123456789abcdef"
PIXELS = np.full((64, 64, 3), 90, np.uint8)


# -- admission: the remote lane --------------------------------------------------------------------------


def test_the_gate_is_open_without_a_remote_lane_and_closes_with_one():
    slots = EngineSlots(limit=2, workers=2)
    assert slots.acquire() == OPEN
    slots.resize_remote(2)
    assert [slots.acquire(), slots.acquire()] == [LOCAL, LOCAL]  # local first: the helper takes the surplus
    assert slots.acquire() == REMOTE


def test_preferred_helper_fills_first_and_the_local_engine_takes_the_overflow():
    slots = EngineSlots(limit=1, workers=4)
    slots.resize_remote(2, prefer=True)
    assert [slots.acquire() for _ in range(3)] == [REMOTE, REMOTE, LOCAL]


def test_a_waiting_worker_is_woken_when_a_helper_opens_the_remote_lane():
    slots = EngineSlots(limit=1, workers=2)
    assert slots.acquire() == LOCAL
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got, "no slot free: the second worker waits"
    slots.resize_remote(1)
    waiter.join(5)
    assert got == [REMOTE]
    slots.release(REMOTE)
    slots.resize_remote(0)  # the helper is gone: the remote lane closes, the local one still works
    slots.release(LOCAL)
    assert slots.acquire() == LOCAL


# -- the lane against a real helper ----------------------------------------------------------------------


class Helper:
    """A real OffloadServer whose serve function is the fault injector: ``behaviour`` decides each answer."""

    def __init__(self) -> None:
        self.behaviour: Callable[[], ServeResult] = self.ok
        self.calls = 0

    @staticmethod
    def ok() -> ServeResult:
        boxes = np.array([[0.1, 0.2, 0.3, 0.4]], np.float32)
        return ServeResult(Detections(boxes, np.array([0.9], np.float32), np.array([0], np.int32)), "ok", 1.0)

    def serve(self, model_hash: str, image: np.ndarray, traceparent: str, origin: str) -> ServeResult:
        self.calls += 1
        assert image.shape == PIXELS.shape
        return self.behaviour()


@contextmanager
def lane_and_helper(mode: str = "always", deadline_ms: float = 300.0) -> Iterator[tuple[OffloadLane, Helper, Any]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    key = generate_key()
    helper = Helper()
    server = OffloadServer(Keyring([key]), "helper", helper.serve, workers=2, max_queue=4)
    addr = asyncio.run_coroutine_threadsafe(server.start((LOOPBACK, 0)), loop).result(5)
    client = OffloadClient(Keyring([key]), "origin", window=2)
    slots = EngineSlots(limit=1, workers=3)
    cfg = OffloadConfig(mode=mode, window=2, deadline_ms=deadline_ms, codec="zstd")
    chooser = HelperChooser(hold_s=0.0, backoff_s=0.5, backoff_max_s=4.0)
    lane = OffloadLane(cfg, client, loop, slots, model_hash=lambda: MODEL, chooser=chooser)
    candidate = HelperCandidate("helper", addr, spare_fps=50.0, infer_ms=5.0, queue=0, rtt_ms=1.0)
    env = SimpleNamespace(server=server, candidate=candidate, slots=slots, loop=loop, chooser=chooser)
    try:
        yield lane, helper, env
    finally:
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(5)
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def frame() -> SimpleNamespace:
    return SimpleNamespace(trace=None)


def settle(lane: OffloadLane) -> None:
    """Wait for the connection a choice opens (the remote lane opens once it is up)."""
    deadline = time.monotonic() + 5
    while lane._connecting is not None and time.monotonic() < deadline:
        time.sleep(0.01)


def choose(lane: OffloadLane, env: Any, now: float | None = None) -> None:
    now = time.monotonic() if now is None else now
    lane.update([env.candidate], now, local_capacity_fps=10.0, source_fps=30.0)
    settle(lane)


def test_frames_go_to_the_chosen_helper_and_come_back_as_its_detections():
    with lane_and_helper() as (lane, helper, env):
        with pytest.raises(ServeLocally):
            lane.infer(PIXELS, frame())  # nobody chosen yet: served here, nothing lost
        choose(lane, env)
        assert lane.helper is not None and env.slots.remote_limit == 2
        detections, name = lane.infer(PIXELS, frame())
        assert name == "helper" and helper.calls == 1
        assert np.allclose(detections.boxes, [[0.1, 0.2, 0.3, 0.4]]) and detections.scores[0] == pytest.approx(0.9)
        assert lane.counts["done"] == 1 and lane.counts["local"] == 1


def test_a_helper_that_goes_away_is_dropped_at_once_and_frames_are_served_here():
    with lane_and_helper() as (lane, helper, env):
        choose(lane, env)
        lane.infer(PIXELS, frame())
        asyncio.run_coroutine_threadsafe(env.server.close(), env.loop).result(5)
        # The connection was closed under us: the next frame fails "lost" (dropped) or "refused" (served here).
        with pytest.raises((FrameLost, ServeLocally)):
            lane.infer(PIXELS, frame())
        assert lane.helper is None and env.slots.remote_limit == 0
        assert lane.counts["helper_dropped"] == 1
        with pytest.raises(ServeLocally):
            lane.infer(PIXELS, frame())
        # Backed off: not chosen again straight away, whatever its metadata says.
        choose(lane, env)
        assert lane.helper is None


def test_late_frames_are_dropped_and_counted_and_two_in_a_row_drop_the_helper():
    with lane_and_helper(deadline_ms=150.0) as (lane, helper, env):
        choose(lane, env)

        def slow() -> ServeResult:  # fault injection: a helper slower than the deadline
            time.sleep(0.4)
            return Helper.ok()

        helper.behaviour = slow
        for n in range(LATE_STREAK):
            assert lane.helper is not None, f"dropped after {n} late frame(s)"
            with pytest.raises(FrameLost) as lost:
                lane.infer(PIXELS, frame())
            assert lost.value.reason in ("offload_late", "offload_expired")
        assert lane.helper is None and lane.counts["helper_dropped"] == 1


def test_busy_answers_are_served_here_and_a_persistently_busy_helper_is_dropped():
    with lane_and_helper() as (lane, helper, env):
        choose(lane, env)
        helper.behaviour = lambda: ServeResult(None, "busy")  # fault injection: a helper with no room
        for _ in range(3):
            with pytest.raises(ServeLocally):
                lane.infer(PIXELS, frame())
        assert lane.counts["busy"] == 3 and lane.helper is None


def test_a_dropped_helper_is_chosen_again_once_its_backoff_ends():
    with lane_and_helper() as (lane, helper, env):
        choose(lane, env)
        helper.behaviour = lambda: ServeResult(None, "model")  # it swapped to another model
        with pytest.raises(ServeLocally):
            lane.infer(PIXELS, frame())
        assert lane.helper is None
        now = time.monotonic()
        choose(lane, env, now + 0.1)
        assert lane.helper is None, "still backed off"
        helper.behaviour = Helper.ok
        choose(lane, env, now + 1.0)
        assert lane.helper is not None
        lane.infer(PIXELS, frame())
        assert lane.counts["done"] == 1


def test_auto_engages_above_the_engage_load_and_lets_go_below_the_release_load():
    with lane_and_helper(mode="auto") as (lane, helper, env):
        now = time.monotonic()
        lane.update([env.candidate], now - 1, local_capacity_fps=0.0, source_fps=15.0)  # engine not measured yet
        assert lane.helper is None and not lane.engaged
        lane.update([env.candidate], now, local_capacity_fps=20.0, source_fps=15.0)  # load 0.75: keeps up
        assert lane.helper is None and env.slots.remote_limit == 0
        lane.update([env.candidate], now + 1, local_capacity_fps=15.0, source_fps=15.0)  # load 1.0: needs help
        settle(lane)
        assert lane.helper is not None and env.slots.remote_limit == 2
        lane.update([env.candidate], now + 2, local_capacity_fps=18.0, source_fps=15.0)  # 0.83: between, stays
        assert lane.helper is not None
        lane.update([env.candidate], now + 3, local_capacity_fps=30.0, source_fps=15.0)  # 0.5: released
        assert lane.helper is None and env.slots.remote_limit == 0


def test_auto_prefers_a_helper_only_when_it_is_clearly_faster_than_the_local_engine():
    with lane_and_helper(mode="auto") as (lane, helper, env):
        now = time.monotonic()
        # Local engine: 1 call at 100 ms (10 fps); the helper's estimate is 1 + 5 = 6 ms: preferred.
        lane.update([env.candidate], now, local_capacity_fps=10.0, source_fps=15.0)
        settle(lane)
        assert lane.prefer
        # Local engine at 8 ms (125 fps) but a source faster still: the helper takes the surplus only.
        lane.update([env.candidate], now + 1, local_capacity_fps=125.0, source_fps=200.0)
        assert lane.helper is not None and not lane.prefer


def test_a_helper_that_cannot_be_reached_is_never_sent_a_frame():
    """The connection opens when a helper is chosen, before its first frame: an address nobody listens on is
    refused there (backed off, counted) and no frame waits on it."""
    with lane_and_helper() as (lane, helper, env):
        asyncio.run_coroutine_threadsafe(env.server.close(), env.loop).result(5)
        choose(lane, env)
        assert lane.helper is None and env.slots.remote_limit == 0
        assert lane.counts["refused"] == 1 and env.chooser.backoff_until("helper") is not None
        with pytest.raises(ServeLocally):
            lane.infer(PIXELS, frame())
        assert helper.calls == 0

"""HelperChooser on an injected clock: lowest estimated latency, hysteresis against flapping, per-helper backoff."""

from __future__ import annotations

import random

import pytest

from edgerun.offload.chooser import HelperCandidate, HelperChooser, estimated_latency_ms


def helper(
    name: str, *, rtt: float | None = 5.0, infer: float = 20.0, queue: int = 0, spare: float = 10.0
) -> HelperCandidate:
    return HelperCandidate(name, ("10.0.0.1", 7950), spare_fps=spare, infer_ms=infer, queue=queue, rtt_ms=rtt)


def test_estimate_is_round_trip_plus_the_queue_ahead_plus_our_frame() -> None:
    assert estimated_latency_ms(helper("a", rtt=8.0, infer=20.0, queue=3)) == 8.0 + 20.0 + 3 * 20.0
    assert estimated_latency_ms(helper("a", rtt=None)) == float("inf")


def test_picks_the_lowest_estimate_among_those_with_spare_capacity_and_a_round_trip() -> None:
    chooser = HelperChooser()
    candidates = [
        helper("near-but-queued", rtt=2.0, infer=20.0, queue=4),  # 102 ms
        helper("far", rtt=60.0, infer=20.0),  # 80 ms
        helper("fast", rtt=10.0, infer=15.0, queue=1),  # 40 ms
        helper("unmeasured", rtt=None, infer=1.0),  # best on paper, but no probe answered yet
        helper("full", rtt=1.0, infer=5.0, spare=0.0),  # no spare capacity
    ]
    # the order the gossip lists members in does not matter
    for seed in range(5):
        random.Random(seed).shuffle(candidates)
        chooser = HelperChooser()
        chosen = chooser.choose(candidates, now=0.0)
        assert chosen is not None and chosen.name == "fast" and chooser.current == "fast"


def test_no_candidate_means_serve_locally() -> None:
    chooser = HelperChooser()
    assert chooser.choose([], now=0.0) is None
    assert chooser.choose([helper("x", rtt=None), helper("y", spare=0.0)], now=1.0) is None
    assert chooser.current is None


def test_two_helpers_whose_estimates_cross_within_30_percent_do_not_flap() -> None:
    chooser = HelperChooser(hold_s=10.0, better_by=0.3)
    chosen = []
    for second in range(120):
        # a and b swap places every second, the better one about 25 % ahead (40 ms vs 50 ms)
        fast, slow = (15.0, 25.0) if second % 2 else (25.0, 15.0)
        now = float(second)
        pick = chooser.choose([helper("a", rtt=fast), helper("b", rtt=slow)], now)
        assert pick is not None
        chosen.append(pick.name)
    assert set(chosen) == {chosen[0]} and chooser.stats["switches"] == 1


def test_a_clearly_better_helper_wins_once_the_current_one_was_held_long_enough() -> None:
    chooser = HelperChooser(hold_s=10.0, better_by=0.3)
    a, b = helper("a", rtt=10.0), helper("b", rtt=40.0)  # 30 ms vs 60 ms
    assert chooser.choose([a, b], now=0.0) is a
    b_better = helper("b", rtt=1.0)  # 21 ms: 30 % below a's 30 ms is 21 ms; not yet better by more than that
    assert chooser.choose([a, b_better], now=20.0) is a
    b_clearly = helper("b", rtt=0.5)  # 20.5 ms
    assert chooser.choose([a, b_clearly], now=5.0) is a  # not held for hold_s yet
    assert chooser.choose([a, b_clearly], now=9.9) is a
    assert chooser.choose([a, b_clearly], now=10.0) is b_clearly
    assert chooser.current == "b" and chooser.stats["switches"] == 2
    # and the new one is held in turn: a's comeback must wait hold_s from the switch
    a_back = helper("a", rtt=0.0, infer=5.0)
    assert chooser.choose([a_back, b_clearly], now=19.9) is b_clearly
    assert chooser.choose([a_back, b_clearly], now=20.0) is a_back


def test_the_current_helper_is_kept_when_its_spare_capacity_is_ours() -> None:
    """Our own frames use up the helper's spare capacity; leaving it for that would flap between helpers."""
    chooser = HelperChooser()
    assert chooser.choose([helper("a"), helper("b", rtt=9.0)], now=0.0).name == "a"  # type: ignore[union-attr]
    busy = helper("a", spare=0.0)
    assert chooser.choose([busy, helper("b", rtt=9.0)], now=30.0) is busy
    # a new helper with no spare capacity is never taken
    chooser.failed("a", now=31.0, reason="busy")
    assert chooser.choose([busy, helper("b", spare=0.0)], now=31.0) is None


def test_a_helper_that_left_the_candidates_is_replaced_at_once() -> None:
    chooser = HelperChooser(hold_s=10.0)
    assert chooser.choose([helper("a"), helper("b", rtt=50.0)], now=0.0).name == "a"  # type: ignore[union-attr]
    pick = chooser.choose([helper("b", rtt=50.0)], now=1.0)  # a died, or stopped serving our model
    assert pick is not None and pick.name == "b" and chooser.current == "b"


def test_a_failed_helper_is_skipped_until_its_backoff_ends_and_the_backoff_doubles() -> None:
    chooser = HelperChooser(backoff_s=2.0, backoff_max_s=10.0)
    a, b = helper("a", rtt=1.0), helper("b", rtt=30.0)
    assert chooser.choose([a, b], now=0.0) is a
    chooser.failed("a", now=1.0, reason="lost")
    assert chooser.current is None  # dropped at once
    assert chooser.choose([a, b], now=1.0) is b
    assert chooser.choose([a, b], now=2.9) is b
    assert chooser.backoff_until("a") == 3.0
    # the other in-flight requests of the same broken connection fail too: the same outage, no doubling
    chooser.failed("a", now=1.1, reason="lost")
    chooser.failed("a", now=1.2, reason="lost")
    assert chooser.backoff_until("a") == 3.0
    # after its backoff a is a candidate again, but b is held (a is better by more than 30 %, b held < 10 s)
    assert chooser.choose([a, b], now=3.0) is b
    chooser.failed("b", now=3.5, reason="late")
    assert chooser.choose([a, b], now=3.5) is a
    # a fails again after its first backoff ended: 4 s, then 8 s, then capped at 10 s
    for now, until in ((4.0, 8.0), (8.0, 16.0), (16.0, 26.0), (26.0, 36.0)):
        chooser.failed("a", now=now, reason="refused")
        assert chooser.backoff_until("a") == until
        assert chooser.choose([a], now=now) is None
        assert chooser.choose([a], now=until) is a
    assert chooser.failures == {"lost": 3, "late": 1, "refused": 4}


def test_a_success_resets_the_backoff() -> None:
    chooser = HelperChooser(backoff_s=2.0)
    a = helper("a")
    chooser.failed("a", now=0.0, reason="lost")
    chooser.failed("a", now=2.0, reason="lost")
    assert chooser.backoff_until("a") == 6.0
    assert chooser.choose([a], now=6.0) is a
    chooser.succeeded("a")
    assert chooser.backoff_until("a") is None
    chooser.failed("a", now=7.0, reason="lost")
    assert chooser.backoff_until("a") == 9.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hold_s": -1.0},
        {"better_by": 1.0},
        {"better_by": -0.1},
        {"backoff_s": 0.0},
        {"backoff_s": 5.0, "backoff_max_s": 1.0},
    ],
)
def test_settings_that_cannot_work_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HelperChooser(**kwargs)

"""swarm.dedup: tracks, claims on the wire, the owner order, hold time, partitions and bounded memory."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.dedup import (
    Claim,
    Dedup,
    DedupConfig,
    FleetObject,
    Observation,
    encode_claim,
    group_owners,
    owner_order,
)
from swarm.geo import DEFAULT_ANCHOR, ground_offset_m, offset_latlon

SCHEMA = json.loads((Path(__file__).parents[2] / "edgerun" / "schema" / "object-v2.json").read_text())
WALL0 = 1_795_000_000.0
# No per-example deadline: the machine is shared, and a slow example is not a failure.
UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


LAT0, LON0, ALT0 = DEFAULT_ANCHOR
LAT0_E7, LON0_E7 = round(LAT0 * 1e7), round(LON0 * 1e7)


def obs(label: str, east: float, north: float, sigma: float, score: float) -> Observation:
    """A fix given in metres east/north of the default anchor (the tests' scene), on its ground."""
    lat, lon = offset_latlon(LAT0, LON0, east, north) if math.isfinite(east + north) else (east, north)
    return Observation(label, lat, lon, ALT0, sigma, score)


def face(east: float, north: float, score: float = 0.8, sigma: float = 0.5) -> Observation:
    return obs("face", east, north, sigma, score)


def east_north(obj: FleetObject) -> tuple[float, float]:
    """A reported object's metres east/north of the anchor, to compare with where the fixes were."""
    return ground_offset_m(LAT0, LON0, obj.lat, obj.lon)


def decide(node: Dedup, now: float) -> list[FleetObject]:
    """A driver's tick: the objects to publish, each confirmed to dedup (``published``) as its sink takes it."""
    objects = node.tick(now, WALL0 + now)
    for obj in objects:
        node.published(obj.id)
    return objects


def exchange(*nodes: Dedup, now: float) -> None:
    """Deliver every node's queued claims to every other node (gossip without loss)."""
    batches = [(n, n.outgoing()) for n in nodes]
    for sender, out in batches:
        for other in nodes:
            if other is not sender:
                for _, payload in out:
                    other.receive(payload, now)


claims_st = st.builds(
    Claim,
    node=st.sampled_from(["a", "b", "c", "drone-7", "zz"]),
    track=st.integers(0, 6),
    label=st.sampled_from(["face", "person"]),
    lat_e7=st.integers(LAT0_E7 - 2700, LAT0_E7 + 2700),  # +-30 m
    lon_e7=st.integers(LON0_E7 - 4500, LON0_E7 + 4500),
    alt_dm=st.integers(900, 1100),
    sigma_dm=st.integers(0, 40),
    first_ms=st.integers(0, 200_000),
    span_ms=st.integers(0, 20_000),
    score_pm=st.integers(0, 1000),
    reported=st.booleans(),
)


# -- the wire ---------------------------------------------------------------------------------------------------


@given(claims_st)
@settings(UNTIMED)
def test_claim_round_trips_and_is_small(claim: Claim) -> None:
    payload = encode_claim(claim)
    assert len(payload) <= 64
    node = Dedup("observer", now=0.0)
    node.receive(payload, 0.0)
    assert node.held_claims() == [claim]
    assert node.stats.claims_received == 1 and not node.stats.dropped


@given(st.binary(max_size=300))
@settings(UNTIMED)
def test_no_byte_string_makes_receive_raise(data: bytes) -> None:
    node = Dedup("observer", now=0.0)
    node.receive(data, 0.0)
    assert node.stats.claims_received + sum(node.stats.dropped.values()) == 1


@given(
    st.lists(
        st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=70), st.floats(), st.booleans(), st.none()),
        max_size=14,
    )
)
@settings(UNTIMED)
def test_claim_shaped_garbage_is_dropped_as_invalid(fields: list) -> None:
    node = Dedup("observer", now=0.0)
    node.receive(msgspec.msgpack.encode([1, *fields]), 0.0)
    assert node.stats.claims_received + sum(node.stats.dropped.values()) == 1
    if node.stats.claims_received == 0:
        assert set(node.stats.dropped) <= {"invalid", "oversized"}


def test_bad_payloads_counted_by_reason() -> None:
    node = Dedup("me", now=0.0)
    good = Claim("peer", 1, "face", LAT0_E7, LON0_E7, 1000, 5, 1000, 10, 900, False)
    node.receive(b"", 0.0)
    node.receive(b"\xc1", 0.0)  # msgpack's never-used byte
    node.receive(b"\x91" * 300, 0.0)
    node.receive(msgspec.msgpack.encode([1, "peer", -1, "face", 0, 0, 0, 0, 0, 0, False]), 0.0)  # negative track
    node.receive(encode_claim(Claim("me", 1, "face", 0, 0, 0, 0, 0, 0, 0, False)), 0.0)  # our own, echoed
    node.receive(encode_claim(good), 0.0)
    older = Claim("peer", 1, "face", LAT0_E7, LON0_E7, 1000, 5, 1000, 5, 900, False)
    node.receive(encode_claim(older), 0.0)
    assert node.stats.dropped == {"empty": 1, "malformed": 1, "oversized": 1, "invalid": 1, "own": 1, "stale": 1}
    counters = node.stats.as_dict()
    assert counters["claims_received"] == 2 and counters["dropped"]["stale"] == 1
    assert json.loads(json.dumps(counters)) == counters
    assert node.held_claims() == [good]


# -- the owner order --------------------------------------------------------------------------------------------


@given(st.lists(claims_st, max_size=40, unique_by=lambda c: (c.node, c.track)), st.randoms(use_true_random=False))
@settings(UNTIMED, max_examples=150)
def test_owner_order_is_total_and_the_same_on_every_node(claims: list[Claim], rnd: random.Random) -> None:
    keys = [owner_order(c) for c in claims]
    assert len(set(keys)) == len(keys)  # no two distinct claims tie: the order is total
    cfg = DedupConfig()
    expected = group_owners(claims, cfg)
    # Each owner comes first in the order among the claims it owns, and owns itself.
    by_key = {c.key: c for c in claims}
    for key, owner in expected.items():
        assert owner_order(by_key[owner]) <= owner_order(by_key[key])
        assert expected[owner] == owner
    views = []
    for name in ("x", "y", "z"):
        node = Dedup(name, cfg, now=0.0)
        shuffled = list(claims)
        rnd.shuffle(shuffled)
        # Older versions of some claims arrive too, before or after the newest: they must not win.
        for c in shuffled:
            if c.span_ms and rnd.random() < 0.3:
                node.receive(encode_claim(msgspec.structs.replace(c, span_ms=c.span_ms - 1)), 0.0)
            node.receive(encode_claim(c), 0.0)
        held = node.held_claims()
        assert sorted(held, key=owner_order) == sorted(claims, key=owner_order)
        views.append(group_owners(held, cfg))
    assert views[0] == views[1] == views[2] == expected


# -- tracks and reports -----------------------------------------------------------------------------------------


def test_successive_fixes_make_one_track_and_one_report() -> None:
    node = Dedup("a", now=0.0)
    reports = []
    for i in range(30):
        t = i * 0.1
        node.observe([face(10.0 + 0.05 * i, 20.0), face(40.0, 5.0)], t, WALL0 + t)
        reports += node.tick(t, WALL0 + t)
    assert node.tracks == 2
    assert sorted((r.label, *map(round, east_north(r))) for r in reports) == [("face", 10, 20), ("face", 40, 5)]
    # A fix of another class at the same place is another object.
    node.observe([obs("person", 40.0, 5.0, 0.5, 0.9)], 3.0, WALL0 + 3.0)
    assert [r.label for r in node.tick(3.0, WALL0 + 3.0)] == ["person"]
    assert node.stats.objects_reported == 3


def test_fleet_payload_matches_schema() -> None:
    a, b = Dedup("drone-a", DedupConfig(hold_s=1.0), now=0.0), Dedup("drone-b", DedupConfig(hold_s=1.0), now=0.0)
    a.observe([face(5.0, 5.0, score=0.7, sigma=1.0)], 0.0, WALL0)
    b.observe([face(6.0, 5.0, score=0.9, sigma=1.0)], 0.0, WALL0 + 0.5)
    for node in (a, b):
        assert node.tick(0.0, WALL0) == []  # holding
    exchange(a, b, now=0.1)
    objects = a.tick(1.0, WALL0 + 1.0) + b.tick(1.0, WALL0 + 1.0)
    assert len(objects) == 1
    obj = objects[0]
    payload = obj.to_payload()
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(payload, SCHEMA)
    # a saw it first: a leads and reports; b waits for a's report
    assert payload["owner"] == "drone-a" and payload["seen_by"] == ["drone-a", "drone-b"]
    assert east_north(obj) == pytest.approx((5.5, 5.0), abs=0.01) and payload["alt_m"] == ALT0
    assert payload["score"] == 0.9 and payload["first_seen"] == WALL0
    assert json.loads(json.dumps(payload)) == payload
    bad = dict(payload, score=1.5)
    try:
        jsonschema.validate(bad, SCHEMA)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("score above 1 accepted by the schema")


def test_hold_time_waits_for_peers_and_the_earliest_claim_reports() -> None:
    cfg = DedupConfig(hold_s=0.6)
    nodes = [Dedup(n, cfg, now=0.0) for n in ("a", "b", "c")]
    scores = {"a": 0.7, "b": 0.6, "c": 0.95}
    reports: dict[str, list[FleetObject]] = {n.node_id: [] for n in nodes}
    for step in range(20):
        t = step * 0.1
        for n in nodes:
            if n.node_id == "b" or step >= 1:  # b sees it first; a and c a frame later, with better scores
                n.observe([face(12.0 + 0.3 * "abc".index(n.node_id), 7.0, score=scores[n.node_id])], t, WALL0 + t)
            reports[n.node_id] += decide(n, t)
        if step == 2:  # claims arrive within the hold
            exchange(*nodes, now=t)
        assert all(not r for r in reports.values()) or t >= 0.6
    assert [len(reports[n]) for n in "abc"] == [0, 1, 0]
    assert reports["b"][0].seen_by == ("a", "b", "c") and reports["b"][0].score == 0.95
    # The others learn it was published from b's claim and go quiet: no more gossip for their copies.
    exchange(*nodes, now=2.0)
    for n in nodes:
        n.tick(2.1, WALL0 + 2.1)
    assert nodes[0].stats.suppressed == 1 and nodes[2].stats.suppressed == 1
    assert nodes[0].outgoing() == [] and nodes[2].outgoing() == []
    for n in nodes:
        n.observe([face(12.3, 7.0, score=1.0)], 2.5, WALL0 + 2.5)
        assert n.tick(2.5, WALL0 + 2.5) == []
    assert nodes[0].outgoing() == [] and nodes[2].outgoing() == []
    assert {c.reported for n in nodes for c in n.held_claims() if c.node == "b"} == {True}


def test_a_claim_says_reported_only_once_the_driver_confirmed_the_publication() -> None:
    cfg = DedupConfig(hold_s=0.0, claim_refresh_s=5.0, peer_silence_s=10.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(3.0, 3.0)], 0.0, WALL0)
    (obj,) = a.tick(0.0, WALL0)
    exchange(a, b, now=0.1)
    assert {c.reported for c in b.held_claims()} == {False}  # handed to the sinks, not yet published
    assert a.tick(4.9, WALL0 + 4.9) == [] and a.get_timer() == 5.0
    (again,) = a.tick(5.0, WALL0 + 5.0)  # not confirmed: handed out again, same id
    assert again.id == obj.id and not again.update and a.stats.republished == 1
    a.published(obj.id)
    exchange(a, b, now=5.1)
    assert {c.reported for c in b.held_claims()} == {True}
    assert a.tick(20.0, WALL0 + 20.0) == [] and a.stats.objects_reported == 1
    a.published("no-such-object")  # ignored


def test_hold_zero_reports_at_once_and_suppresses_later_duplicates() -> None:
    a, b = Dedup("a", now=0.0), Dedup("b", now=0.0)
    a.observe([face(3.0, 3.0, score=0.6)], 0.0, WALL0)
    first = decide(a, 0.0)
    assert len(first) == 1 and first[0].owner == "a"
    exchange(a, b, now=0.1)
    # b sees it later with a better score: a's claim says it is published, so b stays quiet.
    b.observe([face(4.0, 3.5, score=0.99)], 5.0, WALL0 + 5.0)
    assert b.tick(5.0, WALL0 + 5.0) == []
    assert b.stats.suppressed == 1 and b.stats.objects_reported == 0


def test_the_owner_publishes_again_when_more_drones_have_seen_its_object() -> None:
    cfg = DedupConfig(share_sightings=True)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(3.0, 3.0, score=0.9)], 0.0, WALL0)
    (first,) = decide(a, 0.0)
    assert first.seen_by == ("a",) and not first.update
    exchange(a, b, now=0.1)
    b.observe([face(3.3, 3.0, score=0.7)], 2.0, WALL0 + 2.0)  # b flies over it later: its copy is suppressed
    assert b.tick(2.0, WALL0 + 2.0) == [] and b.stats.suppressed == 1
    exchange(a, b, now=2.1)  # ... and it tells the owner it saw it, once
    (again,) = a.tick(2.2, WALL0 + 2.2)
    assert (again.id, again.seen_by, again.owner, again.update) == (first.id, ("a", "b"), "a", True)
    assert a.stats.objects_reported == 1 and a.stats.object_updates == 1
    b.observe([face(3.2, 3.0, score=0.7)], 3.0, WALL0 + 3.0)
    b.tick(3.0, WALL0 + 3.0)
    exchange(a, b, now=3.1)
    assert a.tick(3.2, WALL0 + 3.2) == []  # nobody new
    # Without share_sightings b's suppressed copy costs no gossip, and the owner never hears of it.
    quiet = Dedup("q", now=0.0)
    a.resend_claims()  # as on q's join
    assert a.tick(3.25, WALL0 + 3.25) == []
    exchange(a, quiet, now=3.3)
    quiet.observe([face(3.1, 3.0)], 4.0, WALL0 + 4.0)
    assert quiet.tick(4.0, WALL0 + 4.0) == [] and quiet.outgoing() == []


def test_flush_reports_every_held_object_no_known_report_covers() -> None:
    cfg = DedupConfig(hold_s=10.0, window_s=60.0)
    a, b, c = (Dedup(n, cfg, now=0.0) for n in "abc")
    b.observe([face(3.2, 3.0, score=0.9)], 0.0, WALL0)  # b saw this one first: b leads it
    a.observe([face(3.0, 3.0, score=0.6), face(20.0, 3.0, score=0.6)], 0.5, WALL0 + 0.5)  # 20 m: only a saw it
    assert a.tick(0.5, WALL0 + 0.5) == [] and b.tick(0.5, WALL0 + 0.5) == []  # held; their claims are queued
    exchange(a, b, now=0.6)
    assert a.tick(1.0, WALL0 + 1.0) == []
    # a leaves before b's hold ends: it cannot wait for b's report, so it reports both (at least once).
    reported = a.flush(1.0, WALL0 + 1.0)
    assert sorted((round(east_north(o)[0]), o.owner) for o in reported) == [(3, "a"), (20, "a")]
    assert a.stats.deferred_reports == 1
    for obj in reported:
        a.published(obj.id)
    assert a.flush(1.1, WALL0 + 1.1) == []  # once
    # c has seen the first one too, and holds a's published claim of it: leaving, it reports nothing.
    exchange(a, c, now=1.2)
    c.observe([face(3.1, 3.0)], 1.5, WALL0 + 1.5)
    assert c.flush(1.5, WALL0 + 1.5) == [] and c.stats.suppressed == 1


def test_outside_the_radius_or_the_window_is_another_object() -> None:
    cfg = DedupConfig(radius_m=5.0, sigma_gate=2.0, window_s=30.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(0.0, 0.0, sigma=1.5)], 0.0, WALL0)
    assert len(decide(a, 0.0)) == 1
    exchange(a, b, now=0.0)
    b.observe([face(4.5, 0.0, sigma=1.5)], 1.0, WALL0 + 1.0)  # 4.5 m: within radius_m, one object
    assert decide(b, 1.0) == [] and b.stats.suppressed == 1
    # 6 m: beyond radius_m. Uncertainties do not widen it (they would to 5 + 2 * hypot(1.5, 1.5) = 9.2 m):
    # a fresh fix's wide gate must not silence a person a few metres from the one reported.
    b.observe([face(0.0, 6.0, sigma=1.5)], 1.1, WALL0 + 1.1)
    assert len(decide(b, 1.1)) == 1
    # The same spot 40 s after a's last sighting (window 30 s): a new object.
    b.observe([face(0.0, 0.0, sigma=0.5)], 40.0, WALL0 + 40.0)
    assert len(decide(b, 40.0)) == 1


def test_partition_each_side_reports_then_heal_reports_nothing_again() -> None:
    cfg = DedupConfig(hold_s=0.5, window_s=60.0)
    west = [Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)]
    east = [Dedup("c", cfg, now=0.0)]
    counts = {n.node_id: 0 for n in west + east}
    for step in range(50):
        t = step * 0.2
        for n in west + east:
            n.observe([face(20.0 + 0.2 * (step % 3), 30.0, score=0.5 + 0.1 * "abc".index(n.node_id))], t, WALL0 + t)
            counts[n.node_id] += len([o for o in decide(n, t) if not o.update])
        exchange(*west, now=t)  # the partition: c hears nobody
        exchange(*east, now=t)
    assert sum(counts[n] for n in "ab") == 1 and counts["c"] == 1  # one report per side
    for step in range(50, 100):  # healed
        t = step * 0.2
        for n in west + east:
            n.observe([face(20.0, 30.0, score=0.9)], t, WALL0 + t)
            counts[n.node_id] += len([o for o in decide(n, t) if not o.update])
        exchange(*west, *east, now=t)
    assert sum(counts.values()) == 2
    # A fresh drone joins after the heal: the others resend their claims on its join event; it stays quiet.
    late = Dedup("d", cfg, now=20.0)
    for n in west + east:
        n.resend_claims()
    for step in range(100, 200):
        t = step * 0.2
        for n in west + east:
            decide(n, t)
        exchange(*west, *east, late, now=t)
        late.observe([face(20.5, 30.0, score=1.0)], t, WALL0 + t)
        counts["d"] = counts.get("d", 0) + len(decide(late, t))
    assert counts["d"] == 0 and late.stats.suppressed == 1


def test_a_dead_owner_hands_over_when_its_claims_are_forgotten() -> None:
    cfg = DedupConfig(hold_s=1.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(1.0, 1.0, score=0.9)], 0.0, WALL0)
    b.observe([face(1.0, 1.0, score=0.5)], 0.0, WALL0)
    assert a.tick(0.0, WALL0) == [] and b.tick(0.0, WALL0) == []  # holding; their claims go out
    exchange(a, b, now=0.1)
    assert b.tick(1.0, WALL0 + 1.0) == []  # a comes first in the order (same first sighting, then node id)
    b.forget_node("a")  # a died before reporting (the membership's dead event)
    assert [o.owner for o in b.tick(1.1, WALL0 + 1.1)] == ["b"]


def test_a_death_forgets_a_peers_undecided_claims_but_not_what_it_reported() -> None:
    """What a node published stays published: a false death (a starved drone back a second later) must not make
    the drones that still see its object report it again (sar-5 on a loaded machine: 2 duplicates so)."""
    cfg = DedupConfig(hold_s=1.0, window_s=300.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(1.0, 1.0, score=0.9)], 0.0, WALL0)
    a.observe([face(30.0, 1.0, score=0.9)], 0.0, WALL0)  # a second find a will not have reported when it "dies"
    b.observe([face(1.0, 1.0, score=0.5)], 0.5, WALL0 + 0.5)
    for t in (0.0, 0.5):
        a.tick(t, WALL0 + t)
        b.tick(t, WALL0 + t)
    exchange(a, b, now=0.6)
    (obj,) = [o for o in a.tick(1.0, WALL0 + 1.0) if abs(east_north(o)[0] - 1.0) < 1.0]
    a.published(obj.id)
    exchange(a, b, now=1.1)
    assert b.tick(1.6, WALL0 + 1.6) == []  # covered by a's report
    b.forget_node("a")  # the membership declared a dead
    assert [h.reported for h in b.held_claims() if h.node == "a"] == [True]  # its report is remembered ...
    b.observe([face(1.0, 1.0, score=0.5)], 40.0, WALL0 + 40.0)  # ... when b sees the face again later
    assert b.tick(40.0, WALL0 + 40.0) == [] and b.tick(45.0, WALL0 + 45.0) == []


def test_a_silent_leader_is_replaced_after_the_deferral() -> None:
    cfg = DedupConfig(hold_s=0.5, defer_s=3.0, claim_refresh_s=5.0, peer_silence_s=15.0, window_s=60.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(1.0, 1.0, score=0.9)], 0.0, WALL0)
    b.observe([face(1.0, 1.0, score=0.5)], 0.0, WALL0)
    a.tick(0.0, WALL0)
    b.tick(0.0, WALL0)
    exchange(a, b, now=0.0)
    reported = []
    for step in range(1, 200):  # a leads, then falls silent (dead, cut off, or it never reports)
        t = step * 0.1
        if step % 10 == 0:
            b.observe([face(1.0, 1.0, score=0.5)], t, WALL0 + t)
        reported += [(t, o.owner) for o in decide(b, t)]
    # b reports it itself when its hold plus the deferral has passed without a's report, and only once.
    assert [owner for _, owner in reported] == ["b"] and 3.5 <= reported[0][0] < 3.6
    assert b.stats.deferred_reports == 1


def test_a_cover_that_stops_matching_gives_the_decision_back() -> None:
    cfg = DedupConfig(hold_s=1.0, defer_s=2.0, radius_m=3.0, window_s=60.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(0.0, 0.0, sigma=0.3)], 0.0, WALL0)
    assert decide(a, 1.0) != []
    exchange(a, b, now=1.1)
    # b's first fix of another person 4 m away lands 2.5 m from a's report: covered, for now ...
    b.observe([face(2.5, 0.0, sigma=1.5)], 2.0, WALL0 + 2.0)
    assert decide(b, 2.0) == [] and b.stats.suppressed == 1
    reports = []
    for step in range(1, 40):  # ... until its fixes settle at 4 m: then it is decided again, and reported
        t = 2.0 + 0.25 * step
        b.observe([face(4.0, 0.0, sigma=0.3)], t, WALL0 + t)
        reports += [(t, o) for o in decide(b, t)]
    assert b.stats.uncovered == 1 and len(reports) == 1
    t, obj = reports[0]
    # b leads it (a's claim is published, so not in the running): reported at its hold's end or at once after
    assert obj.owner == "b" and east_north(obj)[0] > 3.0
    assert t <= max(2.0 + cfg.hold_s, b._tracks[0].uncovered_at) + 0.25


def test_state_expires_after_the_window() -> None:
    cfg = DedupConfig(window_s=10.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(1.0, 1.0)], 0.0, WALL0)
    a.tick(0.0, WALL0)
    exchange(a, b, now=0.0)
    assert b.claims_held == 1 and a.tracks == 1
    a.tick(10.5, WALL0 + 10.5)
    b.tick(10.5, WALL0 + 10.5)
    assert a.tracks == 0 and b.claims_held == 0 and a.get_timer() is None


def test_claims_are_regossiped_only_when_due() -> None:
    cfg = DedupConfig(claim_min_interval_s=2.0, claim_refresh_s=15.0)
    a = Dedup("a", cfg, now=0.0)
    sent = []
    for step in range(301):  # 30 s at 10 fixes per second of a still object
        t = step * 0.1
        a.observe([face(1.0, 1.0)], t, WALL0 + t)
        a.tick(t, WALL0 + t)
        sent += a.outgoing()
    # New, then reported (same key, replaced while queued: one payload), then refreshes at 15 s and 30 s.
    assert len(sent) == 3
    assert {key for key, _ in sent} == {b"c\x00\x00\x00\x00"}


def test_memory_is_bounded_under_a_flood() -> None:
    cfg = DedupConfig(max_tracks=50, max_claims_per_node=20, max_nodes=10)
    node = Dedup("me", cfg, now=0.0)
    rng = random.Random(3)
    for i in range(5000):
        claim = Claim(f"n{rng.randrange(100)}", rng.randrange(10_000), "face", LAT0_E7 + rng.randrange(-9999, 9999),
                      LON0_E7 + rng.randrange(-9999, 9999), 1000, 3, i, 0, rng.randrange(1000), False)  # fmt: skip
        node.receive(encode_claim(claim), i * 0.001)
    for i in range(2000):
        node.observe([face(rng.uniform(-1e4, 1e4), rng.uniform(-1e4, 1e4))], 5.0 + i * 0.001, WALL0 + i)
    node.tick(8.0, WALL0 + 2000)
    assert node.claims_held <= 10 * 20 and len(node._peers) <= 10
    assert node.tracks <= 50
    assert node.stats.dropped.get("node_cap", 0) + node.stats.dropped.get("claim_cap", 0) + node.claims_held == 5000
    assert node.stats.tracks_evicted == 2000 - 50
    assert len(node.outgoing()) <= 50


def test_timer_names_the_hold_and_the_deferral_deadlines_and_never_the_past() -> None:
    cfg = DedupConfig(hold_s=2.0, defer_s=3.0, claim_refresh_s=15.0, window_s=60.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    b.observe([face(1.0, 1.0, score=0.5)], 0.0, WALL0)
    b.tick(0.0, WALL0)
    assert b.get_timer() == 2.0  # the hold ends
    a.observe([face(1.0, 1.0, score=0.9)], 0.0, WALL0)
    a.tick(0.0, WALL0)
    exchange(a, b, now=0.0)
    assert b.tick(2.0, WALL0 + 2.0) == []  # a comes first: b waits for a's report ...
    assert b.get_timer() == 5.0  # ... until its deferral deadline
    decide(a, 2.0)
    exchange(a, b, now=2.1)
    assert b.tick(2.2, WALL0 + 2.2) == [] and b.stats.suppressed == 1
    assert b.get_timer() == 15.0  # the next refresh, not a deadline already passed


def test_fixes_that_are_not_numbers_are_dropped() -> None:
    node = Dedup("a", now=0.0)
    nan = float("nan")
    node.observe([face(nan, 1.0), obs("face", 1.0, 1.0, 0.5, nan), obs("", 1.0, 1.0, 0.5, 0.5)], 0, 0)
    assert node.tracks == 0 and node.stats.dropped == {"fix_not_finite": 2, "fix_invalid": 1}


def test_hold_ends_without_new_input() -> None:
    node = Dedup("a", DedupConfig(hold_s=1.0), now=0.0)
    node.observe([face(1.0, 1.0)], 0.0, WALL0)
    assert node.tick(0.0, WALL0) == [] and node.tick(0.5, WALL0 + 0.5) == []
    assert node.get_timer() == 1.0
    assert len(node.tick(1.0, WALL0 + 1.0)) == 1  # no fix or claim arrived since: the hold alone decides


def test_memory_of_a_report_outlives_its_owner_while_others_still_see_the_object() -> None:
    cfg = DedupConfig(window_s=60.0, memory_slack_s=30.0, claim_refresh_s=15.0, hold_s=0.0)
    owner, keeper, late = (Dedup(n, cfg, now=0.0) for n in ("a", "b", "c"))
    owner.observe([face(5.0, 5.0)], 0.0, WALL0)
    assert len(decide(owner, 0.0)) == 1
    owner_claims = owner.outgoing()
    for _, payload in owner_claims:
        keeper.receive(payload, 0.0)
        late.receive(payload, 0.0)
    # b sees the object from t=10 to t=50, long after a flew away: suppressed and quiet until its check at
    # t=41 finds it has seen the object more than memory_slack_s past a's claim; then it gossips its claim once.
    sent: list[tuple[float, bytes]] = []
    for step in range(10, 51):
        t = float(step)
        keeper.observe([face(5.2, 5.0)], t, WALL0 + t)
        assert keeper.tick(t, WALL0 + t) == []
        sent += [(t, payload) for _, payload in keeper.outgoing()]
    keeper.tick(54.0, WALL0 + 54.0)  # its track ends 10 s after its own claim: nothing more to say
    assert keeper.outgoing() == []
    assert keeper.stats.suppressed == 1 and [t for t, _ in sent] == [41.0]
    late.receive(sent[0][1], 54.0)
    # c arrives 95 s after a's only sighting but 54 s after b's claim: the same object, already reported.
    late.observe([face(4.8, 5.1)], 95.0, WALL0 + 95.0)
    assert late.tick(95.0, WALL0 + 95.0) == [] and late.stats.suppressed == 1
    # Without b's claim it would have been reported again.
    fresh = Dedup("d", cfg, now=0.0)
    for _, payload in owner_claims:
        fresh.receive(payload, 0.0)
    fresh.observe([face(4.8, 5.1)], 95.0, WALL0 + 95.0)
    assert len(fresh.tick(95.0, WALL0 + 95.0)) == 1


def test_a_holding_newcomer_is_reminded_of_a_report() -> None:
    cfg = DedupConfig(window_s=60.0, hold_s=1.5, peer_silence_s=45.0)
    old, new = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    old.observe([face(5.0, 5.0)], 0.0, WALL0)
    assert old.tick(0.0, WALL0) == [] and len(decide(old, 1.5)) == 1
    old.outgoing()  # that gossip never reached b (b joined later)
    new.observe([face(5.3, 5.0)], 30.0, WALL0 + 30.0)
    assert new.tick(30.0, WALL0 + 30.0) == []  # holding; its claim goes out
    exchange(old, new, now=30.2)
    assert old.stats.reminders == 1
    old.tick(30.3, WALL0 + 30.3)
    exchange(old, new, now=30.5)  # a's reported claim comes back
    assert new.tick(31.5, WALL0 + 31.5) == [] and new.stats.suppressed == 1


ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), st.lists(st.tuples(st.sampled_from(["face", "person"]),
                  st.floats(-1e9, 1e9), st.floats(-50, 50), st.floats(0, 100), st.floats(0, 2)), max_size=4)),
        st.tuples(st.just("receive"), claims_st),
        st.tuples(st.just("garbage"), st.binary(max_size=80)),
        st.tuples(st.just("tick"), st.floats(0, 30)),
    ),
    max_size=60,
)  # fmt: skip


@given(ops_st)
@settings(UNTIMED, max_examples=150)
def test_any_input_sequence_keeps_the_invariants(ops: list) -> None:
    cfg = DedupConfig(max_tracks=8, max_claims_per_node=3, max_nodes=2, hold_s=0.5, window_s=20.0)
    node = Dedup("me", cfg, now=0.0)
    now = 0.0
    reported_tracks: set[int] = set()
    for op, arg in ops:
        now += 0.1
        if op == "observe":
            node.observe([obs(label, e, n, s, sc) for label, e, n, s, sc in arg], now, WALL0 + now)
        elif op == "receive":
            node.receive(encode_claim(arg), now)
        elif op == "garbage":
            node.receive(arg, now)
        else:
            now += arg
        for obj in node.tick(now, WALL0 + now):
            jsonschema.validate(obj.to_payload(), SCHEMA)
            assert obj.owner == "me"
            node.published(obj.id)
        for key, payload in node.outgoing():
            assert len(payload) <= cfg.max_payload_bytes and len(key) == 5
        reported_tracks |= {t.id for t in node._tracks.values() if t.report_id is not None}
        assert node.tracks <= 8 and len(node._peers) <= 2 and all(len(p) <= 3 for p in node._peers.values())
        # Every track past its deferral deadline is decided: reported here, or covered by a published report.
        for t in node._tracks.values():
            assert t.hits < cfg.min_hits or t.decided() or now < node._deadline(t)
    # Every report marks at least one track of this node reported, and a reported track never reports again
    # (a track that left undecided, evicted or expired, is reported on its own).
    assert node.stats.objects_reported <= len(reported_tracks) + node.stats.orphan_reports


def test_config_is_checked() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"^dedup: radius_m must be > 0, got 0"):
        DedupConfig(radius_m=0)
    with pytest.raises(ValueError, match=r"^dedup: hold_s must be >= 0, got -1"):
        DedupConfig(hold_s=-1)
    with pytest.raises(ValueError, match=r"^dedup: peer_silence_s \(20\) must be >= 2 x claim_refresh_s \(15.0\)"):
        DedupConfig(peer_silence_s=20)
    with pytest.raises(ValueError, match=r"^dedup: node id must be 1-64 characters, got 0"):
        Dedup("", now=0.0)


def test_a_track_that_leaves_before_its_decision_is_still_reported() -> None:
    cfg = DedupConfig(hold_s=5.0, window_s=10.0, max_tracks=2)
    node = Dedup("a", cfg, now=0.0)
    node.observe([face(0.0, 0.0), face(30.0, 0.0)], 0.0, WALL0)
    node.observe([face(60.0, 0.0)], 0.5, WALL0 + 0.5)  # the table is full of undecided tracks: the oldest goes ...
    assert node.stats.tracks_evicted == 1
    evicted = node.tick(0.5, WALL0 + 0.5)  # ... and is reported on its own, long before its hold would end
    assert [round(east_north(o)[0]) for o in evicted] == [0] and node.stats.orphan_reports == 1
    # A driver that stalls past the window: the held tracks expire undecided, and are reported all the same.
    late = node.tick(30.0, WALL0 + 30.0)
    assert sorted(round(east_north(o)[0]) for o in late) == [30, 60] and node.tracks == 0
    assert node.stats.objects_reported == 3


def test_eviction_takes_a_decided_track_first() -> None:
    cfg = DedupConfig(hold_s=0.0, max_tracks=2)
    node = Dedup("a", cfg, now=0.0)
    node.observe([face(0.0, 0.0)], 0.0, WALL0)
    assert len(decide(node, 0.0)) == 1
    node.observe([face(30.0, 0.0)], 1.0, WALL0 + 1.0)  # undecided (no tick yet), and more recently seen
    node.observe([face(60.0, 0.0)], 1.1, WALL0 + 1.1)  # full: the reported track goes, not the undecided one
    assert node.stats.tracks_evicted == 1 and node.stats.orphan_reports == 0
    assert sorted(round(east_north(o)[0]) for o in decide(node, 1.2)) == [30, 60]


def test_a_track_never_spans_two_objects() -> None:
    # The demo's radius (2 m): a false "face" and a real one 4 m away were one track under the widened gate
    # (2 + 2 x hypot(1, 1) = 4.8 m), which reported the first and covered the second.
    node = Dedup("a", DedupConfig(radius_m=2.0, hold_s=0.0), now=0.0)
    for step in range(5):
        t = 0.1 * step
        node.observe([face(0.0, 0.0, sigma=1.0)], t, WALL0 + t)
        node.observe([face(4.0, 0.0, sigma=1.0)], t + 0.05, WALL0 + t + 0.05)
    assert node.tracks == 2
    assert sorted(round(east_north(o)[0]) for o in decide(node, 0.5)) == [0, 4]


def test_a_peer_restart_that_reuses_a_track_id_does_not_uncover_what_it_reported() -> None:
    cfg = DedupConfig(hold_s=0.0, window_s=300.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(0.0, 0.0)], 0.0, WALL0)
    assert len(decide(a, 0.0)) == 1
    exchange(a, b, now=0.1)
    b.observe([face(0.2, 0.0)], 1.0, WALL0 + 1.0)
    assert decide(b, 1.0) == [] and b.stats.suppressed == 1
    # a restarts (sar-5 cuts one drone's power) and counts its tracks from 0 again: its new track, elsewhere,
    # replaces the claim b holds under that key. b's track stays covered by what a published before.
    restarted = Dedup("a", cfg, now=50.0)
    restarted.observe([face(80.0, 0.0)], 50.0, WALL0 + 50.0)
    restarted.tick(50.0, WALL0 + 50.0)
    exchange(restarted, b, now=50.1)
    assert [c.first_ms for c in b.held_claims() if c.node == "a"] == [int((WALL0 + 50.0) * 1000)]
    for step in range(10):
        t = 51.0 + step
        b.observe([face(0.2, 0.0)], t, WALL0 + t)
        assert decide(b, t) == []
    assert b.stats.uncovered == 0
    # A driver that may restart numbers its tracks from a new base (edgerun's fleet service: the wall clock in ms).
    fresh = Dedup("a", cfg, now=60.0, first_track=7)
    fresh.observe([face(80.0, 0.0)], 60.0, WALL0 + 60.0)
    assert [c.track for c in fresh.held_claims()] == [7]


def test_what_a_dead_node_published_stays_published() -> None:
    # sar-5: a drone reported a face 2 s before the partition; across the cut it was declared dead, and a drone
    # of the other side that found the face 5 s later reported it again: forgetting a node forgot its reports.
    cfg = DedupConfig(hold_s=1.0, window_s=300.0)
    a, b = Dedup("a", cfg, now=0.0), Dedup("b", cfg, now=0.0)
    a.observe([face(0.0, 0.0)], 0.0, WALL0)
    a.observe([face(30.0, 0.0)], 0.5, WALL0 + 0.5)  # held: not reported yet when a is cut off
    assert len(decide(a, 1.0)) == 1
    exchange(a, b, now=1.1)
    b.forget_node("a")  # the membership declares a dead
    assert [c.track for c in b.held_claims()] == [0]  # its report stays, its undecided claim goes
    b.observe([face(0.3, 0.0), face(30.0, 0.2)], 5.0, WALL0 + 5.0)
    reported = decide(b, 6.0)
    assert [round(east_north(o)[0]) for o in reported] == [30] and b.stats.suppressed == 1

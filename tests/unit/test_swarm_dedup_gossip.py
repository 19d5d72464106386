"""Dedup over real gossip: Membership on the in-memory network, a partition, its heal and a late joiner."""

from __future__ import annotations

import random

from swarm.config import SwarmTiming
from swarm.dedup import Dedup, DedupConfig, FleetObject, Observation
from swarm.membership import MemberEvent, Membership, UserBroadcast
from swarm.memnet import MemNet

WALL0 = 1_795_000_000.0
TARGET = (53.1174521, -4.1292514, 100.0)  # lat, lon, ground AMSL m
PORT = 7946


class Drone:
    """The node's driver in miniature: every gossip interval, fixes in, tick, claims out (like edgerun.fleet)."""

    def __init__(self, net: MemNet, index: int, seeds: list[tuple[str, int]], cfg: DedupConfig, now: float) -> None:
        self.name = f"n{index}"
        self.membership = Membership(self.name, (f"10.0.0.{index + 1}", PORT), SwarmTiming(), now=now,
                                     rng=random.Random(index))  # fmt: skip
        if seeds:
            self.membership.join(seeds, now)
        self.host = net.add(self.membership)
        self.dedup = Dedup(self.name, cfg, now=now)
        self.sees: list[tuple[float, float]] = []  # intervals of virtual time when the object is in view
        self.reports: list[tuple[float, FleetObject]] = []
        self.net = net
        net.input(self.host, now, self.step)

    def step(self, now: float) -> None:
        if any(a <= now < b for a, b in self.sees):
            score = 0.6 + 0.05 * int(self.name[1:])
            self.dedup.observe([Observation("person", *TARGET, 0.8, score)], now, WALL0 + now)
        for obj in self.dedup.tick(now, WALL0 + now):
            if not obj.update:
                self.reports.append((now, obj))
            self.dedup.published(obj.id)  # the sink took it
        for key, payload in self.dedup.outgoing():
            self.membership.queue_broadcast(key, payload)
        self.net.input(self.host, now + 0.2, self.step)

    def on_event(self, now: float, event: MemberEvent | UserBroadcast) -> None:
        if isinstance(event, UserBroadcast):
            self.dedup.receive(event.payload, now)
        elif event.kind in ("join", "alive"):
            self.dedup.resend_claims()  # a newcomer or a healed side has not heard our older claims
        elif event.kind in ("dead", "leave"):
            self.dedup.forget_node(event.member.name)


def test_partition_each_side_reports_once_and_nothing_again_after_the_heal() -> None:
    net = MemNet(seed=3, loss=0.05)
    cfg = DedupConfig(hold_s=1.5, window_s=60.0)
    drones: dict[tuple[str, int], Drone] = {}
    first = Drone(net, 0, [], cfg, 0.0)
    drones[first.membership.addr] = first
    for i in range(1, 4):
        d = Drone(net, i, [first.membership.addr], cfg, 0.0)
        drones[d.membership.addr] = d
    net.on_event = lambda addr, now, event: drones[addr].on_event(now, event) if addr in drones else None
    for d in drones.values():
        d.sees = [(19.8 if d.name in ("n1", "n3") else 20.0, 100.0)]  # n1 and n3 find it first
    net.run_until(10.0)
    assert all(len(d.membership.members()) == 4 for d in drones.values())
    west, east = [(f"10.0.0.{i + 1}", PORT) for i in (0, 1)], [(f"10.0.0.{i + 1}", PORT) for i in (2, 3)]
    net.partition(west, east)
    net.run_until(60.0)
    during = [(d.name, t) for d in drones.values() for t, _ in d.reports]
    assert sorted(name for name, _ in during) == ["n1", "n3"]  # each side's first claim reports, once
    assert all(21.3 <= t <= 22.0 for _, t in during)  # after the 1.5 s hold
    net.heal()
    net.run_until(90.0)
    late = Drone(net, 4, [first.membership.addr], cfg, 90.0)
    drones[late.membership.addr] = late
    late.sees = [(95.0, 110.0)]
    net.run_until(120.0)
    after = [(d.name, t) for d in drones.values() for t, _ in d.reports if t > 60.0]
    assert after == []
    assert late.dedup.stats.suppressed == 1 and late.dedup.claims_held >= 2
    # The healed claims know both reports: every node now holds the other side's reported claim.
    for d in drones.values():
        if d is not late:
            held = {c.node for c in d.dedup.held_claims() if c.reported}
            assert {"n1", "n3"} <= held, (d.name, held)

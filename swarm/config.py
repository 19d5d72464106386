"""Timing of the gossip protocol; the defaults are memberlist's ``DefaultLANConfig``.

memberlist (config.go, ``DefaultLANConfig``): ProbeInterval 1 s, ProbeTimeout 500 ms, IndirectChecks 3,
SuspicionMult 4, SuspicionMaxTimeoutMult 6, RetransmitMult 4, GossipInterval 200 ms, GossipNodes 3,
GossipToTheDeadTime 30 s, PushPullInterval 30 s, AwarenessMaxMultiplier 8, DeadNodeReclaimTime 0,
TCPTimeout 10 s, UDPBufferSize 1400. The two fields memberlist has no twin for are marked below, and the probe
runs twice as often: ProbeInterval 0.5 s, ProbeTimeout 0.25 s (why: beside the fields).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SwarmTiming:
    """How often members probe and gossip, and how long they wait before declaring a peer dead."""

    # memberlist: 1 s and 0.5 s. The first probe of a dead member comes after an exponential wait of mean one
    # interval, then the probe and suspicion_mult * log10(N) intervals of suspicion; at 1 s a member killed in a
    # 20-node swarm is dead to all in 4.8-8.3 s (sim, 20 seeds; at suspicion_mult 4 never under 6.2 s), at 0.5 s
    # in 3.1-4.9 s, with no false death in 300 s, also with CPU-starved members (docs/swarm.md).
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.25
    indirect_checks: int = 3
    suspicion_mult: int = 4
    suspicion_max_timeout_mult: int = 6
    retransmit_mult: int = 4
    gossip_interval_s: float = 0.2
    gossip_nodes: int = 3
    gossip_to_the_dead_s: float = 30.0
    push_pull_interval_s: float = 30.0
    awareness_max_multiplier: int = 8
    dead_node_reclaim_s: float = 0.0
    tcp_timeout_s: float = 10.0
    max_packet_bytes: int = 1400
    # Not in memberlist (its Join does not retry; serf's retry_join waits 30 s): how often join() asks the seeds again.
    join_retry_s: float = 2.0
    # Not in memberlist: how long app broadcasts stay in the anti-entropy store that push-pull exchanges.
    broadcast_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"swarm timing {field.name}: expected a number, got {value!r}")
            may_be_zero = field.name in _MAY_BE_ZERO
            if value < 0 or (value == 0 and not may_be_zero):
                raise ValueError(f"swarm timing {field.name}: must be {'>= 0' if may_be_zero else '> 0'}")
        if self.probe_timeout_s > self.probe_interval_s:
            raise ValueError("swarm timing probe_timeout_s: must not exceed probe_interval_s")
        if not 256 <= self.max_packet_bytes <= 65507:
            raise ValueError("swarm timing max_packet_bytes: must be within 256..65507")


_MAY_BE_ZERO = frozenset({"dead_node_reclaim_s", "indirect_checks", "push_pull_interval_s", "broadcast_ttl_s"})

"""An in-memory network on a virtual clock that drives many :class:`Membership` instances.

Datagrams are lost with a given probability and arrive after a latency plus uniform jitter; streams (TCP) are
reliable but fail when the peer is dead (refused at once) or on the other side of a partition (after the
TCP timeout). A CPU-starved host runs in bursts: between bursts it stalls, and every packet, stream and timer
meant for it waits until the stall ends, so its timers fire late and its acks go out late.

Single-threaded and deterministic for a given seed: tests and ``swarm.sim`` run minutes of swarm time in
seconds. This is the test double for the network (loss, partitions and starvation are injected faults); the
protocol code it drives is the production code.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.membership import MemberEvent, Membership, UserBroadcast

Addr = tuple[str, int]

# Same-time ordering: packets and stream replies before timers, as asyncio runs I/O callbacks before due timers.
_IO = 0
_TIMER = 1


@dataclass
class Starvation:
    """Run for ``run_s`` (uniform range), then stall for ``stall_s`` (uniform range), repeatedly."""

    run_s: tuple[float, float] = (0.3, 1.5)
    stall_s: tuple[float, float] = (0.2, 1.5)


@dataclass
class Host:
    membership: Membership
    alive: bool = True
    timer_version: int = 0
    timer_at: float | None = None
    events: list[tuple[float, MemberEvent | UserBroadcast]] = field(default_factory=list)
    starvation: Starvation | None = None
    stall_start: float = 0.0
    stall_end: float = 0.0
    datagrams_in: int = 0


class MemNet:
    """The network and the clock; ``add`` members, then ``run_until`` a virtual time."""

    def __init__(
        self,
        *,
        seed: int = 0,
        loss: float = 0.0,
        latency_s: float = 0.001,
        jitter_s: float = 0.002,
        tcp_timeout_s: float = 10.0,
    ) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be within [0, 1), got {loss}")
        self.now = 0.0
        self.loss = loss
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.tcp_timeout_s = tcp_timeout_s
        self.rng = random.Random(seed)
        self.hosts: dict[Addr, Host] = {}
        self.group: dict[Addr, int] = {}
        self.blocked: set[tuple[Addr, Addr, str]] = set()
        self.link_latency_s: dict[frozenset[Addr], float] = {}
        self.lost = 0
        self.cut = 0
        self.delivered = 0
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = 0
        self.on_event: Callable[[Addr, float, MemberEvent | UserBroadcast], None] | None = None

    # ------------------------------------------------------------------ set-up and faults

    def add(self, membership: Membership, *, starvation: Starvation | None = None) -> Host:
        """Attach a member at its address (replacing a dead one there: a restart)."""
        host = Host(membership, starvation=starvation)
        self.hosts[membership.addr] = host
        self._after_input(host)
        return host

    def kill(self, addr: Addr) -> None:
        """The process dies without a word: nothing it queued goes out, nothing reaches it."""
        self.hosts[addr].alive = False

    def partition(self, *groups: list[Addr]) -> None:
        """Split the network: members in different groups cannot reach each other (unlisted: group 0)."""
        self.group = {addr: index + 1 for index, members in enumerate(groups) for addr in members}

    def heal(self) -> None:
        self.group = {}

    def starve(self, addr: Addr, starvation: Starvation | None = None) -> None:
        self.hosts[addr].starvation = starvation or Starvation()

    def block(self, a: Addr, b: Addr, *, udp: bool = True, tcp: bool = False) -> None:
        """Cut one link both ways (datagrams and/or streams), as a firewall rule between two hosts would."""
        for kind, on in (("udp", udp), ("tcp", tcp)):
            if on:
                self.blocked |= {(a, b, kind), (b, a, kind)}

    def set_link_latency(self, a: Addr, b: Addr, latency_s: float) -> None:
        """One link's one-way latency (both ways) instead of the network's; jitter still adds to it."""
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        self.link_latency_s[frozenset((a, b))] = latency_s

    def reachable(self, a: Addr, b: Addr, kind: str = "udp") -> bool:
        if self.blocked and (a, b, kind) in self.blocked:
            return False
        return self.group.get(a, 0) == self.group.get(b, 0)

    # ------------------------------------------------------------------ running

    def call_at(self, when: float, fn: Callable[[], None], priority: int = _IO) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), priority, self._seq, fn))

    def run_until(self, until: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, _, fn = heapq.heappop(heap)
            self.now = when
            fn()
        self.now = max(self.now, until)

    def input(
        self,
        host: Host,
        when: float,
        apply: Callable[[float], None],
        priority: int = _IO,
        on_dead: Callable[[], None] | None = None,
    ) -> None:
        """Run ``apply(now)`` on a host at ``when``, or when its stall ends if it is starved then."""

        def run() -> None:
            if not host.alive or self.hosts.get(host.membership.addr) is not host:
                if on_dead is not None:
                    on_dead()
                return
            resume = self._stalled_until(host, self.now)
            if resume is not None:
                self.call_at(resume, run, priority)
                return
            apply(self.now)
            self._after_input(host)

        self.call_at(when, run, priority)

    def _stalled_until(self, host: Host, now: float) -> float | None:
        starvation = host.starvation
        if starvation is None:
            return None
        while now >= host.stall_end:
            host.stall_start = host.stall_end + self.rng.uniform(*starvation.run_s)
            host.stall_end = host.stall_start + self.rng.uniform(*starvation.stall_s)
        return host.stall_end if now >= host.stall_start else None

    def _after_input(self, host: Host) -> None:
        membership = host.membership
        src = membership.addr
        for dst, data in membership.datagrams_to_send():
            self._send_datagram(src, dst, data)
        for token, dst, request in membership.streams_to_open():
            self._open_stream(host, token, dst, request)
        for event in membership.pop_events():
            host.events.append((self.now, event))
            if self.on_event is not None:
                self.on_event(src, self.now, event)
        when = membership.get_timer()
        if when != host.timer_at:
            host.timer_at = when
            host.timer_version += 1
            if when is not None:
                version = host.timer_version

                def fire(now: float, version: int = version) -> None:
                    if host.timer_version == version:
                        host.timer_at = None
                        membership.handle_timer(now)

                self.input(host, when, fire, _TIMER)

    def _delay(self, src: Addr, dst: Addr) -> float:
        latency = (
            self.link_latency_s.get(frozenset((src, dst)), self.latency_s) if self.link_latency_s else self.latency_s
        )
        return latency + self.rng.uniform(0.0, self.jitter_s)

    def _send_datagram(self, src: Addr, dst: Addr, data: bytes) -> None:
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return
        if not self.reachable(src, dst, "udp"):
            self.cut += 1
            return
        target = self.hosts.get(dst)
        if target is None:
            return
        self.delivered += 1
        target.datagrams_in += 1
        self.input(
            target, self.now + self._delay(src, dst), lambda now: target.membership.receive_datagram(data, src, now)
        )

    def _open_stream(self, host: Host, token: int, dst: Addr, request: bytes) -> None:
        src = host.membership.addr

        def fail_at(when: float) -> None:
            self.input(host, when, lambda now: host.membership.stream_result(token, None, now))

        if not self.reachable(src, dst, "tcp"):
            fail_at(self.now + self.tcp_timeout_s)
            return
        target = self.hosts.get(dst)
        if target is None or not target.alive:
            fail_at(self.now + 2 * self._delay(src, dst))  # connection refused
            return

        def serve(now: float) -> None:
            reply = target.membership.handle_stream(request, src, now)
            if reply is None or not self.reachable(src, dst, "tcp"):
                fail_at(now + self._delay(src, dst))
                return
            self.input(
                host, now + self._delay(src, dst), lambda later: host.membership.stream_result(token, reply, later)
            )

        # the connect handshake, then the request; a peer that died meanwhile resets the connection
        self.input(
            target,
            self.now + 2 * self._delay(src, dst),
            serve,
            on_dead=lambda: fail_at(self.now + self._delay(src, dst)),
        )

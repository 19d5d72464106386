"""SWIM membership with the Lifeguard extensions, the way HashiCorp memberlist does it; sans-I/O.

The driver (``swarm.agent`` over asyncio, ``swarm.memnet`` in simulation and tests) feeds inputs with the
time (``receive_datagram``, ``handle_stream``, ``stream_result``, ``handle_timer``) and, after every input,
drains the outputs (``datagrams_to_send``, ``streams_to_open``, ``pop_events``, ``get_timer``). Nothing here
touches a socket or a clock.

What it does, after memberlist (state.go, suspicion.go, awareness.go, queue.go) and the Lifeguard paper:

* one probe per (health-scaled) probe interval to the next member of a shuffled round-robin list; no ack
  within half of ``probe_timeout_s`` -> the ping once more (not in memberlist); none within ``probe_timeout_s``
  -> indirect pings through ``indirect_checks`` peers (who nack if the target stays silent) and a ping over a
  stream (the TCP fallback); no ack by the end of the interval -> suspect;
* suspicion starts at its maximum timeout and shrinks as independent members confirm it
  (``max - log(n+1)/log(k+1) * (max - min)``, never below ``min``), k = suspicion_mult - 2; a suspicion of a
  newer incarnation replaces an older one (memberlist counts it as a confirmation);
* incarnation numbers: a member told it is suspect or dead refutes with a higher incarnation; the suspect is
  told by every member that suspects it, once per probe interval, and answers each teller (and anyone that
  sends it a suspicion of an incarnation it already refuted) with its Alive directly (not in memberlist: a
  member that missed the refutation gossip would otherwise declare it dead);
* local health (Lifeguard's awareness): missed nacks, failed probes, refutations and late timers raise the
  score, each successful probe lowers it; the score stretches this member's probe interval;
* updates piggyback on every packet, each sent ``retransmit_mult * ceil(log10(N+1))`` times, least-sent first,
  a newer update about a member replacing the queued older one (memberlist's TransmitLimitedQueue);
* periodic push-pull of the full state over a stream repairs what gossip lost (and heals partitions);
* quiet metadata updates (not in memberlist): ``set_meta(..., broadcast=False)`` takes a new incarnation
  without gossiping it; push-pull carries it, and a member that learns it there (alive, same address, other
  metadata) does not re-gossip it either. An accusation of an incarnation at or above the last one we gossiped
  but below our current (others may know no newer) is refuted on the gossip;
* app broadcasts (``queue_broadcast``) spread epidemically: every member delivers a (sender, key) payload
  once per newer ``seq`` and re-gossips it; a member's own recent ones also ride on its push-pulls;
* members declared dead are tried with a push-pull once per push-pull interval (serf's reconnect), which is
  what joins two halves again after a partition long enough for both to forget each other;
* the round trip of every answered direct probe feeds a per-member EWMA (``rtt_ms``), what an offloading node
  picks a helper by.

Interface changes since the skeleton commit: none but keyword-only extras (``packet_budget``, and
``set_meta``'s ``broadcast``).
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from swarm.broadcast_queue import BroadcastQueue, retransmit_limit
from swarm.config import SwarmTiming
from swarm.messages import (
    MAX_KEY_BYTES,
    MAX_MESSAGES_PER_PACKET,
    MAX_META_BYTES,
    MAX_PUSH_BROADCASTS,
    MAX_PUSH_MEMBERS,
    MAX_USER_PAYLOAD_BYTES,
    Ack,
    Alive,
    Dead,
    IndirectPing,
    Message,
    Nack,
    Ping,
    PushMember,
    PushPull,
    Suspect,
    UserMsg,
    WireError,
    decode_packet,
    decode_stream,
    encode_message,
    encode_packet,
    encode_stream,
    packet_overhead,
)
from swarm.suspicion import Suspicion, suspicion_timeout

__all__ = ["DEFAULT_PACKET_BUDGET", "Member", "MemberEvent", "MemberState", "Membership", "UserBroadcast"]

log = logging.getLogger(__name__)

DEFAULT_PACKET_BUDGET = 1400 - 64
MAX_MEMBERS = MAX_PUSH_MEMBERS
MAX_RELAYS = 1024
MAX_STORED_USER_MSGS = 4096
MAX_FAILED_REMEMBERED = 1024
# serf's reconnect_timeout: how long a failed member is still tried, in case a partition separates us.
RECONNECT_FOR_S = 24 * 3600.0
# A timer handled this much after its deadline (or more) means this member is starved of CPU.
LATE_TIMER_FRACTION = 0.5
# Weight of a new round-trip sample (TCP's SRTT uses 1/8; a fifth follows a moving drone a little faster).
RTT_ALPHA = 0.2


class MemberState(Enum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass
class Member:
    name: str
    addr: tuple[str, int]
    state: MemberState
    incarnation: int
    meta: bytes
    state_since: float


@dataclass
class MemberEvent:
    kind: str  # "join" | "update" | "suspect" | "alive" | "dead" | "leave" | "refute"
    member: Member


@dataclass
class UserBroadcast:
    payload: bytes
    sender: str


def push_pull_scale(interval_s: float, n: int) -> float:
    """Slower push-pull above 32 members so the total stream load stays flat (memberlist util.go)."""
    if n <= 32:
        return interval_s
    return interval_s * (math.ceil(math.log2(n) - math.log2(32)) + 1)


@dataclass
class _Probe:
    seq: int
    target: str
    ack_deadline: float
    end: float
    interval: float
    indirect: bool = False
    expected_nacks: int = 0
    nacks: int = 0
    tcp_token: int | None = None
    tcp_ok: bool = False
    resend_at: float | None = None
    sent_at: float = 0.0


@dataclass
class _Relay:
    """An indirect ping this member carries out for a requester."""

    requester_seq: int
    requester: tuple[str, int]
    nack: bool
    deadline: float


@dataclass
class _StoredUserMsg:
    msg: UserMsg
    stored_at: float


@dataclass
class _Stream:
    kind: str  # "push_pull" | "join" | "ping"
    seq: int = 0
    attempt: int = 0


class Membership:
    """One member's view of the swarm; see the module docstring."""

    def __init__(
        self,
        name: str,
        addr: tuple[str, int],
        timing: SwarmTiming,
        *,
        now: float,
        meta: bytes = b"",
        rng: random.Random | None = None,
        packet_budget: int = DEFAULT_PACKET_BUDGET,
    ) -> None:
        if not name or len(name) > 128:
            raise ValueError(f"member name must be 1..128 characters, got {len(name)}")
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"member metadata is {len(meta)} bytes, at most {MAX_META_BYTES} fit")
        self.local_name = name
        self.addr = (addr[0], int(addr[1]))
        self.timing = timing
        self.incarnation = 1
        self.health_score = 0
        self._rng = rng or random.Random()
        self._budget = min(packet_budget, timing.max_packet_bytes)
        if self._budget < 256:
            raise ValueError(f"packet budget {self._budget} bytes is too small (at least 256)")
        self._now = now
        self._nodes: dict[str, Member] = {name: Member(name, self.addr, MemberState.ALIVE, 1, bytes(meta), now)}
        self._probe_list: list[str] = []
        self._probe_index = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._suspicions: dict[str, Suspicion] = {}
        self._seq = 0
        self._token = 0
        self._streams: dict[int, _Stream] = {}
        self._updates = BroadcastQueue()
        self._user_queue = BroadcastQueue()
        self._user_store: dict[tuple[str, bytes], _StoredUserMsg] = {}
        self._user_seq = 0
        self._failed: dict[str, tuple[tuple[str, int], float]] = {}
        # The newest incarnation of ours that went out as gossip: above it, others may hold an older one (the
        # quiet updates since spread only by push-pull), so an accusation of that older one must be refuted.
        self._gossiped_incarnation = 1
        # Direct probes, not serf's Vivaldi coordinates: every member is probed directly in round-robin, so we
        # hold a real sample of each neighbour within one probe cycle; coordinates pay off when a node must
        # estimate pairs it never measures, which choosing a helper never needs (it only asks "me to you").
        self._rtt_ms: dict[str, float] = {}
        self._leaving = False
        self._join_seeds: list[tuple[str, int]] = []
        self._join_attempt = 0
        self._join_pending = 0
        self._join_retry_at: float | None = None
        self._joined = False
        self._out_datagrams: list[tuple[tuple[str, int], bytes]] = []
        self._out_streams: list[tuple[int, tuple[str, int], bytes]] = []
        self._events: list[MemberEvent | UserBroadcast] = []
        stagger = self._rng.random()
        self._next_probe = now + stagger * timing.probe_interval_s
        self._next_gossip = now + stagger * timing.gossip_interval_s
        self._next_push_pull = (
            now + timing.push_pull_interval_s * (0.5 + stagger) if timing.push_pull_interval_s > 0 else None
        )
        self.stats: dict[str, Any] = {
            "dropped": Counter(),
            "sent_bytes": 0,
            "received_bytes": 0,
            "sent_packets": 0,
            "received_packets": 0,
            "stream_sent_bytes": 0,
            "stream_received_bytes": 0,
            "probes": 0,
            "probe_resends": 0,
            "probe_failures": 0,
            "indirect_probes": 0,
            "tcp_fallback_probes": 0,
            "tcp_fallback_rescues": 0,
            "suspicions": 0,
            "suspect_tells": 0,
            "refutations": 0,
            "deaths": 0,
            "push_pulls": 0,
            "reconnects": 0,
            "late_timers": 0,
            "rtt_samples": 0,
            "user_delivered": 0,
            "user_duplicates": 0,
            "broadcasts_pruned": 0,
            "quiet_updates": 0,
            "quiet_merges": 0,
        }
        self._queue_alive_self()

    # ------------------------------------------------------------------ inputs

    def join(self, seeds: list[tuple[str, int]], now: float) -> None:
        """Push-pull with every seed; retried every ``join_retry_s`` until one answers."""
        self._now = now
        self._join_seeds = [(h, int(p)) for h, p in seeds if (h, int(p)) != self.addr]
        self._joined = False
        self._start_join_attempt()

    def leave(self, now: float) -> None:
        """Graceful leave: gossip LEFT about ourselves; probing and push-pull stop."""
        self._now = now
        if self._leaving:
            return
        self._leaving = True
        self._probe = None
        me = self._nodes[self.local_name]
        self._dead(Dead(name=self.local_name, incarnation=me.incarnation, source=self.local_name), now)

    def set_meta(self, meta: bytes, now: float, *, broadcast: bool = True) -> None:
        """New metadata for this member under a new incarnation.

        ``broadcast``: gossiped epidemically (every member retransmits it, ~1.3 KB swarm-wide per member at 20
        members); False: a quiet update, stored and handed on by push-pull anti-entropy only (every member's
        state rides in each push-pull anyway, so it costs no extra datagram), for what may be minutes old.
        """
        self._now = now
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"member metadata is {len(meta)} bytes, at most {MAX_META_BYTES} fit")
        me = self._nodes[self.local_name]
        if me.meta == meta:
            return
        self.incarnation += 1
        me.incarnation = self.incarnation
        me.meta = bytes(meta)
        if broadcast:
            self._queue_alive_self()
        else:
            self.stats["quiet_updates"] += 1
        self._emit("update", me)

    def queue_broadcast(self, key: bytes, payload: bytes) -> None:
        """Gossip an app payload to every member; a newer payload under the same key replaces a queued one."""
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"broadcast key is {len(key)} bytes, at most {MAX_KEY_BYTES}")
        if len(payload) > MAX_USER_PAYLOAD_BYTES:
            raise ValueError(f"broadcast payload is {len(payload)} bytes, at most {MAX_USER_PAYLOAD_BYTES}")
        self._user_seq += 1
        msg = UserMsg(sender=self.local_name, key=bytes(key), seq=self._user_seq, payload=bytes(payload))
        data = encode_message(msg)
        if len(data) + packet_overhead(MAX_MESSAGES_PER_PACKET) > self._budget:
            raise ValueError(f"broadcast of {len(data)} bytes does not fit the {self._budget}-byte packet budget")
        self._store_user(msg, self._now)
        self._user_queue.queue((self.local_name, msg.key), data)

    def receive_datagram(self, data: bytes, addr: tuple[str, int], now: float) -> None:
        """One plaintext packet from a peer; bad bytes are dropped and counted, never raised."""
        self._now = now
        self.stats["received_bytes"] += len(data)
        self.stats["received_packets"] += 1
        if len(data) > self.timing.max_packet_bytes:
            self.stats["dropped"]["oversized"] += 1
            return
        try:
            messages = decode_packet(data)
        except WireError as exc:
            self.stats["dropped"][exc.reason] += 1
            return
        for message in messages:
            try:
                self._handle_message(message, addr, now)
            except Exception:  # a bug must not take the loop down; it is counted and logged
                self.stats["dropped"]["internal"] += 1
                log.exception("swarm: handling %s from %s failed", type(message).__name__, addr)

    def handle_stream(self, data: bytes, addr: tuple[str, int], now: float) -> bytes | None:
        """A stream request from a peer (push-pull or fallback ping) -> the reply, or None to close."""
        self._now = now
        self.stats["stream_received_bytes"] += len(data)
        try:
            message = decode_stream(data)
        except WireError as exc:
            self.stats["dropped"][exc.reason] += 1
            return None
        try:
            if isinstance(message, Ping):
                if message.target != self.local_name:
                    self.stats["dropped"]["wrong_target"] += 1
                    return None
                return self._stream_reply(encode_stream(Ack(seq=message.seq)))
            if isinstance(message, PushPull):
                reply = encode_stream(self._local_state(join=False))
                self._merge_remote_state(message, now)
                return self._stream_reply(reply)
        except Exception:
            self.stats["dropped"]["internal"] += 1
            log.exception("swarm: stream request from %s failed", addr)
            return None
        self.stats["dropped"]["unexpected"] += 1
        return None

    def stream_result(self, token: int, reply: bytes | None, now: float) -> None:
        """The reply to a stream this member opened (None: connect, send or read failed or timed out)."""
        self._now = now
        stream = self._streams.pop(token, None)
        if stream is None:
            return
        message: Ping | Ack | PushPull | None = None
        if reply is not None:
            self.stats["stream_received_bytes"] += len(reply)
            try:
                message = decode_stream(reply)
            except WireError as exc:
                self.stats["dropped"][exc.reason] += 1
        try:
            if stream.kind == "ping":
                probe = self._probe
                if isinstance(message, Ack) and message.seq == stream.seq and probe and probe.seq == stream.seq:
                    probe.tcp_ok = True
                return
            if isinstance(message, PushPull):
                self._merge_remote_state(message, now)
                if stream.kind == "join":
                    self._joined = True
                    self._join_retry_at = None
                return
            if stream.kind == "join" and stream.attempt == self._join_attempt:
                self._join_pending -= 1
                if self._join_pending <= 0 and not self._joined:
                    self._join_retry_at = now + self.timing.join_retry_s
        except Exception:
            self.stats["dropped"]["internal"] += 1
            log.exception("swarm: stream reply handling failed")

    def handle_timer(self, now: float) -> None:
        """Run everything that is due at ``now``; call it at (or after) ``get_timer()``. Never raises."""
        self._now = now
        try:
            self._run_due(now)
        except Exception:  # a bug must not stop the driver's timer: counted, logged, and the next tick runs
            self.stats["dropped"]["internal"] += 1
            log.exception("swarm: timer handling failed")
            self._next_probe = max(self._next_probe, now + self.timing.probe_interval_s)
            self._next_gossip = max(self._next_gossip, now + self.timing.gossip_interval_s)

    def _run_due(self, now: float) -> None:
        due = self.get_timer()
        if due is not None and now - due >= LATE_TIMER_FRACTION * self.timing.probe_timeout_s:
            self.stats["late_timers"] += 1
            self._apply_health(1)
        self._relay_timeouts(now)
        self._probe_stages(now)
        self._suspicion_timeouts(now)
        if now >= self._next_probe:
            interval = self._scaled(self.timing.probe_interval_s)
            self._next_probe = max(self._next_probe + interval, now + interval * 0.5)
            if not self._leaving:
                self._probe_next(now, interval)
        if now >= self._next_gossip:
            self._next_gossip += self.timing.gossip_interval_s
            if self._next_gossip <= now:  # skip missed ticks, like a Go ticker
                self._next_gossip = now + self.timing.gossip_interval_s
            self._gossip(now)
        if self._next_push_pull is not None and now >= self._next_push_pull:
            n = len(self._nodes)
            self._next_push_pull = now + push_pull_scale(self.timing.push_pull_interval_s, n)
            if not self._leaving:
                self._push_pull(now)
                self._reconnect(now)
        if self._join_retry_at is not None and now >= self._join_retry_at:
            self._join_retry_at = None
            if not self._joined and not self._has_live_peer():
                self._start_join_attempt()

    # ------------------------------------------------------------------ outputs

    def datagrams_to_send(self) -> list[tuple[tuple[str, int], bytes]]:
        out, self._out_datagrams = self._out_datagrams, []
        return out

    def streams_to_open(self) -> list[tuple[int, tuple[str, int], bytes]]:
        out, self._out_streams = self._out_streams, []
        return out

    def get_timer(self) -> float | None:
        deadlines = [self._next_probe, self._next_gossip]
        if self._next_push_pull is not None:
            deadlines.append(self._next_push_pull)
        if self._join_retry_at is not None:
            deadlines.append(self._join_retry_at)
        probe = self._probe
        if probe is not None:
            deadlines.append(probe.end if probe.indirect else probe.ack_deadline)
            if probe.resend_at is not None:
                deadlines.append(probe.resend_at)
        if self._relays:
            deadlines.append(min(r.deadline for r in self._relays.values()))
        if self._suspicions:
            deadlines.append(min(min(s.deadline, s.tell_at) for s in self._suspicions.values()))
        return min(deadlines)

    def pop_events(self) -> list[MemberEvent | UserBroadcast]:
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ state

    def members(self) -> list[Member]:
        return [replace(m) for m in self._nodes.values()]

    def member(self, name: str) -> Member | None:
        found = self._nodes.get(name)
        return None if found is None else replace(found)

    def rtt_ms(self, name: str) -> float | None:
        """The smoothed round trip to a live member in milliseconds (EWMA of direct probes), None until one answered."""
        return self._rtt_ms.get(name)

    @property
    def queued_broadcasts(self) -> int:
        return len(self._updates) + len(self._user_queue)

    # ------------------------------------------------------------------ message handling

    def _handle_message(self, message: Message, addr: tuple[str, int], now: float) -> None:
        if isinstance(message, Ping):
            if message.target != self.local_name:
                self.stats["dropped"]["wrong_target"] += 1
                return
            self._send(addr, [encode_message(Ack(seq=message.seq))])
        elif isinstance(message, Ack):
            self._on_ack(message.seq, now)
        elif isinstance(message, Nack):
            probe = self._probe
            if probe is not None and probe.seq == message.seq and probe.indirect:
                probe.nacks += 1
        elif isinstance(message, IndirectPing):
            self._on_indirect_ping(message, addr, now)
        elif isinstance(message, Alive):
            self._alive(message, now)
        elif isinstance(message, Suspect):
            self._suspect(message, now, reply_to=addr)
        elif isinstance(message, Dead):
            self._dead(message, now)
        elif isinstance(message, UserMsg):
            self._on_user_msg(message, now, regossip=True)

    def _on_ack(self, seq: int, now: float) -> None:
        probe = self._probe
        if probe is not None and probe.seq == seq:
            # An ack that was queued behind a late timer still counts: the target answered.
            self._probe = None
            self._apply_health(-1)
            # A sample only from a ping sent once (Karn's rule: after the resend we cannot tell which ping this
            # acks) and before the indirect stage: a relay's ack carries our seq too but times two legs and the
            # relay's turn-around, not our link. The TCP fallback's ack never comes here (stream_result); it
            # would time a connect handshake and a task switch on top of the path.
            if probe.resend_at is not None and not probe.indirect:
                self._rtt_sample(probe.target, (now - probe.sent_at) * 1000.0)
            return
        relay = self._relays.pop(seq, None)
        if relay is not None:
            self._send(relay.requester, [encode_message(Ack(seq=relay.requester_seq))])

    def _rtt_sample(self, name: str, sample_ms: float) -> None:
        if name not in self._nodes or sample_ms < 0.0:
            return
        self.stats["rtt_samples"] += 1
        old = self._rtt_ms.get(name)
        self._rtt_ms[name] = sample_ms if old is None else old + RTT_ALPHA * (sample_ms - old)

    def _on_indirect_ping(self, message: IndirectPing, addr: tuple[str, int], now: float) -> None:
        if len(self._relays) >= MAX_RELAYS:
            self.stats["dropped"]["relay_cap"] += 1
            return
        seq = self._next_seq()
        self._relays[seq] = _Relay(message.seq, addr, message.nack, now + self.timing.probe_timeout_s)
        self._send(message.target_addr, [encode_message(Ping(seq=seq, target=message.target, source=self.local_name))])

    def _alive(self, a: Alive, now: float, *, anti_entropy: bool = False) -> None:
        """memberlist aliveNode; ``anti_entropy``: learned from a push-pull, not from gossip."""
        if self._leaving and a.name == self.local_name:
            return
        member = self._nodes.get(a.name)
        if a.name == self.local_name:
            assert member is not None
            if a.incarnation < self.incarnation:
                return
            if a.incarnation == self.incarnation and a.meta == member.meta and tuple(a.addr) == member.addr:
                return
            self._refute(a.incarnation)  # someone speaks for us with other data: outrank it
            return
        addr = (a.addr[0], a.addr[1])
        is_new = member is None
        if member is None:
            if len(self._nodes) >= MAX_MEMBERS:
                self.stats["dropped"]["member_cap"] += 1
                return
            member = Member(a.name, addr, MemberState.DEAD, a.incarnation, bytes(a.meta), now)
            self._nodes[a.name] = member
            # memberlist adds a new member at a random place in the probe order
            self._probe_list.insert(self._rng.randint(0, len(self._probe_list)), a.name)
        elif member.addr != addr:
            reclaim = self.timing.dead_node_reclaim_s
            may_reclaim = member.state is MemberState.LEFT or (
                member.state is MemberState.DEAD and reclaim > 0 and now - member.state_since >= reclaim
            )
            if not may_reclaim:
                self.stats["dropped"]["name_conflict"] += 1
                return
            self._rtt_ms.pop(a.name, None)  # another host under the old name
        elif a.incarnation <= member.incarnation:
            return
        self._suspicions.pop(a.name, None)
        # Departs from memberlist's aliveNode, which re-broadcasts every newer incarnation it accepts: a newer
        # incarnation of a member already alive here, at the same address, with other metadata, learned from a
        # push-pull, is most likely a quiet update (set_meta(broadcast=False)); it goes on by push-pull only, or
        # each member would retransmit it and undo what quiet saves. A revival, a refutation (same metadata), an
        # address change and anything learned from gossip are broadcast as memberlist does.
        quiet = (
            anti_entropy
            and not is_new
            and member.state is MemberState.ALIVE
            and member.addr == addr
            and member.meta != a.meta
        )
        if quiet:
            self.stats["quiet_merges"] += 1
        else:
            self._updates.queue(a.name, encode_message(a))
        old_state, old_meta = member.state, member.meta
        member.incarnation = a.incarnation
        member.meta = bytes(a.meta)
        member.addr = addr
        if old_state is not MemberState.ALIVE or is_new:
            member.state = MemberState.ALIVE
            member.state_since = now
        if is_new or old_state in (MemberState.DEAD, MemberState.LEFT):
            self._emit("join", member)
        elif old_state is MemberState.SUSPECT:
            self._emit("alive", member)
        elif old_meta != member.meta:
            self._emit("update", member)

    def _suspect(self, s: Suspect, now: float, reply_to: tuple[str, int] | None = None) -> None:
        member = self._nodes.get(s.name)
        if member is None:
            return
        if s.incarnation < member.incarnation:
            if s.name == self.local_name and not self._leaving:
                if s.incarnation >= self._gossiped_incarnation:
                    self._refute(s.incarnation)  # others may know no newer one of us: outrank it on the gossip
                if reply_to is not None:
                    self._answer_suspicion(reply_to)  # the sender missed our refutation: tell it directly
            return
        suspicion = self._suspicions.get(s.name)
        if suspicion is not None:
            if s.incarnation == member.incarnation:
                if suspicion.confirm(s.source, now):
                    self._updates.queue(s.name, encode_message(s))  # new information: pass it on
                return
            # A newer incarnation is suspected: the member refuted ours (we missed it), so this is a new suspicion,
            # not a confirmation of the old one (memberlist confirms, which fires a stale timer at once).
            del self._suspicions[s.name]
        elif member.state is not MemberState.ALIVE:
            return
        if s.name == self.local_name:
            if not self._leaving:
                self._refute(s.incarnation)
                if reply_to is not None:
                    self._answer_suspicion(reply_to)  # the sender suspects us: it is the first to know
            return
        self._updates.queue(s.name, encode_message(s))
        member.incarnation = s.incarnation
        member.state = MemberState.SUSPECT
        member.state_since = now
        self.stats["suspicions"] += 1
        n = len(self._nodes)
        k = self.timing.suspicion_mult - 2
        if n - 2 < k:
            k = 0  # too few members to ever get k confirmations
        min_s = suspicion_timeout(self.timing.suspicion_mult, n, self.timing.probe_interval_s)
        max_s = self.timing.suspicion_max_timeout_mult * min_s
        deadline = now + (max_s if k >= 1 else min_s)
        tell_at = now + self.timing.probe_interval_s  # not health-scaled: it saves false deaths
        self._suspicions[s.name] = Suspicion(k, min_s, max_s, now, deadline, {s.source}, tell_at=tell_at)
        self._emit("suspect", member)

    def _answer_suspicion(self, addr: tuple[str, int]) -> None:
        """Our current Alive, straight to a member that suspects an older incarnation of us (once in the packet)."""
        alive = encode_message(self._alive_self())
        self._emit_packet(addr, [alive] + [p for p in self._piggyback(len(alive), 1) if p != alive])

    def _dead(self, d: Dead, now: float) -> None:
        member = self._nodes.get(d.name)
        if member is None:
            return
        if d.incarnation < member.incarnation:
            if d.name == self.local_name and not self._leaving and d.incarnation >= self._gossiped_incarnation:
                self._refute(d.incarnation)  # declared dead at a quiet-stale incarnation others may still hold
            return
        self._suspicions.pop(d.name, None)
        if member.state in (MemberState.DEAD, MemberState.LEFT):
            return
        if d.name == self.local_name and not self._leaving:
            self._refute(d.incarnation)
            return
        self._updates.queue(d.name, encode_message(d))
        member.incarnation = d.incarnation
        member.state = MemberState.LEFT if d.source == d.name else MemberState.DEAD
        member.state_since = now
        self._rtt_ms.pop(d.name, None)  # a member that comes back may come back somewhere else
        if member.state is MemberState.DEAD:
            self.stats["deaths"] += 1
            self._failed.pop(member.name, None)
            self._failed[member.name] = (member.addr, now)
            while len(self._failed) > MAX_FAILED_REMEMBERED:
                del self._failed[next(iter(self._failed))]
            self._emit("dead", member)
        else:
            self._emit("leave", member)

    def _refute(self, accused_incarnation: int) -> None:
        self.incarnation = max(self.incarnation, accused_incarnation) + 1
        me = self._nodes[self.local_name]
        me.incarnation = self.incarnation
        self._queue_alive_self()
        self.stats["refutations"] += 1
        self._apply_health(1)  # being suspected hints that we are the slow one (Lifeguard)
        self._emit("refute", me)

    def _on_user_msg(self, msg: UserMsg, now: float, *, regossip: bool) -> None:
        if msg.sender == self.local_name:
            return
        stored = self._user_store.get((msg.sender, msg.key))
        if stored is not None and stored.msg.seq >= msg.seq:
            self.stats["user_duplicates"] += 1
            return
        self._store_user(msg, now)
        if regossip:
            self._user_queue.queue((msg.sender, msg.key), encode_message(msg))
        self.stats["user_delivered"] += 1
        self._events.append(UserBroadcast(payload=msg.payload, sender=msg.sender))

    def _store_user(self, msg: UserMsg, now: float) -> None:
        self._user_store.pop((msg.sender, msg.key), None)
        self._user_store[(msg.sender, msg.key)] = _StoredUserMsg(msg, now)
        while len(self._user_store) > MAX_STORED_USER_MSGS:  # dicts keep insertion order: oldest first
            del self._user_store[next(iter(self._user_store))]

    # ------------------------------------------------------------------ probing

    def _probe_next(self, now: float, interval: float) -> None:
        if self._probe is not None:
            return
        for _ in range(len(self._probe_list) + 1):
            if self._probe_index >= len(self._probe_list):
                self._reset_probe_list(now)
                if not self._probe_list:
                    return
            name = self._probe_list[self._probe_index]
            self._probe_index += 1
            member = self._nodes.get(name)
            if member is None or member.state in (MemberState.DEAD, MemberState.LEFT):
                continue
            self._probe_member(member, now, interval)
            return

    def _reset_probe_list(self, now: float) -> None:
        """Start a new round: forget long-dead members, shuffle the order (memberlist resetNodes)."""
        for name, member in list(self._nodes.items()):
            if (
                name != self.local_name
                and member.state in (MemberState.DEAD, MemberState.LEFT)
                and now - member.state_since > self.timing.gossip_to_the_dead_s
            ):
                del self._nodes[name]
        self._probe_list = [name for name in self._nodes if name != self.local_name]
        self._rng.shuffle(self._probe_list)
        self._probe_index = 0
        self._expire_user_store(now)

    def _probe_member(self, member: Member, now: float, interval: float) -> None:
        seq = self._next_seq()
        self.stats["probes"] += 1
        timeout = self.timing.probe_timeout_s
        # One resend at half the ack timeout: at 10 % loss a fifth of probes lose the ping or the ack, and each
        # would cost three indirect pings and a TCP ping (12+ packets); the resend rescues most of them for two.
        self._probe = _Probe(
            seq, member.name, now + timeout, now + interval, interval, resend_at=now + timeout / 2, sent_at=now
        )
        self._send(member.addr, self._ping_parts(seq, member))

    def _ping_parts(self, seq: int, member: Member) -> list[bytes]:
        parts = [encode_message(Ping(seq=seq, target=member.name, source=self.local_name))]
        if member.state is not MemberState.ALIVE:
            # Tell a suspect what we think so it can refute at once (Lifeguard's buddy system).
            parts.append(
                encode_message(Suspect(name=member.name, incarnation=member.incarnation, source=self.local_name))
            )
        return parts

    def _probe_stages(self, now: float) -> None:
        probe = self._probe
        if probe is None:
            return
        if probe.resend_at is not None and now >= probe.resend_at and not probe.indirect:
            probe.resend_at = None
            member = self._nodes.get(probe.target)
            if member is not None:
                self.stats["probe_resends"] += 1
                self._send(member.addr, self._ping_parts(probe.seq, member))
        if not probe.indirect and now >= probe.ack_deadline:
            self._start_indirect(probe, now)
        if probe.indirect and now >= probe.end:
            self._probe = None
            if probe.tcp_ok:
                self.stats["tcp_fallback_rescues"] += 1
                self._apply_health(-1)
                return
            self.stats["probe_failures"] += 1
            if probe.expected_nacks > 0:
                self._apply_health(max(0, probe.expected_nacks - probe.nacks))
            else:
                self._apply_health(1)
            member = self._nodes.get(probe.target)
            if member is not None and member.state in (MemberState.ALIVE, MemberState.SUSPECT):
                # On a member already suspect this is our independent confirmation.
                self._suspect(Suspect(name=member.name, incarnation=member.incarnation, source=self.local_name), now)

    def _start_indirect(self, probe: _Probe, now: float) -> None:
        probe.indirect = True
        # A late timer must not eat the indirect window: it gets its full share of the interval.
        probe.end = max(probe.end, now + probe.interval - self.timing.probe_timeout_s)
        target = self._nodes.get(probe.target)
        if target is None:
            return
        peers = [
            m
            for m in self._nodes.values()
            if m.state is MemberState.ALIVE and m.name not in (self.local_name, probe.target)
        ]
        chosen = self._rng.sample(peers, min(self.timing.indirect_checks, len(peers)))
        request = encode_message(IndirectPing(seq=probe.seq, target=target.name, target_addr=target.addr, nack=True))
        for peer in chosen:
            self.stats["indirect_probes"] += 1
            self._send(peer.addr, [request])
        probe.expected_nacks = len(chosen)
        self.stats["tcp_fallback_probes"] += 1
        token = self._open_stream(
            _Stream("ping", seq=probe.seq),
            target.addr,
            encode_stream(Ping(seq=probe.seq, target=target.name, source=self.local_name)),
        )
        probe.tcp_token = token

    def _relay_timeouts(self, now: float) -> None:
        if not self._relays:
            return
        for seq, relay in list(self._relays.items()):
            if now >= relay.deadline:
                del self._relays[seq]
                if relay.nack:
                    self._send(relay.requester, [encode_message(Nack(seq=relay.requester_seq))])

    def _suspicion_timeouts(self, now: float) -> None:
        if not self._suspicions:
            return
        for name, suspicion in list(self._suspicions.items()):
            member = self._nodes.get(name)
            if now >= suspicion.deadline:
                del self._suspicions[name]
                if member is not None and member.state is MemberState.SUSPECT:
                    self._dead(Dead(name=name, incarnation=member.incarnation, source=self.local_name), now)
            elif now >= suspicion.tell_at and member is not None:
                # Lifeguard's buddy system rides on our probes of the suspect, one per round of the probe list: a
                # member that missed the refutation gossip would hold its stale suspicion until it fires. Telling
                # the suspect once per probe interval makes it answer us directly (_suspect's reply_to).
                suspicion.tell_at = now + self.timing.probe_interval_s
                self.stats["suspect_tells"] += 1
                self._send(
                    member.addr,
                    [encode_message(Suspect(name=name, incarnation=member.incarnation, source=self.local_name))],
                )

    # ------------------------------------------------------------------ gossip and anti-entropy

    def _gossip(self, now: float) -> None:
        if not self._updates and not self._user_queue:
            return
        # memberlist's filter: the live, and the dead for a while (so they can hear it and refute); never the left
        targets = [
            m
            for m in self._nodes.values()
            if m.name != self.local_name
            and (
                m.state in (MemberState.ALIVE, MemberState.SUSPECT)
                or (m.state is MemberState.DEAD and now - m.state_since <= self.timing.gossip_to_the_dead_s)
            )
        ]
        for member in self._rng.sample(targets, min(self.timing.gossip_nodes, len(targets))):
            parts = self._piggyback(0, 0)
            if not parts:
                return
            self._emit_packet(member.addr, parts)

    def _push_pull(self, now: float) -> None:
        peers = [m for m in self._nodes.values() if m.name != self.local_name and m.state is MemberState.ALIVE]
        if not peers:
            return
        peer = self._rng.choice(peers)
        self.stats["push_pulls"] += 1
        self._open_stream(_Stream("push_pull"), peer.addr, encode_stream(self._local_state(join=False)))

    def _reconnect(self, now: float) -> None:
        """Push-pull with one member we declared failed: after a long partition neither side gossips to the
        other any more (both reaped), so this, like serf's reconnect, is what joins the halves again."""
        for name, (_, since) in list(self._failed.items()):
            member = self._nodes.get(name)
            if now - since > RECONNECT_FOR_S or (member is not None and member.state is MemberState.ALIVE):
                del self._failed[name]
        if not self._failed:
            return
        addr, _ = self._failed[self._rng.choice(list(self._failed))]
        self.stats["reconnects"] += 1
        self._open_stream(_Stream("push_pull"), addr, encode_stream(self._local_state(join=False)))

    def _start_join_attempt(self) -> None:
        if not self._join_seeds:
            return
        self._join_attempt += 1
        self._join_pending = len(self._join_seeds)
        request = encode_stream(self._local_state(join=True))
        for seed in self._join_seeds:
            self._open_stream(_Stream("join", attempt=self._join_attempt), seed, request)

    def _local_state(self, *, join: bool) -> PushPull:
        members = [
            PushMember(name=m.name, addr=m.addr, incarnation=m.incarnation, state=m.state.value, meta=m.meta)
            for m in list(self._nodes.values())[:MAX_PUSH_MEMBERS]
        ]
        self._expire_user_store(self._now)
        # Only our own: each member hands its own to every push-pull peer, who re-gossips them, so a healed
        # partition learns everything without every stream carrying the whole fleet's store.
        broadcasts = [s.msg for s in self._user_store.values() if s.msg.sender == self.local_name]
        broadcasts = broadcasts[-MAX_PUSH_BROADCASTS:]
        return PushPull(join=join, source=self.local_name, members=members, broadcasts=broadcasts)

    def _merge_remote_state(self, remote: PushPull, now: float) -> None:
        """memberlist mergeState: a remote DEAD only makes us suspect (it may be stale), LEFT is final."""
        for pm in remote.members:
            state = MemberState(pm.state)
            if state is MemberState.ALIVE:
                alive = Alive(name=pm.name, addr=pm.addr, incarnation=pm.incarnation, meta=pm.meta)
                self._alive(alive, now, anti_entropy=True)
            elif state is MemberState.LEFT:
                self._dead(Dead(name=pm.name, incarnation=pm.incarnation, source=pm.name), now)
            else:
                self._suspect(Suspect(name=pm.name, incarnation=pm.incarnation, source=remote.source), now)
        for msg in remote.broadcasts:
            self._on_user_msg(msg, now, regossip=True)

    def _expire_user_store(self, now: float) -> None:
        ttl = self.timing.broadcast_ttl_s
        while self._user_store:
            oldest_key = next(iter(self._user_store))
            if now - self._user_store[oldest_key].stored_at <= ttl:
                break
            del self._user_store[oldest_key]

    # ------------------------------------------------------------------ plumbing

    def _send(self, addr: tuple[str, int], parts: list[bytes]) -> None:
        used = sum(len(p) for p in parts)
        parts = parts + self._piggyback(used, len(parts))
        self._emit_packet(addr, parts)

    def _piggyback(self, used: int, count: int) -> list[bytes]:
        space = self._budget - packet_overhead(MAX_MESSAGES_PER_PACKET) - used
        room = MAX_MESSAGES_PER_PACKET - count
        limit = retransmit_limit(self.timing.retransmit_mult, len(self._nodes))
        extra = self._updates.take(space, room, limit)
        space -= sum(len(p) for p in extra)
        extra += self._user_queue.take(space, room - len(extra), limit)
        self.stats["broadcasts_pruned"] = self._updates.pruned + self._user_queue.pruned
        return extra

    def _emit_packet(self, addr: tuple[str, int], parts: list[bytes]) -> None:
        packet = encode_packet(parts)
        self.stats["sent_bytes"] += len(packet)
        self.stats["sent_packets"] += 1
        self._out_datagrams.append((addr, packet))

    def _open_stream(self, stream: _Stream, addr: tuple[str, int], request: bytes) -> int:
        self._token += 1
        self._streams[self._token] = stream
        self.stats["stream_sent_bytes"] += len(request)
        self._out_streams.append((self._token, addr, request))
        return self._token

    def _stream_reply(self, reply: bytes) -> bytes:
        self.stats["stream_sent_bytes"] += len(reply)
        return reply

    def _alive_self(self) -> Alive:
        me = self._nodes[self.local_name]
        return Alive(name=me.name, addr=me.addr, incarnation=me.incarnation, meta=me.meta)

    def _queue_alive_self(self) -> None:
        self._gossiped_incarnation = self.incarnation
        self._updates.queue(self.local_name, encode_message(self._alive_self()))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _scaled(self, timeout: float) -> float:
        return timeout * (self.health_score + 1)

    def _apply_health(self, delta: int) -> None:
        self.health_score = min(max(self.health_score + delta, 0), self.timing.awareness_max_multiplier - 1)

    def _has_live_peer(self) -> bool:
        return any(m.state is MemberState.ALIVE and m.name != self.local_name for m in self._nodes.values())

    def _emit(self, kind: str, member: Member) -> None:
        self._events.append(MemberEvent(kind=kind, member=replace(member)))
        if kind in ("dead", "refute", "leave"):
            log.info("swarm: %s %s (incarnation %d)", kind, member.name, member.incarnation)

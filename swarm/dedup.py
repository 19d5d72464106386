"""Detection dedup between drones: ground tracks -> gossiped claims -> one owner reports each object.

Sans-I/O: the caller hands in this node's ground fixes (``observe``), peers'
claim payloads (``receive``) and the time; it gossips what ``outgoing`` returns
(``Membership.queue_broadcast(key, payload)``: one key per track, so a newer
claim replaces a queued older one) and publishes what ``tick`` returns.

* A node's successive fixes of one class within a distance gate are one track;
  each track is a ``Claim`` (class, position, uncertainty, first/last seen, best
  score, node, track id, whether its object was reported).
* Positions are geodetic (WGS84 latitude/longitude and the ground's height above
  mean sea level), the one frame every drone agrees on whatever its launch point;
  distances between claims and fixes are horizontal (``swarm.geo.ground_offset_m``).
* Two claims of one class are the same object when their positions agree within ``radius_m`` (not
  widened by their uncertainties: a fresh fix's wide gate must not merge two people a few metres apart)
  and their seen intervals overlap within ``window_s``.
* Reporting is at-least-once. A node stays quiet about a track only while a claim that says ``reported``
  matches it: its object is known to be published (a claim says ``reported`` once its node's driver
  confirmed the publication with ``published``, or once the node matched such a claim itself). A track
  whose cover stops matching (its position settled further away) is decided again.
* Who reports an object nobody reported yet: the undecided claims are grouped around leaders, taken in one
  total order (earliest first seen, then node id, then track id) that every node computes the same way
  from the claims it holds; a leader takes the not yet grouped claims that match it (no chains: two
  people a few metres apart are not merged through a third claim). The leader's node reports the group
  once the leader's ``hold_s`` (from its first fix) is over; the others wait for its ``reported`` claim.
  A node that holds no such claim ``defer_s`` after its own hold ended reports the object itself (the
  leader died, is cut off, grouped differently, or never reported).
* The bound: a track of ``min_hits`` fixes on a live node is published by some node within
  ``hold_s + defer_s`` of its first fix (or of its cover ending), plus one tick of this node. ``defer_s``
  covers the leader's tick, its sink's confirmation and the gossip's spread (``deferral_s``); one too
  short costs duplicates, never a report. Node clocks (claims carry wall time) must agree within a
  fraction of it.
* ``hold_s`` delays a track's decision that long after its first fix so peers' claims can arrive; 0
  reports at once and suppresses later copies (two drones that find an object within a gossip round trip
  then both report it).
* A track that ends, is evicted, or belongs to a node that leaves (``flush``) is still decided: what is
  not covered is reported.
* Gossip costs every member a retransmission of every claim, so only what peers need goes out: undecided
  tracks, the objects this node reported (again while it still sees them), and, from a quiet track, its
  reported claim when it has seen the object ``memory_slack_s`` past what any reported claim says (the
  swarm's memory of the report then lasts while anyone sees the object) or when a holding peer claims an
  object this node remembers as reported (a reminder, answered before the peer's hold ends).

Everything expires ``window_s`` after it was last seen or heard, and every table
has a cap, so memory is bounded under any input. A peer's unreported claim that
goes unheard for ``peer_silence_s`` (its node died or is cut off) is dropped
sooner; the driver may call ``forget_node`` on the membership's dead/leave
events to do it at once (its reported claims stay: what a dead node published
is still published), and ``resend_claims`` on join and alive events (gossip
reaches only the members of its moment; a late joiner or a healed side learns
older claims from these). The driver calls ``published(object_id)`` once its
sinks took an object ``tick`` returned; until then the object is returned again
every ``claim_refresh_s``.

Times in claims are wall-clock (``wall``: nodes' monotonic clocks differ); the
expiry of local state uses the monotonic ``now``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec

from swarm.config import SwarmTiming
from swarm.geo import ground_offset_m, offset_latlon

OBJECT_SCHEMA: Final = "edgerun.object/2"  # Final: read as its literal by edgerun.wire's Literal schema field
CLAIM_TAG = 1  # first element of every claim payload (other app gossip uses other tags)


@dataclass(frozen=True)
class DedupConfig:
    # Two claims of one class closer than this are one object. Not widened by their uncertainties: a fresh
    # fix's wide gate must neither merge two people a few metres apart nor let one's report silence the other.
    radius_m: float = 5.0
    sigma_gate: float = 2.0  # a fix joins a track within track_gate_m widened by this many of their uncertainties,
    max_gate_m: float = 25.0  # up to this distance and radius_m
    window_s: float = 60.0  # seen within this long of each other; also how long state is kept
    hold_s: float = 0.0  # wait this long after a track's first fix for peers' claims; 0: decide at once
    # A track whose object a peer leads is reported by this node when no claim says the object was published
    # this long after its hold ended (the at-least-once deadline; deferral_s() derives it from the gossip timing:
    # 2 s for memberlist's LAN timing, a swarm of 10-99 and a 0.2 s tick).
    defer_s: float = 2.0
    track_gate_m: float = 2.0  # a fix joins this node's track of its class within this (widened the same way)
    track_timeout_s: float = 3.0  # a track with no fix for this long ends (its claim is kept for window_s)
    track_noise_m2_s: float = 0.25  # how far a tracked object may wander, m^2/s (the track filter's process noise)
    min_hits: int = 1  # fixes a track needs before it claims anything
    claim_min_interval_s: float = 2.0  # a changed claim is gossiped at most this often ...
    claim_refresh_s: float = 15.0  # ... and unchanged ones this often, so healed partitions and late joiners learn it
    # A peer's unreported claim not heard for this long is dropped (its node is gone or cut off): another node
    # may then own the object. Reported claims are kept for window_s, so they still suppress copies.
    peer_silence_s: float = 45.0
    # A track whose object another node reported gossips its claim when it has seen the object this much longer
    # than any reported claim says (checked every claim_refresh_s while in sight, and when the track ends).
    memory_slack_s: float = 30.0
    # A drone that finds an object already reported tells its owner once per track, so the owner publishes it
    # again with this node in seen_by. Cheap in a small swarm; in the 20-drone sim it takes a node from
    # ~770 to ~1900 B/s, over the 1 KB/s budget, hence off by default.
    share_sightings: bool = False
    max_tracks: int = 256
    max_claims_per_node: int = 64
    max_nodes: int = 64
    max_payload_bytes: int = 256

    def __post_init__(self) -> None:
        for name in ("radius_m", "window_s", "track_gate_m", "track_timeout_s", "claim_refresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"dedup: {name} must be > 0, got {getattr(self, name)}")
        for name in ("hold_s", "defer_s", "sigma_gate", "track_noise_m2_s", "claim_min_interval_s", "memory_slack_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"dedup: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("min_hits", "max_tracks", "max_claims_per_node", "max_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"dedup: {name} must be >= 1, got {getattr(self, name)}")
        if self.hold_s + self.defer_s >= self.window_s:
            # a track is decided before its state could expire
            raise ValueError(
                f"dedup: hold_s + defer_s ({self.hold_s + self.defer_s:g}) must be < window_s ({self.window_s:g})"
            )
        if self.peer_silence_s < 2 * self.claim_refresh_s:
            # a live peer refreshes its undecided claims every claim_refresh_s: one lost refresh is not death
            raise ValueError(
                f"dedup: peer_silence_s ({self.peer_silence_s}) must be >= 2 x claim_refresh_s ({self.claim_refresh_s})"
            )


@dataclass(frozen=True, slots=True)
class Observation:
    """One ground fix of this node: a detection of ``label`` projected onto the ground.

    ``lat``/``lon`` in WGS84 degrees; ``alt_m`` is the height (above mean sea level) of the ground the fix
    was projected onto.
    """

    label: str
    lat: float
    lon: float
    alt_m: float
    sigma_m: float
    score: float


NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
I32 = Annotated[int, msgspec.Meta(ge=-0x80000000, le=0x7FFFFFFF)]


class Claim(msgspec.Struct, array_like=True, frozen=True, tag=CLAIM_TAG):
    """One track of one node, as gossiped: integers in fixed units keep it small (about 55 bytes)."""

    node: NodeId
    track: U32
    label: Annotated[str, msgspec.Meta(max_length=32)]
    lat_e7: Annotated[int, msgspec.Meta(ge=-900_000_000, le=900_000_000)]  # 1e-7 degree (1.1 cm), as MAVLink
    lon_e7: Annotated[int, msgspec.Meta(ge=-1_800_000_000, le=1_800_000_000)]
    alt_dm: I32  # the ground's height above mean sea level, decimetres
    sigma_dm: Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
    first_ms: Annotated[int, msgspec.Meta(ge=0, le=2**53)]  # wall clock, Unix milliseconds
    span_ms: U32  # last seen - first seen
    score_pm: Annotated[int, msgspec.Meta(ge=0, le=1000)]  # best score, per mille
    reported: bool

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.track)

    @property
    def lat(self) -> float:
        return self.lat_e7 / 1e7

    @property
    def lon(self) -> float:
        return self.lon_e7 / 1e7

    @property
    def alt_m(self) -> float:
        return self.alt_dm / 10.0

    @property
    def sigma_m(self) -> float:
        return self.sigma_dm / 10.0

    @property
    def last_ms(self) -> int:
        return self.first_ms + self.span_ms

    def version(self) -> tuple[Any, ...]:
        """Newer claims of one track compare greater (a restarted node's tracks start later): any order converges."""
        return (self.first_ms, self.span_ms, self.reported, self.score_pm, self.sigma_dm, self.lat_e7,
                self.lon_e7, self.alt_dm, self.label)  # fmt: skip


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Claim)


def encode_claim(claim: Claim) -> bytes:
    return _ENCODER.encode(claim)


def claim_key(claim: Claim) -> bytes:
    """The gossip key: one per track (the membership scopes keys by sender), so a newer claim replaces the
    queued older one; 5 bytes, because every member re-gossips it with the claim."""
    return _track_key(claim.node, claim.track)


def _track_key(node: str, track: int) -> bytes:
    return b"c" + track.to_bytes(4, "big")


def deferral_s(timing: SwarmTiming, nodes: int, tick_s: float) -> float:
    """The ``defer_s`` that covers a leader's report reaching a follower: the leader's tick and the follower's,
    and the gossip's spread. Every member that hears a new claim retransmits it ``retransmit_mult *
    ceil(log10(N + 1))`` times, a gossip interval apart, so it reaches the swarm within that many intervals
    while the loss stays well below 1 / ``gossip_nodes``; a report that takes longer costs a duplicate.
    (Measured in ``swarm.sim``, 20 nodes, 10 % loss: 99 % of reported claims arrive within 0.5 s; at 30 %,
    0.6 s.)
    """
    spread = timing.retransmit_mult * math.ceil(math.log10(max(nodes, 1) + 1)) * timing.gossip_interval_s
    return 2.0 * tick_s + spread


def owner_order(claim: Claim) -> tuple[int, str, int]:
    """The total order that picks an object's leader (smallest first): earliest first seen, then node id, then
    track. Earliest first: a leader's hold ends no later than its followers', so deferring to it costs them
    at most the gossip's spread, and a later claim never takes an object over."""
    return (claim.first_ms, claim.node, claim.track)


def object_id(first: Claim) -> str:
    """A stable object id from the object's earliest claim: every node derives the same one."""
    digest = hashlib.blake2b(f"{first.node}/{first.track}/{first.first_ms}".encode(), digest_size=8)
    return digest.hexdigest()


def same_object(a: Claim, b: Claim, cfg: DedupConfig) -> bool:
    """Whether two claims describe one object: class, distance (within ``radius_m``) and time."""
    if a.label != b.label:
        return False
    window_ms = cfg.window_s * 1000.0
    if a.first_ms - window_ms > b.last_ms or b.first_ms - window_ms > a.last_ms:
        return False
    return math.hypot(*ground_offset_m(a.lat, a.lon, b.lat, b.lon)) <= cfg.radius_m


class _ClaimIndex:
    """Claims bucketed by class and ground cell, for finding the group of one claim without comparing all pairs.

    Cells are squares of a plane at the first claim; they are a quarter larger than the gate, so the
    plane's distortion far from that claim cannot push two claims within a gate more than one cell apart.
    """

    def __init__(self, claims: list[Claim], cfg: DedupConfig) -> None:
        self.cfg = cfg
        self.cell = 1.25 * cfg.radius_m
        self.origin = (claims[0].lat, claims[0].lon) if claims else (0.0, 0.0)
        self.cells: dict[tuple[str, int], tuple[str, int, int]] = {}
        self.buckets: dict[tuple[str, int, int], list[Claim]] = {}
        for c in claims:
            self.buckets.setdefault(self._cell_of(c), []).append(c)

    def _cell_of(self, c: Claim) -> tuple[str, int, int]:
        cell = self.cells.get(c.key)
        if cell is None:
            east, north = ground_offset_m(self.origin[0], self.origin[1], c.lat, c.lon)
            cell = self.cells[c.key] = (c.label, math.floor(east / self.cell), math.floor(north / self.cell))
        return cell

    def near(self, claim: Claim) -> list[Claim]:
        """The claims that ``same_object`` may match with ``claim`` (its class, its cell and the cells around)."""
        label, cx, cy = self._cell_of(claim)
        return [c for dx in (-1, 0, 1) for dy in (-1, 0, 1) for c in self.buckets.get((label, cx + dx, cy + dy), ())]

    def matches(self, claim: Claim) -> list[Claim]:
        """The other claims that may be the same object as ``claim``."""
        return [c for c in self.near(claim) if c.key != claim.key and same_object(claim, c, self.cfg)]


def leader_groups(claims: list[Claim], cfg: DedupConfig) -> dict[tuple[str, int], list[Claim]]:
    """Each claim's group, leader first: a pure function of the claim set, whatever its order.

    Claims are taken in ``owner_order``; a claim not yet grouped leads a group of the not yet grouped claims
    that ``same_object`` matches with it. No chains: a group spans at most ``radius_m`` around its leader.
    """
    index = _ClaimIndex(claims, cfg)
    groups: dict[tuple[str, int], list[Claim]] = {}
    for leader in sorted(claims, key=owner_order):
        if leader.key in groups:
            continue
        members = [leader] + sorted((c for c in index.matches(leader) if c.key not in groups), key=owner_order)
        for m in members:
            groups[m.key] = members
    return groups


def group_owners(claims: list[Claim], cfg: DedupConfig) -> dict[tuple[str, int], tuple[str, int]]:
    """Each claim's group leader (node, track), the node that reports the group."""
    return {key: members[0].key for key, members in leader_groups(claims, cfg).items()}


@dataclass(frozen=True, slots=True)
class FleetObject:
    """One object as the fleet reports it (schema ``edgerun.object/2``): where on Earth, how sure, who saw it."""

    id: str
    label: str
    lat: float
    lon: float
    alt_m: float  # the height above mean sea level of the ground the object was located on
    uncertainty_m: float  # one sigma, horizontal
    first_seen: float  # wall clock, Unix seconds
    last_seen: float
    score: float
    owner: str
    seen_by: tuple[str, ...]
    ts: float  # wall clock of the report
    # A later message about an object this node already reported (same id): more nodes have seen it.
    update: bool = False

    @classmethod
    def from_claims(cls, members: list[Claim], owner: str, wall: float) -> FleetObject:
        """Fuse an object's claims: inverse-variance mean position, earliest first and latest last seen."""
        weights = [1.0 / max(c.sigma_m, 0.1) ** 2 for c in members]
        total = sum(weights)
        first = min(members, key=lambda c: (c.first_ms, c.node, c.track))
        offsets = [ground_offset_m(first.lat, first.lon, c.lat, c.lon) for c in members]
        east = sum(w * o[0] for w, o in zip(weights, offsets)) / total
        north = sum(w * o[1] for w, o in zip(weights, offsets)) / total
        lat, lon = offset_latlon(first.lat, first.lon, east, north)
        return cls(
            id=object_id(first),
            label=first.label,
            lat=lat,
            lon=lon,
            alt_m=sum(w * c.alt_m for w, c in zip(weights, members)) / total,
            uncertainty_m=math.sqrt(1.0 / total),
            first_seen=first.first_ms / 1000.0,
            last_seen=max(c.last_ms for c in members) / 1000.0,
            score=max(c.score_pm for c in members) / 1000.0,
            owner=owner,
            seen_by=tuple(sorted({c.node for c in members})),
            ts=wall,
        )

    def to_payload(self) -> dict[str, Any]:
        """The JSON object documented in docs/payloads.md and edgerun/schema/object-v2.json."""
        return {
            "schema": OBJECT_SCHEMA,
            "id": self.id,
            "label": self.label,
            "lat": round(self.lat, 7),
            "lon": round(self.lon, 7),
            "alt_m": round(self.alt_m, 2),
            "uncertainty_m": round(self.uncertainty_m, 2),
            "first_seen": round(self.first_seen, 3),
            "last_seen": round(self.last_seen, 3),
            "score": round(self.score, 3),
            "owner": self.owner,
            "seen_by": list(self.seen_by),
            "ts": round(self.ts, 6),
        }


@dataclass(slots=True)
class _Track:
    id: int
    label: str
    lat: float
    lon: float
    alt_m: float
    var_m2: float
    first_wall: float
    last_wall: float
    created: float  # monotonic
    last_fix: float  # monotonic
    score: float
    hits: int = 1
    reported: bool = False  # what its claim says: its object is known to be published (here or by a peer)
    suppressed: bool = False  # covered by another node's report: this track stays quiet while ``cover`` matches ...
    memory_due: bool = False  # ... except to keep the swarm's memory of the report alive (Dedup._keeps_memory)
    checked_at: float = -math.inf  # when that was last checked
    end_checked: bool = False
    claim: Claim | None = None  # the last claim gossiped
    sent_at: float = -math.inf
    report_id: str | None = None  # the object this node reported for this track, and who had seen it then
    reported_nodes: frozenset[str] = frozenset()
    published_at: float = -math.inf  # when that object was last handed to the driver (until it confirms)
    cover: Claim | None = None  # the reported claim that matched this suppressed track when last checked
    uncovered_at: float = -math.inf  # when its cover stopped matching: its deadline runs from then

    def decided(self) -> bool:
        return self.report_id is not None or self.suppressed

    def to_claim(self, node: str) -> Claim:
        first_ms = int(self.first_wall * 1000.0)
        return Claim(
            node=node,
            track=self.id,
            label=self.label,
            lat_e7=_clamp(round(self.lat * 1e7), -900_000_000, 900_000_000),
            lon_e7=_clamp(round(self.lon * 1e7), -1_800_000_000, 1_800_000_000),
            alt_dm=_clamp(round(self.alt_m * 10.0), -0x80000000, 0x7FFFFFFF),
            sigma_dm=_clamp(round(math.sqrt(self.var_m2) * 10.0), 0, 0xFFFF),
            first_ms=max(0, first_ms),
            span_ms=_clamp(int(self.last_wall * 1000.0) - first_ms, 0, 0xFFFFFFFF),
            score_pm=_clamp(round(self.score * 1000.0), 0, 1000),
            reported=self.reported,
        )


@dataclass(slots=True)
class _Held:
    claim: Claim
    heard: float  # monotonic


@dataclass
class DedupStats:
    objects_reported: int = 0
    object_updates: int = 0  # reported objects published again because more nodes saw them
    suppressed: int = 0  # this node's tracks left unreported because their object was reported
    uncovered: int = 0  # suppressed tracks whose cover stopped matching them: decided again
    deferred_reports: int = 0  # objects this node reported because their leader's report did not come in time
    orphan_reports: int = 0  # tracks reported when they expired or were evicted before their decision
    republished: int = 0  # objects handed to the driver again because it had not confirmed them
    claims_sent: int = 0
    claims_received: int = 0
    tracks_evicted: int = 0  # own tracks dropped at the cap before they expired
    reminders: int = 0  # reported claims re-sent because a peer claimed the same object unreported
    dropped: dict[str, int] = field(default_factory=dict)  # peer claims and fixes dropped, by reason

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """Plain counters for metrics and JSON."""
        return {**{k: v for k, v in vars(self).items() if k != "dropped"}, "dropped": dict(self.dropped)}


class Dedup:
    """One node's side of fleet dedup (sans-I/O; see the module docstring)."""

    def __init__(self, node_id: str, cfg: DedupConfig | None = None, *, now: float, first_track: int = 0) -> None:
        """``first_track``: the id of this node's first track. A driver that may restart gives a new one each time
        (the wall clock in ms, say): peers still hold the claims of the node's earlier run under their track ids,
        and a new track under an old id would take over that claim's key (and the reports it covered)."""
        if not 1 <= len(node_id) <= 64:
            raise ValueError(f"dedup: node id must be 1-64 characters, got {len(node_id)}")
        self.node_id = node_id
        self.cfg = cfg or DedupConfig()
        self.stats = DedupStats()
        self._tracks: OrderedDict[int, _Track] = OrderedDict()  # oldest last fix first
        self._peers: OrderedDict[str, dict[int, _Held]] = OrderedDict()  # least recently heard first
        self._outbox: dict[bytes, bytes] = {}
        self._next_track = first_track & 0xFFFFFFFF
        self._now = now
        self._changed = True  # claims or tracks changed since the last grouping
        self._waiting: frozenset[tuple[int, int]] = frozenset()  # own undecided tracks at the last grouping
        self._grouped_at = -math.inf
        self._flushing = False
        self._orphans: list[FleetObject] = []  # tracks that expired or were evicted undecided: reported next tick

    # inputs

    def observe(self, fixes: list[Observation], now: float, wall: float) -> list[int | None]:
        """This node's ground fixes of one frame: each joins its nearest live track of its class, or starts one.

        Returns the track each fix went to, in the order of ``fixes`` (None for a fix dropped as invalid).
        """
        self._now = now
        cfg = self.cfg
        live = [t for t in self._tracks.values() if now - t.last_fix <= cfg.track_timeout_s]
        pairs: list[tuple[float, int, int]] = []
        valid: list[Observation] = []
        position: list[int] = []  # index in ``fixes`` of each valid fix
        for k, fix in enumerate(fixes):
            if not all(math.isfinite(v) for v in (fix.lat, fix.lon, fix.alt_m, fix.sigma_m, fix.score)):
                self.stats.drop("fix_not_finite")
                continue
            if not 1 <= len(fix.label) <= 32 or abs(fix.lat) > 90.0 or abs(fix.lon) > 180.0 or abs(fix.alt_m) > 2e8:
                self.stats.drop("fix_invalid")
                continue
            valid.append(fix)
            position.append(k)
        tracks: list[int | None] = [None] * len(fixes)
        for i, fix in enumerate(valid):
            for t in live:
                if t.label != fix.label:
                    continue
                dist = math.hypot(*ground_offset_m(t.lat, t.lon, fix.lat, fix.lon))
                # Never wider than radius_m: a track spanning two objects would report one and cover the other.
                gate = min(cfg.track_gate_m + cfg.sigma_gate * math.hypot(fix.sigma_m, math.sqrt(t.var_m2)),
                           cfg.max_gate_m, cfg.radius_m)  # fmt: skip
                if dist <= gate:
                    pairs.append((dist, i, t.id))
        pairs.sort()
        used_fix: set[int] = set()
        used_track: set[int] = set()
        for _, i, tid in pairs:
            if i in used_fix or tid in used_track:
                continue
            used_fix.add(i)
            used_track.add(tid)
            self._update(self._tracks[tid], valid[i], now, wall)
            tracks[position[i]] = tid
        for i, fix in enumerate(valid):
            if i not in used_fix:
                tracks[position[i]] = self._start(fix, now, wall)
                self._changed = True  # a new track; fixes of known ones regroup at most every claim_min_interval_s
        return tracks

    def receive(self, payload: bytes, now: float, sender: str | None = None) -> None:
        """A claim gossiped by a peer. Never raises: a bad payload is dropped and counted by reason.

        ``sender`` is the gossip member the message came from: a claim naming another node is dropped
        as ``forged`` (one member must not speak for another). None: the caller vouched for it.
        """
        self._now = now
        if not payload:
            self.stats.drop("empty")
            return
        if len(payload) > self.cfg.max_payload_bytes:
            self.stats.drop("oversized")
            return
        try:
            claim = _DECODER.decode(payload)
        except msgspec.ValidationError:
            self.stats.drop("invalid")
            return
        except msgspec.DecodeError:
            self.stats.drop("malformed")
            return
        if sender is not None and claim.node != sender:
            self.stats.drop("forged")
            return
        if claim.node == self.node_id:
            self.stats.drop("own")
            return
        self.stats.claims_received += 1
        claims = self._peers.get(claim.node)
        if claims is None:
            if len(self._peers) >= self.cfg.max_nodes:
                _, evicted = self._peers.popitem(last=False)
                self._changed = True
                for _ in evicted:
                    self.stats.drop("node_cap")
            claims = self._peers[claim.node] = {}
        else:
            self._peers.move_to_end(claim.node)
        held = claims.get(claim.track)
        if held is not None and claim.version() < held.claim.version():
            self.stats.drop("stale")
            return
        if held is None and len(claims) >= self.cfg.max_claims_per_node:
            oldest = min(claims.values(), key=lambda h: (h.heard, h.claim.last_ms, h.claim.track))
            del claims[oldest.claim.track]
            self._changed = True
            self.stats.drop("claim_cap")
        if held is None or held.claim != claim:
            self._changed = True
            if not claim.reported:
                self._answer(claim, now)
        claims[claim.track] = _Held(claim, now)

    def _answer(self, claim: Claim, now: float) -> None:
        """A peer claims an object this node remembers as reported: remind it (it may be holding before it reports)."""
        for t in self._tracks.values():
            if t.reported and not t.memory_due and now - t.sent_at >= self.cfg.claim_min_interval_s:
                if same_object(claim, t.to_claim(self.node_id), self.cfg):
                    t.memory_due = True
                    self.stats.reminders += 1

    def resend_claims(self) -> None:
        """Queue every claim again at once: call on a member join or a healed partition, whom gossip has not told."""
        for t in self._tracks.values():
            if t.hits >= self.cfg.min_hits and not t.suppressed:
                t.claim = None

    def forget_node(self, node: str) -> None:
        """Drop a peer's undecided claims at once (it died or left): another node may then own those objects.

        Its ``reported`` claims stay (for ``window_s``, as ever): what it published stays published whatever became
        of it, and a death that was false (a starved or cut-off member, back a second later) must not make every
        drone that still sees its objects report them again.
        """
        claims = self._peers.get(node)
        if claims is None:
            return
        for track in [k for k, held in claims.items() if not held.claim.reported]:
            del claims[track]
            self._changed = True
        if not claims:
            del self._peers[node]

    def published(self, object_id: str) -> None:
        """The driver's sinks took the object ``tick`` returned under this id: its claims now say ``reported``.

        Peers stay quiet about an object only on a claim that says so; until this call the object is
        handed out again every ``claim_refresh_s``. An id this node does not know is ignored.
        """
        done = [t for t in self._tracks.values() if t.report_id == object_id and not t.reported]
        for t in done:
            t.reported = True
        if done:
            self._changed = True
            self._queue_claims(done, self._now)  # peers learn it now, not at the next tick

    # outputs

    def tick(self, now: float, wall: float) -> list[FleetObject]:
        """Expire old state, decide this node's undecided tracks; the objects to publish now.

        The driver calls ``published(obj.id)`` for each once its sinks took it.
        """
        self._now = now
        self._expire(now, wall)
        cfg = self.cfg
        reports = self._orphans
        self._orphans = []
        self.stats.objects_reported += len(reports)
        own = {t.id: t for t in self._tracks.values() if t.hits >= cfg.min_hits}
        undecided = [t for t in own.values() if not t.decided()]
        suppressed = [t for t in own.values() if t.suppressed]
        owned = [t for t in own.values() if t.report_id is not None]  # reported here: peers' claims may join it
        unconfirmed = [t for t in owned if not t.reported and now - t.published_at >= cfg.claim_refresh_s]
        # Suppressed tracks still in sight whose object's reported memory may need extending (see _keeps_memory).
        keepers = [t for t in suppressed if not t.memory_due and self._memory_check_due(t, now)]
        state = frozenset((t.id, self._phase(t, now)) for t in undecided)
        # Own positions move with every fix: covers of tracks in sight are checked again at most this often.
        moving = now - self._grouped_at >= cfg.claim_min_interval_s and any(
            t.last_fix > self._grouped_at for t in undecided + suppressed
        )
        if not (keepers or unconfirmed or self._flushing or self._changed or moving or state != self._waiting):
            self._queue_claims(own.values(), now)  # nothing new to group: the common case
            return reports
        self._changed = False
        self._grouped_at = now
        claims = [t.to_claim(self.node_id) for t in own.values()]
        claims.extend(h.claim for peer in self._peers.values() for h in peer.values())
        index = _ClaimIndex(claims, cfg)
        by_key = {c.key: c for c in claims}
        for track in suppressed + undecided:
            self._check_cover(track, by_key[(self.node_id, track.id)], index, by_key, now)
        ready = [t for t in own.values() if not t.decided() and (self._flushing or now - t.created >= cfg.hold_s)]
        if ready:
            # Groups of what nobody reported yet (this node's own reports cover their tracks already).
            open_claims = [t.to_claim(self.node_id) for t in own.values() if not t.decided()]
            open_claims.extend(c for c in claims if c.node != self.node_id and not c.reported)
            groups = leader_groups(open_claims, cfg)
            for track in ready:
                if track.decided():  # decided above in this tick, with another track of its object
                    continue
                members = groups[(self.node_id, track.id)]
                if members[0].node != self.node_id:
                    if not (self._flushing or now >= self._deadline(track)):
                        continue  # a peer's claim leads: wait for its report
                    self.stats.deferred_reports += 1  # no report came in time: at least once, so here
                obj = FleetObject.from_claims(members, self.node_id, wall)
                reports.append(obj)
                self.stats.objects_reported += 1
                for c in members:
                    if c.node == self.node_id:
                        mine = own[c.track]
                        mine.report_id, mine.reported_nodes = obj.id, frozenset(obj.seen_by)
                        mine.published_at = now
        updated: set[str] = set()
        for track in owned:
            report_id = track.report_id
            assert report_id is not None  # owned holds reported tracks only
            if report_id in updated:
                continue  # another track of the same object
            claim = by_key[(self.node_id, track.id)]
            members = [claim, *index.matches(claim)]
            if not track.reported:
                if track in unconfirmed:  # the driver has not confirmed it: hand it out again, same id
                    updated.add(report_id)
                    obj = FleetObject.from_claims(members, self.node_id, wall)
                    reports.append(dataclasses.replace(obj, id=report_id))
                    self.stats.republished += 1
                    for t in owned:
                        if t.report_id == report_id:
                            t.published_at = now
                continue
            nodes = frozenset(c.node for c in members)
            if nodes <= track.reported_nodes:
                continue
            updated.add(report_id)
            track.reported_nodes |= nodes
            obj = FleetObject.from_claims(members, self.node_id, wall)
            seen = tuple(sorted(track.reported_nodes))
            reports.append(dataclasses.replace(obj, id=report_id, seen_by=seen, update=True))
            self.stats.object_updates += 1
        for track in keepers:
            claim = by_key[(self.node_id, track.id)]
            track.memory_due = track.suppressed and self._keeps_memory(track, [claim, *index.matches(claim)])
            track.checked_at = now
            track.end_checked = now - track.last_fix > cfg.track_timeout_s
        self._waiting = frozenset((t.id, self._phase(t, now)) for t in own.values() if not t.decided())
        self._queue_claims(own.values(), now)
        return reports

    def _phase(self, t: _Track, now: float) -> int:
        """Where an undecided track stands: holding, waiting for its leader's report, past its deadline."""
        return 0 if now < t.created + self.cfg.hold_s else 1 if now < self._deadline(t) else 2

    def _deadline(self, t: _Track) -> float:
        """When this node reports an undecided track itself: ``defer_s`` after its hold, or after its cover ended."""
        return max(t.created + self.cfg.hold_s, t.uncovered_at) + self.cfg.defer_s

    def _covers(self, c: Claim, track: _Track) -> bool:
        """Whether claim ``c`` says its object is published: a peer's ``reported``, or another track of this node
        that reported it or was covered (this node's own claims are not in its peer table)."""
        if c.node != self.node_id:
            return c.reported
        mine = self._tracks.get(c.track)
        return mine is not None and mine is not track and (mine.report_id is not None or mine.reported)

    def _check_cover(
        self, track: _Track, claim: Claim, index: _ClaimIndex, by_key: dict[tuple[str, int], Claim], now: float
    ) -> None:
        """Suppress ``track`` while a published report matches it; decide it again when none does any more.

        The cover is followed in its newest version while held; once expired, the copy kept here still says
        where the published object was (so the swarm's memory outlasts the claims' expiry).
        """
        cover = None
        if track.cover is not None:
            held = by_key.get(track.cover.key)
            if held is not None and held.first_ms != track.cover.first_ms:
                held = None  # another track under the same id (its node restarted): the copy says what was published
            if held is None or self._covers(held, track):
                candidate = held or track.cover
                if same_object(candidate, claim, self.cfg):
                    cover = candidate
        if cover is None:
            cover = next((c for c in sorted(index.matches(claim), key=owner_order) if self._covers(c, track)), None)
        if cover is not None:
            if not track.suppressed:
                track.suppressed = track.reported = True
                self.stats.suppressed += 1
            track.cover = cover
        elif track.suppressed:
            track.suppressed = track.reported = False
            track.cover = None
            track.uncovered_at = now
            self.stats.uncovered += 1
            self._changed = True

    def _memory_check_due(self, t: _Track, now: float) -> bool:
        if now - t.last_fix > self.cfg.track_timeout_s:
            return not t.end_checked  # once more when the track ends: its last sighting is known then
        return now - max(t.checked_at, t.sent_at) >= self.cfg.claim_refresh_s

    def _keeps_memory(self, track: _Track, members: list[Claim]) -> bool:
        """Whether this suppressed track must gossip its claim so the swarm remembers the object is reported.

        The memory lasts ``window_s`` past the newest reported claim's last sighting; a track that has seen
        the object ``memory_slack_s`` longer than any reported claim this node knows of (its own as sent)
        extends it. Whoever notices first sends; the others then hear a fresh claim and stay quiet.
        """
        newest = -math.inf
        for c in members:
            if c.node == self.node_id:
                sent = self._tracks[c.track].claim
                if sent is not None and sent.reported:
                    newest = max(newest, sent.last_ms)
            elif c.reported:
                newest = max(newest, c.last_ms)
        return track.last_wall * 1000.0 - newest > self.cfg.memory_slack_s * 1000.0

    def flush(self, now: float, wall: float) -> list[FleetObject]:
        """Decide every held track at once (this node is leaving the swarm): what no known report covers is
        reported here, whoever leads it (this node cannot wait for the leader's report any more)."""
        self._flushing = True
        try:
            return self.tick(now, wall)
        finally:
            self._flushing = False

    def outgoing(self) -> list[tuple[bytes, bytes]]:
        """Claims to gossip: (key, payload) pairs for ``Membership.queue_broadcast``."""
        out = list(self._outbox.items())
        self._outbox.clear()
        return out

    def get_timer(self) -> float | None:
        """The next time ``tick`` has something to do besides the ticks that follow ``observe`` and
        ``receive``: a hold or a deferral ending, a claim refresh, an unconfirmed report to hand out again,
        an expiry; None when there is no state."""
        cfg = self.cfg
        times = []
        for t in self._tracks.values():
            if t.hits >= cfg.min_hits and not t.decided():
                times += [t.created + cfg.hold_s, self._deadline(t)]
            elif t.report_id is not None and not t.reported:
                times.append(t.published_at + cfg.claim_refresh_s)
            if t.claim is not None:
                times.append(t.sent_at + cfg.claim_refresh_s)
            times.append(t.last_fix + cfg.window_s)
        silence = min(cfg.window_s, cfg.peer_silence_s)
        for peer in self._peers.values():
            times.extend(h.heard + (cfg.window_s if h.claim.reported else silence) for h in peer.values())
        future = [t for t in times if t > self._now]
        return min(future) if future else None

    # state

    @property
    def tracks(self) -> int:
        return len(self._tracks)

    @property
    def claims_held(self) -> int:
        return sum(len(p) for p in self._peers.values())

    def owned_objects(self) -> dict[str, list[int]]:
        """The objects this node reported (and so owns), each with this node's tracks of it."""
        owned: dict[str, list[int]] = {}
        for t in self._tracks.values():
            if t.report_id is not None:
                owned.setdefault(t.report_id, []).append(t.id)
        return owned

    def track_ids(self) -> set[int]:
        return set(self._tracks)

    def held_claims(self) -> list[Claim]:
        """Every claim this node holds now: its own tracks' and its peers'."""
        own = [t.to_claim(self.node_id) for t in self._tracks.values() if t.hits >= self.cfg.min_hits]
        return own + [h.claim for peer in self._peers.values() for h in peer.values()]

    # internals

    def _start(self, fix: Observation, now: float, wall: float) -> int:
        if len(self._tracks) >= self.cfg.max_tracks:
            # The least recently seen decided track goes first; an undecided one is still decided (reported).
            victim = next((t for t in self._tracks.values() if t.decided()), next(iter(self._tracks.values())))
            del self._tracks[victim.id]
            self._outbox.pop(_track_key(self.node_id, victim.id), None)
            self.stats.tracks_evicted += 1
            self._orphan(victim, wall)
        track = _Track(
            id=self._next_track,
            label=fix.label,
            lat=fix.lat,
            lon=fix.lon,
            alt_m=fix.alt_m,
            var_m2=max(fix.sigma_m, 0.0) ** 2,
            first_wall=wall,
            last_wall=wall,
            created=now,
            last_fix=now,
            score=min(max(fix.score, 0.0), 1.0),
        )
        self._next_track = (self._next_track + 1) & 0xFFFFFFFF
        self._tracks[track.id] = track
        return track.id

    def _update(self, t: _Track, fix: Observation, now: float, wall: float) -> None:
        # A static-object Kalman step per axis: the position may wander by track_noise_m2_s.
        var = t.var_m2 + self.cfg.track_noise_m2_s * max(0.0, now - t.last_fix)
        meas = max(fix.sigma_m, 0.01) ** 2
        gain = var / (var + meas)
        east, north = ground_offset_m(t.lat, t.lon, fix.lat, fix.lon)
        t.lat, t.lon = offset_latlon(t.lat, t.lon, gain * east, gain * north)
        t.alt_m += (fix.alt_m - t.alt_m) / (t.hits + 1)  # the mean ground height of its fixes
        t.var_m2 = (1.0 - gain) * var
        t.last_wall = max(t.last_wall, wall)
        t.last_fix = now
        t.score = max(t.score, min(max(fix.score, 0.0), 1.0))
        t.hits += 1
        self._tracks.move_to_end(t.id)

    def _queue_claims(self, tracks: Any, now: float) -> None:
        """Gossip what peers need: undecided tracks (they may come first in the order) and the objects this
        node reported (so copies are suppressed); a track whose object another node reported stays quiet.

        Called after the decisions of a tick, so a track suppressed at once never costs a byte of gossip
        (with ``share_sightings``, one claim: its object's owner then counts this node in ``seen_by``).
        """
        cfg = self.cfg
        for t in tracks:
            if t.suppressed and not t.memory_due and (t.claim is not None or not cfg.share_sightings):
                continue  # with share_sightings one claim, so the owner learns who else saw its object
            claim = t.to_claim(self.node_id)
            sent = t.claim
            if t.memory_due:
                due, t.memory_due = True, False
            elif sent is None or sent.reported != claim.reported:
                due = True  # new, or its object was just reported: peers must learn it at once
            elif now - t.sent_at >= cfg.claim_refresh_s:
                # Undecided: peers take silence for death. Reported: only while still seen, to extend the memory.
                due = not t.reported or t.last_fix > t.sent_at
            elif not t.reported and now - t.sent_at >= cfg.claim_min_interval_s:
                moved = math.hypot(*ground_offset_m(sent.lat, sent.lon, claim.lat, claim.lon))
                due = moved > max(0.5, sent.sigma_m / 2.0) or claim.score_pm >= sent.score_pm + 50
            else:
                due = False
            if due:
                t.claim = claim
                t.sent_at = now
                self._outbox[claim_key(claim)] = encode_claim(claim)
                self.stats.claims_sent += 1

    def _orphan(self, track: _Track, wall: float) -> None:
        """A track leaves before its decision (evicted, expired): report it on the next tick, on its own."""
        if track.decided() or track.hits < self.cfg.min_hits:
            return
        if len(self._orphans) >= self.cfg.max_tracks:
            self.stats.drop("orphan_cap")  # a flood of undecided tracks between two ticks: bounded memory wins
            return
        self._orphans.append(FleetObject.from_claims([track.to_claim(self.node_id)], self.node_id, wall))
        self.stats.orphan_reports += 1

    def _expire(self, now: float, wall: float) -> None:
        window = self.cfg.window_s
        for tid in [tid for tid, t in self._tracks.items() if now - t.last_fix > window]:
            self._orphan(self._tracks.pop(tid), wall)
            self._changed = True
        for node in list(self._peers):
            claims = self._peers[node]
            silence = min(window, self.cfg.peer_silence_s)
            for track in [k for k, h in claims.items() if now - h.heard > (window if h.claim.reported else silence)]:
                del claims[track]
                self._changed = True
            if not claims:
                del self._peers[node]


def _clamp(value: int, lo: int, hi: int) -> int:
    return lo if value < lo else hi if value > hi else value

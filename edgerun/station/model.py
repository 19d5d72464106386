"""The fleet as the ground station sees it: every node, fleet object, event and rollout, fed from MQTT messages.

Sans-I/O: ``ingest(topic, payload, now)`` takes one message and ``take_delta(now)``
hands back what changed since the last call, so the same code runs in unit tests,
the station and ``edgerun fleet status``. Every payload is untrusted: it is
length-checked, then decoded into the Structs of ``edgerun.wire``, and a bad one
is dropped and counted by reason, never raised. Memory is bounded: at most ``max_nodes`` nodes,
``max_objects`` fleet objects (the least recently seen go first), a trail of
``trail_s`` seconds per node, the last ``max_events`` events.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from edgerun import wire
from edgerun.station.alerts import AlertBook
from edgerun.station.footprint import footprint, pose_from_payload
from edgerun.station.store import Batch, Restored, event_key

MAX_PAYLOAD = 256 * 1024
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
HTTP_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$")  # host:port, nothing else
RESERVED_IDS = wire.RESERVED_NODE_IDS
NODE_TOPICS = wire.NODE_TOPICS
SUBSCRIPTIONS = wire.STATION_SUBSCRIPTIONS
STATION_EVENTS_TOPIC = wire.STATION_EVENTS_TOPIC
# The schema each node topic carries; a message naming another one is dropped as wrong_schema.
NODE_SCHEMAS = {
    "detections": wire.DETECTIONS_SCHEMA,
    "metrics": wire.METRICS_SCHEMA,
    "swarm": wire.SWARM_SCHEMA,
    "events": wire.EVENT_SCHEMA,
}
_RELEASES = wire.RELEASES_PREFIX.split("/")
_ROLLOUTS = wire.ROLLOUTS_PREFIX.split("/")
_OBJECTS = wire.FLEET_OBJECTS_TOPIC.split("/")
_RETIRED = wire.RETIRED_PREFIX.split("/")
_ACKS = wire.ACKS_PREFIX.split("/")
MAX_BOXES = 100
# Rejections that are the release's fault (it does not open, warm up or hash), as opposed to policy or transport.
RELEASE_FAULTS = frozenset({"warmup_failed", "bad_bundle", "hash_mismatch"})
MAX_MEMBERS = 256
T = TypeVar("T")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _text(value: Any, limit: int = 200) -> str:
    return value[:limit] if isinstance(value, str) else ""


# What a node's status says of it once it is gone: "stopped" (a clean stop), "lost" (its will) and "offline"
# (a node older than wire status version 2: either).
GONE = frozenset({"stopped", "lost", "offline"})
# The NodeView fields a store keeps (the node's last state and metadata); the rest is rebuilt from live messages.
RECORD_FIELDS = (
    "status health reasons engine fallback model model_version fps p99_ms dropped detection_rate swarm_seen "
    "last_seen first_seen pose footprint frame http stopping via_swarm"
).split()


@dataclass
class NodeView:
    id: str
    status: str = ""  # "online" | "stopped" | "lost" | "offline" (an old node's either) | "" (never said)
    health: str = ""
    reasons: dict[str, str] = field(default_factory=dict)
    engine: str = ""
    fallback: bool = False
    model: str = ""
    model_version: int | None = None
    fps: float | None = None
    p99_ms: float | None = None
    dropped: int | None = None
    detection_rate: float | None = None  # detections per frame over the last metrics interval
    swarm_members: list[dict[str, Any]] = field(default_factory=list)
    swarm_seen: int | None = None
    last_seen: float = 0.0  # station wall clock of the last message from the node
    first_seen: float = 0.0
    pose: dict[str, float] | None = None
    footprint: list[tuple[float, float]] | None = None
    frame: tuple[int, int] = (0, 0)
    boxes: list[dict[str, Any]] = field(default_factory=list)
    boxes_ts: float = 0.0
    trail: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=600))
    ota: dict[str, Any] = field(default_factory=dict)  # the last ota event
    ota_outcomes: dict[int, str] = field(default_factory=dict)  # version -> committed | rolled_back | rejected:<code>
    http: str = ""
    stopping: bool = False  # said "stopping" before going offline: a clean stop, not a death
    via_swarm: bool = False  # what we show comes from peers' gossip, not from the node's own messages
    _metrics_prev: tuple[float, int, int] | None = None  # (node ts, frames, detections)
    _metrics_version: int | None = None

    swarm_verdict: str = ""  # what the live nodes' swarm views say of this one: "dead", "alive" or ""

    def state(self, now: float, stale_s: float) -> str:
        if self.status == "stopped" or (self.status == "offline" and self.stopping):
            return "stopped"
        if self.status in GONE:
            return "dead"
        if now - self.last_seen > stale_s:
            # Out of the broker's reach is not dead while its swarm still hears it.
            return "dead" if self.swarm_verdict == "dead" else "stale"
        return self.health or ("online" if self.status == "online" else "unknown")

    def to_json(self, now: float, stale_s: float, trail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "state": self.state(now, stale_s),
            "status": self.status,
            "health": self.health,
            "reasons": self.reasons,
            "engine": self.engine,
            "fallback": self.fallback,
            "model": self.model,
            "model_version": self.model_version,
            "fps": self.fps,
            "p99_ms": self.p99_ms,
            "dropped": self.dropped,
            "detection_rate": self.detection_rate,
            "swarm_seen": self.swarm_seen,
            "swarm_members": self.swarm_members[:32],
            "last_seen": self.last_seen,
            "pose": self.pose,
            "footprint": self.footprint,
            "boxes": len(self.boxes),
            "ota": self.ota,
            "via_swarm": self.via_swarm,
        }
        if trail:
            out["trail"] = [[e, n] for _, e, n in self.trail]
        return out

    def to_record(self) -> dict[str, Any]:
        """What a store keeps of the node: its last state and metadata, JSON-ready."""
        out = {name: getattr(self, name) for name in RECORD_FIELDS}
        out["id"] = self.id
        out["ota_outcomes"] = {str(k): v for k, v in self.ota_outcomes.items()}
        out["ota"] = self.ota
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> NodeView:
        """A node as a store kept it; a field that is missing or of the wrong type keeps its default."""
        node = cls(str(record["id"]))
        for name in RECORD_FIELDS:
            value = record.get(name)
            default = getattr(node, name)
            if value is None or (default is not None and not isinstance(value, type(default))):
                if not (isinstance(default, float) and isinstance(value, int)):
                    continue
            setattr(node, name, value)
        frame = record.get("frame")
        if isinstance(frame, list) and len(frame) == 2:
            node.frame = (int(frame[0]), int(frame[1]))
        footprint = record.get("footprint")
        if isinstance(footprint, list):
            node.footprint = [(float(p[0]), float(p[1])) for p in footprint]
        if isinstance(record.get("ota"), dict):
            node.ota = record["ota"]
        outcomes = record.get("ota_outcomes")
        if isinstance(outcomes, dict):
            node.ota_outcomes = {int(k): str(v) for k, v in outcomes.items() if str(k).isdigit()}
        return node


class FleetModel:
    """Everything the station knows, bounded; ``ingest`` never raises on a payload."""

    def __init__(
        self,
        *,
        max_nodes: int = 1000,
        max_objects: int = 5000,
        max_events: int = 500,
        trail_s: float = 300.0,
        stale_s: float = 15.0,
        origin: str = "",
        journal: bool = False,
        alert_labels: frozenset[str] | None = None,
    ) -> None:
        self.max_nodes, self.max_objects, self.max_events = max_nodes, max_objects, max_events
        self.trail_s, self.stale_s = trail_s, stale_s
        self.origin = origin  # this station's id on the station events topic: its own events are already logged
        self.nodes: dict[str, NodeView] = {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.releases: dict[str, bytes] = {}  # model -> retained release message (signed bytes, for re-signing)
        self.rollouts: dict[str, bytes] = {}  # model -> retained rollout state message
        self.dropped: Counter[str] = Counter()
        self.received = 0
        self.broker = {"connected": False, "since": 0.0, "reason": "not connected yet"}
        self._dirty_nodes: set[str] = set()
        self._dirty_objects: set[str] = set()
        self._removed_objects: set[str] = set()
        self._removed_nodes: set[str] = set()
        self._new_events: list[dict[str, Any]] = []
        self._states: dict[str, str] = {}
        self._dirty_meta = True
        self.images: dict[str, dict[str, Any]] = {}  # object id -> the latest image's metadata (the JPEG is stored)
        self.retired: dict[str, dict[str, Any]] = {}  # node -> the retire action in force ({"ts", "by", ...})
        # Retired nodes that spoke again: their retained retire marks are to be cleared (the station publishes).
        self.came_back: list[str] = []
        # Acknowledged objects the model forgot (its bound): their retained ack marks are to be cleared.
        self.forgotten_acks: list[str] = []
        # What a store has not written yet (None: no store; nothing is kept).
        self.journal: Batch | None = Batch() if journal else None
        self._journal_nodes: set[str] = set()
        # A new object alerts every page until an operator acknowledges it (edgerun/station/alerts.py).
        self.alerts = AlertBook(alert_labels, max_alerts=max_objects)

    # -- input ------------------------------------------------------------------------

    def ingest(
        self,
        topic: str,
        payload: bytes,
        now: float | None = None,
        *,
        retained: bool = False,
        props: dict[str, str] | None = None,
    ) -> None:
        """One MQTT message; a bad one is counted in ``dropped[reason]`` and otherwise ignored.

        ``retained``: the broker's stored copy, delivered on subscribing (not news: it does not bring a retired
        node back). ``props``: the message's MQTT 5 user properties.
        """
        now = time.time() if now is None else now
        self.received += 1
        if len(payload) > MAX_PAYLOAD:
            self.dropped["oversized"] += 1
            return
        parts = topic.split("/")
        try:
            if len(parts) == 3 and parts[0] == "edgerun" and parts[1] not in RESERVED_IDS:
                if parts[1] not in self.retired:
                    self._node_message(parts[1], parts[2], payload, now, retained)
                elif not retained:  # a retained copy is the broker's memory of a retired node, not the node speaking
                    try:
                        self._node_message(parts[1], parts[2], payload, now)
                    except _Drop:
                        self.nodes.pop(parts[1], None)  # garbage in its name does not bring it back
                        raise
                    self._unretire(parts[1], now)
            elif len(parts) == 5 and parts[:3] == _OBJECTS and parts[4] == wire.OBJECT_IMAGE_LEAF:
                self._image(parts[3], payload, props or {}, now)
            elif len(parts) == 4 and parts[:3] == _RETIRED:
                self._retire_message(parts[3], payload, now)
            elif len(parts) == 4 and parts[:3] == _ACKS:
                self._ack_message(parts[3], payload)
            elif topic == wire.FLEET_OBJECTS_TOPIC or (len(parts) == 4 and parts[:3] == _OBJECTS):
                self._object(payload, now, retained)  # the stream, or an object's retained latest (a later start)
            elif len(parts) == 4 and parts[:3] == _RELEASES:
                self._release(parts[3], payload)
            elif len(parts) == 4 and parts[:3] == _ROLLOUTS:
                self._rollout(parts[3], payload)
            elif topic == STATION_EVENTS_TOPIC:
                ev = self._decode(payload, wire.StationEvent)
                if not (self.origin and ev.origin == self.origin):
                    self.add_event(
                        now,
                        "station",
                        ev.kind[:200] or "station",
                        ev.text[:500],
                        ev.level[:200] or "info",
                        key=payload_key(payload),
                    )
            else:
                self.dropped["unknown_topic"] += 1
        except _Drop as drop:
            self.dropped[drop.reason] += 1

    def set_broker(self, connected: bool, reason: str, now: float) -> None:
        if connected != self.broker["connected"]:
            text = "connected to the broker" if connected else f"lost the broker: {reason}"
            self.add_event(now, "station", "broker", text, "info" if connected else "error")
        self.broker = {"connected": connected, "since": now, "reason": reason}
        self._dirty_meta = True

    def add_event(
        self, ts: float, node: str, kind: str, text: str, level: str = "info", key: str | None = None
    ) -> None:
        """``key``: what makes the event one and the same for every station that sees it (a store keeps it once);
        None: this station's own observation."""
        event = {"ts": ts, "node": node, "kind": kind, "text": text[:500], "level": level}
        self.events.append(event)
        self._new_events.append(event)
        del self._new_events[: -self.max_events]
        if self.journal is not None:
            key = key or event_key(self.origin, ts, node, kind, text, self.received)
            row = {k: event[k] for k in ("ts", "node", "kind", "text")}
            self.journal.events.append({**row, "key": key, "level": level[:16]})
            del self.journal.events[: -self.max_events * 4]

    # -- parsing ----------------------------------------------------------------------

    @staticmethod
    def _decode(payload: bytes, type_: type[T]) -> T:
        """``payload`` as a ``type_`` (``Any``: any JSON); not JSON or not that shape is ``malformed``."""
        try:
            return msgspec.json.decode(payload, type=type_)
        except (msgspec.DecodeError, RecursionError):  # msgspec raises RecursionError on very deep nesting
            raise _Drop("malformed") from None

    @staticmethod
    def _convert(obj: Any, type_: type[T]) -> T:
        try:
            return msgspec.convert(obj, type_)
        except msgspec.ValidationError:
            raise _Drop("malformed") from None

    def _node(self, node_id: str, now: float) -> NodeView:
        node = self.nodes.get(node_id)
        if node is None:
            if not NODE_ID_RE.match(node_id):
                raise _Drop("bad_node_id")
            if len(self.nodes) >= self.max_nodes:
                # Make room by forgetting the node heard from longest ago, unless even it is still live.
                oldest = min(self.nodes.values(), key=lambda n: n.last_seen)
                if oldest.status == "online" and now - oldest.last_seen <= self.stale_s:
                    raise _Drop("too_many_nodes")
                del self.nodes[oldest.id]
                self._states.pop(oldest.id, None)
                self._dirty_nodes.discard(oldest.id)
                self._removed_nodes.add(oldest.id)
            node = self.nodes[node_id] = NodeView(node_id, first_seen=now)
        return node

    def _node_message(self, node_id: str, kind: str, payload: bytes, now: float, retained: bool = False) -> None:
        """``retained``: the broker's stored copy, of unknown age: it says what the node last said, not that the
        node is there now, so it does not move ``last_seen`` (a restarted station keeps the stored one)."""
        if kind not in NODE_TOPICS:
            raise _Drop("unknown_topic")
        if kind == "status":
            text = wire.decode_status(payload)
            if text is None:
                if not payload and node_id in self.nodes:  # a cleared retained status: the node was retired
                    return
                raise _Drop("malformed")
            node = self._node(node_id, now)
            if text != node.status:
                # Two stations see the same transition within seconds: one event in a shared store.
                key = event_key("status", node_id, text, int(now // 10))
                if text == "online":
                    node.stopping = False
                    self.add_event(now, node_id, "status", "online", key=key)
                elif text == "stopped" or (text == "offline" and node.stopping):
                    self.add_event(now, node_id, "status", "stopped cleanly", key=key)
                else:
                    self.add_event(now, node_id, "status", "offline (last will: connection lost)", "error", key=key)
            node.status = text
            if text == "online" and not retained:
                node.last_seen = now
            self._dirty_nodes.add(node_id)
            return
        head = self._decode(payload, wire.Head)
        if head.node not in (None, node_id) and kind != "swarm":
            raise _Drop("node_mismatch")
        node = self._node(node_id, now)
        if head.schema != NODE_SCHEMAS[kind]:
            raise _Drop("wrong_schema")
        getattr(self, f"_{kind}")(node, payload, now)
        if retained:
            self._dirty_nodes.add(node_id)
            return
        node.last_seen = now
        node.via_swarm = False
        if kind != "swarm" and node.status != "online":
            node.status = "online"  # it speaks, so it is connected (its retained status may lag)
        self._dirty_nodes.add(node_id)

    def _detections(self, node: NodeView, payload: bytes, now: float) -> None:
        doc = self._decode(payload, wire.Detections)
        node.model = doc.model.name[:200] or node.model
        node.model_version = doc.model.version
        node.engine = doc.model.engine[:200] or node.engine
        width, height = doc.frame.width, doc.frame.height
        node.frame = (width, height)
        sent = doc.pose
        pose = None if sent is None else pose_from_payload(msgspec.structs.asdict(sent))
        if pose is not None and sent is not None:
            node.pose = {
                "east_m": pose.east_m,
                "north_m": pose.north_m,
                "up_m": pose.up_m,
                "yaw_deg": pose.yaw_deg,
                "hfov_deg": pose.hfov_deg,
            }
            if sent.lat is not None and sent.lon is not None:
                # The node's own place on Earth, when its frame has one: the map draws it there.
                node.pose.update(lat=sent.lat, lon=sent.lon)
            node.footprint = footprint(pose, width, height) if width and height else None
            self._trail(node, now, pose.east_m, pose.north_m)
        node.boxes = [
            {"label": det.label[:40], "score": det.score, "box": list(det.box)} for det in doc.detections[:MAX_BOXES]
        ]
        node.boxes_ts = now

    def _trail(self, node: NodeView, now: float, east: float, north: float) -> None:
        trail = node.trail
        if trail and now - trail[-1][0] < 1.0:
            return  # one point a second is enough to draw the last minutes
        trail.append((now, round(east, 2), round(north, 2)))
        while trail and now - trail[0][0] > self.trail_s:
            trail.popleft()

    def _metrics(self, node: NodeView, payload: bytes, now: float) -> None:
        doc = self._decode(payload, wire.Metrics)
        s = self._convert(doc.summary, wire.MetricsSummary)
        node.model = s.model[:200] or node.model
        if s.model_version is not None:
            node.model_version = s.model_version
        node.engine = s.engine[:200] or node.engine
        node.health = s.state[:200] or node.health
        node.p99_ms = s.latency_p99_ms
        node.dropped = int(s.dropped) if s.dropped is not None else node.dropped
        if s.http is not None and HTTP_ADDRESS_RE.match(s.http):
            node.http = s.http
        ts, frames, dets = doc.ts, s.frames, s.detections
        if frames is None or dets is None:
            node.fps = s.fps
            return
        prev = node._metrics_prev
        if prev is None:
            node.fps = s.fps  # the node's average since it started, until there are two samples
        elif node._metrics_version != node.model_version:
            # A new model: rates start over, so a canary is judged on its new model only.
            node.fps = node.detection_rate = None
        elif ts > prev[0] and frames >= prev[1]:
            dt, df = ts - prev[0], frames - prev[1]
            node.fps = round(df / dt, 2)
            node.detection_rate = round((dets - prev[2]) / df, 4) if df > 0 else node.detection_rate
        node._metrics_prev = (ts, frames, dets)
        node._metrics_version = node.model_version

    def _events(self, node: NodeView, payload: bytes, now: float) -> None:
        doc = self._decode(payload, dict[str, Any])
        kind = self._convert(doc, wire.EventEnvelope).kind[:40]
        level = "info"
        if kind == "health":
            health = self._convert(doc, wire.HealthEvent)
            node.health = health.state[:200] or node.health
            node.reasons = {k[:40]: v[:200] for k, v in list(health.reasons.items())[:16]}
            node.stopping = node.health == "stopping"
            detail = "; ".join(f"{k}: {v}" for k, v in node.reasons.items())
            text = f"health {node.health}" + (f" ({detail})" if detail else "")
            level = "warn" if node.health == "degraded" else "info"
        elif kind == "engine":
            engine = self._convert(doc, wire.EngineEvent)
            event, to = engine.event[:200], (engine.to or "")[:200]
            node.engine = to or node.engine
            node.fallback = event in ("failover", "start_degraded")
            text = f"engine {event}: {(engine.from_ or '')[:200]} -> {to}"
            if engine.reason:
                text += f" ({engine.reason[:200]})"
            level = "warn" if node.fallback else "info"
        elif kind == "model":
            model = self._convert(doc, wire.ModelEvent)
            node.model = model.name[:200] or node.model
            if model.version is not None:
                node.model_version = model.version
            text = f"model {node.model} v{node.model_version}"
        elif kind == "ota":
            ota = self._convert(doc, wire.OtaEvent)
            step, version, code = ota.step[:40], ota.version, ota.code
            keep = {k: doc[k] for k in ("step", "version", "code", "reason") if doc.get(k) is not None}
            node.ota = {**keep, "ts": now}
            if version is not None and (
                step in ("committed", "rolled_back") or (step == "rejected" and code in RELEASE_FAULTS)
            ):
                # A "failed" step is a link or disk problem, not the release's fault: it does not count here.
                node.ota_outcomes[version] = step if step != "rejected" else f"rejected:{code}"
                if len(node.ota_outcomes) > 16:
                    node.ota_outcomes.pop(min(node.ota_outcomes))
            text = f"ota {step}" + (f" v{version}" if version is not None else "")
            for value in (code, ota.reason):
                if value:
                    text += f" {value[:200]}"
            level = "error" if step in ("rolled_back", "failed") else "info"
        else:
            rest = {k: v for k, v in doc.items() if k not in ("schema", "node", "kind", "ts")}
            text = f"{kind} " + " ".join(
                f"{k}={_text(v, 80) if isinstance(v, str) else v}" for k, v in list(rest.items())[:8]
            )
            level = "error" if rest.get("event") in ("dead", "suspect") or rest.get("kind") == "dead" else "info"
        self.add_event(now, node.id, kind or "event", text, level, key=payload_key(payload))

    def _swarm(self, node: NodeView, payload: bytes, now: float) -> None:
        view = self._decode(payload, wire.SwarmView)
        out: list[dict[str, Any]] = []
        for m in view.members[:MAX_MEMBERS]:
            meta = m.meta or {}
            out.append(
                {
                    "name": m.name[:128],
                    "state": m.state[:20],
                    "incarnation": m.incarnation,
                    "meta": {k: v for k, v in list(meta.items())[:16] if isinstance(v, (str, int, float, bool))},
                }
            )
        node.swarm_members = out
        node.swarm_seen = sum(1 for m in out if m["state"] in ("alive", "suspect") and m["name"] != node.id)
        meta_http = next((m["meta"].get("http") for m in out if m["name"] == node.id), None)
        if isinstance(meta_http, str) and HTTP_ADDRESS_RE.match(meta_http):
            node.http = meta_http
        # Member metadata is gossiped: it shows a node the broker does not hear (out of its reach, or no link).
        for member in out:
            target = node if member["name"] == node.id else None
            if member["name"] in self.retired:
                continue  # gossip about a retired node is not the node speaking
            if target is None and member["meta"] and member["state"] in ("alive", "suspect"):
                try:
                    target = self._node(member["name"], now)
                except _Drop:
                    continue
                if target.status == "online" and now - target.last_seen <= self.stale_s:
                    continue  # heard directly: its own messages are fresher than gossip
                target.via_swarm = True
                self._dirty_nodes.add(target.id)
            if target is not None:
                self._apply_meta(target, member["meta"])

    @staticmethod
    def _apply_meta(node: NodeView, meta: dict[str, Any]) -> None:
        """Fill what the node's own messages have not told us (or told us longest ago) from its swarm metadata."""
        if node.via_swarm:
            node.model = _text(meta.get("model")) or node.model
            version = meta.get("version")
            if isinstance(version, int) and not isinstance(version, bool) and version > 0:
                node.model_version = version
            node.engine = _text(meta.get("engine")) or node.engine
            node.fallback = bool(meta.get("fallback", node.fallback))
            node.health = _text(meta.get("health")) or node.health
            node.fps = _num(meta.get("fps")) if meta.get("fps") is not None else node.fps
        if node.pose is None or node.via_swarm:
            east, north = _num(meta.get("east")), _num(meta.get("north"))
            if east is not None and north is not None:
                node.pose = {
                    "east_m": east,
                    "north_m": north,
                    "up_m": _num(meta.get("up")) or 0.0,
                    "yaw_deg": _num(meta.get("yaw")) or 0.0,
                    "hfov_deg": _num(meta.get("hfov")) or 60.0,
                }

    def _object(self, payload: bytes, now: float, retained: bool = False) -> None:
        doc = self._decode(payload, Any)
        items = doc if isinstance(doc, list) else [doc]
        for item in items[:100]:
            obj = parse_object(item)
            if obj is None:
                self.dropped["bad_object"] += 1
                continue
            if obj["id"] not in self.objects and len(self.objects) >= self.max_objects:
                oldest = min(self.objects, key=lambda k: self.objects[k]["last_seen"])
                del self.objects[oldest]
                self.alerts.forget(oldest)
                self._removed_objects.add(oldest)
                if oldest in self.alerts.acks:
                    self.forgotten_acks.append(oldest)
                    del self.forgotten_acks[:-256]
                self._dirty_objects.discard(oldest)
            known = self.objects.get(obj["id"])
            if retained and known is not None and known["last_seen"] >= obj["last_seen"]:
                continue  # the broker's copy of what we have (a restart): not news, "received" stays
            obj["received"] = now
            if obj["id"] in self.images:
                obj["image_url"] = image_url(obj["id"])
            if self.journal is not None:
                self.journal.object_versions.append(obj)  # every version is kept, the late ones too
                del self.journal.object_versions[: -self.max_objects * 4]
            if known is not None and known["last_seen"] > obj["last_seen"]:
                continue  # a report older than the one shown arrived late (another owner, a retry): not shown
            self.objects[obj["id"]] = obj
            self._dirty_objects.add(obj["id"])
            self._removed_objects.discard(obj["id"])
            self.alerts.observe(obj, now)

    def _release(self, model: str, payload: bytes) -> None:
        if not payload:
            self.releases.pop(model, None)
        elif len(self.releases) < 64 or model in self.releases:
            self.releases[model] = payload
        self._dirty_meta = True
        self._journal_rollout(model)

    def _rollout(self, model: str, payload: bytes) -> None:
        if not payload:
            self.rollouts.pop(model, None)
        elif len(self.rollouts) < 64 or model in self.rollouts:
            self.rollouts[model] = payload
        self._dirty_meta = True
        self._journal_rollout(model)

    def _journal_rollout(self, model: str) -> None:
        if self.journal is not None and len(model) <= 200:
            self.journal.rollouts[model] = (self.releases.get(model), self.rollouts.get(model))

    def _image(self, object_id: str, payload: bytes, props: dict[str, str], now: float) -> None:
        """An object's picture: a JPEG of at most MAX_IMAGE bytes from its owner, the box and score beside it."""
        if not OBJECT_ID_RE.match(object_id):
            raise _Drop("bad_image")
        if not payload:
            return  # a cleared retained image
        if len(payload) > wire.MAX_OBJECT_IMAGE or payload[:3] != JPEG_MAGIC:
            raise _Drop("bad_image")
        node = props.get("node", "")
        if not NODE_ID_RE.match(node):
            raise _Drop("bad_image")
        ts, score = _float_prop(props.get("ts")), _float_prop(props.get("score"))
        box = props.get("box", "")
        values = [_float_prop(v) for v in box.split(",")] if box else []
        if ts is None or (box and (len(values) != 4 or None in values)) or (score is not None and not 0 <= score <= 1):
            raise _Drop("bad_image")
        current = self.images.get(object_id)
        if current is not None and ts < current["ts"]:
            return  # an older view than the one we keep
        if current is None and len(self.images) >= self.max_objects:
            oldest = min(self.images, key=lambda k: self.images[k]["received"])
            del self.images[oldest]
        self.images[object_id] = {"node": node, "score": score, "box": box[:200], "ts": ts, "received": now}
        obj = self.objects.get(object_id)
        if obj is not None and "image_url" not in obj:
            obj["image_url"] = image_url(object_id)
            self._dirty_objects.add(object_id)
            self.alerts.observe(obj, now)  # the alert shows the picture too
        if self.journal is not None:
            self.journal.images.append({"object_id": object_id, "jpeg": payload, **self.images[object_id]})
            del self.journal.images[:-64]  # 64 pictures of 64 KiB at most wait for the writer

    def _retire_message(self, node_id: str, payload: bytes, now: float) -> None:
        if not payload:
            return  # a cleared retire marker
        if not NODE_ID_RE.match(node_id) or node_id in RESERVED_IDS:
            raise _Drop("bad_node_id")
        doc = self._decode(payload, wire.RetireNode)
        if doc.node != node_id:
            raise _Drop("node_mismatch")
        node = self.nodes.get(node_id)
        if node is not None and node.last_seen > doc.ts:
            return  # it spoke after the operator retired it: it is back
        self.retire(node_id, doc.ts, doc.by[:128] or "operator", doc.reason[:200], key=payload_key(payload))

    # -- operator actions ---------------------------------------------------------------------

    def retire(self, node_id: str, ts: float, by: str, reason: str = "", key: str | None = None) -> bool:
        """Take a node off the fleet view (it comes back when it speaks again); False when it was already off."""
        if node_id in self.retired:
            return False
        self.retired[node_id] = {"ts": ts, "by": by, "reason": reason}
        if self.nodes.pop(node_id, None) is not None:
            self._removed_nodes.add(node_id)
        self._states.pop(node_id, None)
        self._dirty_nodes.discard(node_id)
        self.add_event(ts, node_id, "retired", f"retired by {by}" + (f": {reason}" if reason else ""), key=key)
        self.record_action("retire", node_id, by, ts, {"reason": reason}, key=key)
        return True

    def record_action(
        self, kind: str, target: str, by: str, ts: float, detail: dict[str, Any], key: str | None = None
    ) -> None:
        """An operator's action (``retire``; ``ack`` of an alert) for the store: who, when, on what. ``key``: the
        same for every station that learns of the same action, so a shared store keeps it once."""
        if self.journal is not None:
            self.journal.actions.append(
                {
                    "key": key or event_key(kind, target, ts, by),
                    "ts": ts,
                    "kind": kind[:40],
                    "target": target[:200],
                    "by": by[:128],
                    "detail": msgspec.json.encode(detail).decode(),
                }
            )

    def _ack_message(self, object_id: str, payload: bytes) -> None:
        if not payload:
            return  # a cleared mark
        if not OBJECT_ID_RE.match(object_id):
            raise _Drop("bad_ack")
        doc = self._decode(payload, wire.AlertAck)
        if doc.object != object_id:
            raise _Drop("bad_ack")
        self.ack(object_id, doc.by[:128] or "operator", doc.ts, key=payload_key(payload))

    def ack(self, object_id: str, by: str, ts: float, key: str | None = None) -> bool:
        """An operator acknowledged the alert of ``object_id`` (here, or on another station through the retained
        mark): every page stops alerting and shows who and when. False: it was acknowledged already."""
        if not self.alerts.ack(object_id, by, ts):
            return False
        label = self.objects.get(object_id, {}).get("label", "object")
        self.add_event(ts, "station", "alert", f"{label} {object_id} acknowledged by {by}", key=key)
        self.record_action("ack", object_id, by, ts, {}, key=key)
        return True

    def _unretire(self, node_id: str, now: float) -> None:
        self.retired.pop(node_id, None)
        self.add_event(now, node_id, "retired", "back: it spoke again after it was retired")
        self.came_back.append(node_id)
        del self.came_back[:-64]

    def restore(self, restored: Restored) -> None:
        """Start from what a store kept (before the first message): the same page as before the restart."""
        for obj in restored.objects[-self.max_objects :]:
            if isinstance(obj, dict) and isinstance(obj.get("id"), str):
                self.objects[obj["id"]] = obj
        for oid, meta in restored.images.items():
            self.images[oid] = {**meta, "box": "", "received": meta.get("ts") or 0.0}
            if oid in self.objects:
                self.objects[oid]["image_url"] = image_url(oid)
        for record in restored.nodes[: self.max_nodes]:
            if record["id"] in restored.retired:
                continue
            try:
                node = NodeView.from_record(record)
            except (KeyError, TypeError, ValueError):
                self.dropped["bad_stored_node"] += 1
                continue
            node.via_swarm = False
            self.nodes[node.id] = node
        for event in restored.events[-self.max_events :]:
            self.events.append({k: event[k] for k in ("ts", "node", "kind", "text", "level")})
        for model, (release, rollout) in restored.rollouts.items():
            if release:
                self.releases[model] = release
            if rollout:
                self.rollouts[model] = rollout
        self.retired.update(restored.retired)
        for object_id, ack in restored.acks.items():
            self.alerts.ack(object_id, ack["by"], ack["ts"])
        for obj in self.objects.values():  # known before the restart: alerting still only if nobody acknowledged
            self.alerts.observe(obj, float(obj.get("received") or 0.0), restored=True)
        self._dirty_meta = True

    def take_journal(self) -> Batch | None:
        """What a store should write since the last call (None without a store, or when nothing changed)."""
        if self.journal is None:
            return None
        batch, self.journal = self.journal, Batch()
        changed = self._journal_nodes | self._dirty_nodes  # take_delta moves the dirty ones here as it clears them
        batch.nodes = [self.nodes[k].to_record() for k in changed if k in self.nodes]
        self._journal_nodes = set()
        return batch if batch else None

    # -- output -----------------------------------------------------------------------

    def _judge_by_swarm(self, now: float) -> None:
        """A node is dead by the swarm when a live peer's view says dead and none says alive."""
        said: dict[str, set[str]] = {}
        for reporter in self.nodes.values():
            if reporter.status in GONE or now - reporter.last_seen > self.stale_s:
                continue
            for member in reporter.swarm_members:
                if member["name"] != reporter.id:
                    said.setdefault(member["name"], set()).add(member["state"])
        for node_id, node in self.nodes.items():
            states = said.get(node_id, set())
            if states & {"alive", "suspect"}:
                node.swarm_verdict = "alive"
            elif states & {"dead", "left"}:
                node.swarm_verdict = "dead"
            else:
                node.swarm_verdict = ""

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        self._judge_by_swarm(now)
        return {
            "ts": now,
            "broker": self.broker,
            "nodes": {k: n.to_json(now, self.stale_s, trail=True) for k, n in self.nodes.items()},
            "objects": list(self.objects.values()),
            "events": list(self.events),
            "dropped": dict(self.dropped),
            "stale_s": self.stale_s,
            "alerts": self.alerts.to_json(),
        }

    def take_delta(self, now: float | None = None) -> dict[str, Any] | None:
        """What changed since the last call (nodes whose data or derived state changed), or None."""
        now = time.time() if now is None else now
        self._judge_by_swarm(now)
        for node_id, node in self.nodes.items():
            state = node.state(now, self.stale_s)
            if self._states.get(node_id) != state:
                if self._states.get(node_id) is not None and state == "stale":
                    self.add_event(now, node_id, "status", f"stale: nothing heard for {self.stale_s:g} s", "warn")
                self._states[node_id] = state
                self._dirty_nodes.add(node_id)
        if self.journal is not None:
            self._journal_nodes |= self._dirty_nodes
        if not (
            self._dirty_nodes
            or self._dirty_objects
            or self._removed_objects
            or self._new_events
            or self._dirty_meta
            or self._removed_nodes
            or self.alerts.changed
        ):
            return None
        delta: dict[str, Any] = {"ts": now}
        if self._dirty_nodes:
            delta["nodes"] = {k: self.nodes[k].to_json(now, self.stale_s) for k in self._dirty_nodes if k in self.nodes}
        if self._dirty_objects:
            delta["objects"] = [self.objects[k] for k in self._dirty_objects if k in self.objects]
        if self._removed_objects:
            delta["removed_objects"] = sorted(self._removed_objects)
        if self._removed_nodes:
            delta["removed_nodes"] = sorted(self._removed_nodes)
            self._removed_nodes = set()
        if self._new_events:
            delta["events"] = self._new_events
        if self.alerts.changed:
            delta["alerts"] = self.alerts.take_changed()
        if self._dirty_meta:
            delta["broker"] = self.broker
            delta["dropped"] = dict(self.dropped)
        self._dirty_nodes, self._dirty_objects, self._removed_objects = set(), set(), set()
        self._new_events, self._dirty_meta = [], False
        return delta


JPEG_MAGIC = b"\xff\xd8\xff"
OBJECT_ID_RE = NODE_ID_RE  # object ids travel in topic levels, as node ids do


def image_url(object_id: str) -> str:
    return f"/api/objects/{object_id}/image"


def payload_key(payload: bytes) -> str:
    """The same message seen by two stations: one row in a shared store."""
    return hashlib.sha256(payload).hexdigest()[:40]


def _float_prop(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


class _Drop(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


def parse_object(item: Any) -> dict[str, Any] | None:
    """One fleet object (``edgerun.object/2``, or ``/1`` for one more release), normalised, or None when a
    required field is missing or wrong.

    The map draws in a scene's local metres: a version 2 object gives its owner's east/north when it has
    them; one that does not has lat/lon only (shown in the table, not on the local map).
    """
    try:
        obj = msgspec.convert(item, wire.ObjectReport)
    except msgspec.ValidationError:
        return None
    if isinstance(obj.seen_by, list):
        seen = [str(s)[:128] for s in obj.seen_by[:64]]
        seen_count = len(seen)
    else:
        seen, seen_count = [], obj.seen_by or 0
    return {
        "id": str(obj.id)[:128],
        "label": obj.label[:40],
        "east_m": None if obj.east_m is None else round(obj.east_m, 2),
        "north_m": None if obj.north_m is None else round(obj.north_m, 2),
        "lat": obj.lat,
        "lon": obj.lon,
        "alt_m": obj.alt_m,
        "uncertainty_m": max(0.0, obj.uncertainty_m or 0.0),
        "first_seen": obj.first_seen,
        "last_seen": obj.last_seen if obj.last_seen is not None else (obj.first_seen or 0.0),
        "score": obj.score,
        "owner": obj.owner[:128],
        "seen_by": seen,
        "seen_count": seen_count,
    }

"""The wire: every MQTT topic, schema id, envelope and payload a node, the station and the tools exchange.

Producers encode through the Structs here and consumers decode through them, so a field is named,
typed and bounded in one place. Within a version, fields may be added (decoders ignore fields they do
not know); renaming, retyping or removing one bumps the version.

Topics (``<node>`` is the node id; ``edgerun/<node>/`` is a node's default prefix)::

    edgerun/<node>/detections         Detections  (edgerun.detections/1), one per frame, expires at the broker
    edgerun/<node>/events             an event    (edgerun.event/1): health, engine, model, ota, swarm ...
    edgerun/<node>/status             text, retained (status version 2): "online"; a clean stop says "stopped",
                                      the will "lost" (version 1 said "offline" for both: still read)
    edgerun/<node>/metrics            Metrics     (edgerun.metrics/1), periodic
    edgerun/<node>/swarm              SwarmView   (edgerun.swarm/1), retained
    edgerun/fleet/objects             FleetObject (edgerun.object/2: lat/lon), reported by the object's owner
    edgerun/fleet/objects/<id>        the same, the latest of each object, retained (expires after a day)
    edgerun/fleet/objects/<id>/image  a JPEG crop of the object's best detection (at most 64 KiB, retained); MQTT 5
                                      user properties node, score, box ("x0,y0,x1,y1" source pixels), ts (frame time)
    edgerun/fleet/retired/<node>      RetireNode (edgerun.retire/1, retained): an operator took the node off the fleet
    edgerun/fleet/acks/<object id>    AlertAck (edgerun.ack/1, retained): an operator acknowledged the object's alert
    edgerun/fleet/releases/<model>    the signed release (edgerun.ota.release/1, retained); files below it
    edgerun/fleet/rollouts/<model>    RolloutEnvelope (edgerun.rollout/1, retained, signed)
    edgerun/station/events            a station's events (edgerun.event/1, node "station")

The event envelope, one rule for every sink: ``schema``, ``node``, ``kind`` and ``ts`` are always
present and always the envelope's; the event's data adds fields beside them but never overrides one.

Untrusted bytes: check the length first, then ``msgspec.json.decode(payload, type=...)``; a
``msgspec.DecodeError`` (``ValidationError`` is one) means drop and count, never raise further.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

from swarm.dedup import OBJECT_SCHEMA as OBJECT_SCHEMA  # swarm builds objects itself and never imports edgerun

# Version 1 of fleet objects (east_m/north_m in each drone's own frame, no lat/lon): still read by the station,
# `edgerun listen` and the export for one release, so a fleet can be upgraded node by node.
OBJECT_SCHEMA_V1: Final = "edgerun.object/1"

# -- schema ids ---------------------------------------------------------------------------------

# Final: the type checker reads each as its literal, so the Structs' Literal schema fields take them as defaults.
DETECTIONS_SCHEMA: Final = "edgerun.detections/1"
EVENT_SCHEMA: Final = "edgerun.event/1"
METRICS_SCHEMA: Final = "edgerun.metrics/1"
SWARM_SCHEMA: Final = "edgerun.swarm/1"
ROLLOUT_SCHEMA: Final = "edgerun.rollout/1"
RELEASE_SCHEMA: Final = "edgerun.ota.release/1"

# -- topics -------------------------------------------------------------------------------------

# Node topic keys in the order MQTT topic aliases are handed out (the busiest first).
NODE_ALIAS_KEYS = ("detections", "metrics", "events", "status")
NODE_TOPICS = ("detections", "events", "status", "metrics", "swarm")
FLEET_OBJECTS_TOPIC = "edgerun/fleet/objects"
FLEET_OBJECTS_RETAINED = FLEET_OBJECTS_TOPIC + "/+"  # <fleet topic>/<object id>: each object's latest, retained
OBJECT_IMAGE_LEAF = "image"
FLEET_OBJECT_IMAGES = FLEET_OBJECTS_TOPIC + "/+/" + OBJECT_IMAGE_LEAF
MAX_OBJECT_IMAGE = 64 * 1024
RETIRED_PREFIX = "edgerun/fleet/retired"
ACKS_PREFIX = "edgerun/fleet/acks"
RELEASES_PREFIX = "edgerun/fleet/releases"
ROLLOUTS_PREFIX = "edgerun/fleet/rollouts"
STATION_EVENTS_TOPIC = "edgerun/station/events"
RESERVED_NODE_IDS = frozenset({"fleet", "station"})  # second topic levels that are not nodes
STATION_SUBSCRIPTIONS = [f"edgerun/+/{key}" for key in NODE_TOPICS] + [
    FLEET_OBJECTS_TOPIC,
    FLEET_OBJECTS_RETAINED,
    FLEET_OBJECT_IMAGES,
    f"{RETIRED_PREFIX}/+",
    f"{ACKS_PREFIX}/+",
    f"{RELEASES_PREFIX}/+",
    f"{ROLLOUTS_PREFIX}/+",
]
STATUS_ONLINE = b"online"
STATUS_STOPPED = b"stopped"  # a clean shutdown (status version 2)
STATUS_LOST = b"lost"  # the last will: the broker lost the node's connection (status version 2)
STATUS_OFFLINE = b"offline"  # status version 1: either of the two, for nodes not yet upgraded
STATUS_WORDS = ("online", "stopped", "lost", "offline")


def node_topic_prefix(node_id: str) -> str:
    return f"edgerun/{node_id}/"


def node_topic(node_id: str, key: str) -> str:
    return f"edgerun/{node_id}/{key}"


def object_image_topic(object_id: str, fleet_topic: str = FLEET_OBJECTS_TOPIC) -> str:
    """Where the owner of ``object_id`` publishes its picture (``sinks.mqtt.fleet_topic`` may move the fleet)."""
    return f"{fleet_topic}/{object_id}/{OBJECT_IMAGE_LEAF}"


def retired_topic(node_id: str) -> str:
    return f"{RETIRED_PREFIX}/{node_id}"


def ack_topic(object_id: str) -> str:
    return f"{ACKS_PREFIX}/{object_id}"


def release_topic(model: str) -> str:
    return f"{RELEASES_PREFIX}/{model}"


def release_file_topic(model: str, file: str, part: str) -> str:
    return f"{RELEASES_PREFIX}/{model}/files/{file}/{part}"


def rollout_topic(model: str) -> str:
    return f"{ROLLOUTS_PREFIX}/{model}"


# -- field types --------------------------------------------------------------------------------

# NaN and the infinities fail these bounds (JSON cannot carry them; Python objects can).
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
Name = Annotated[str, msgspec.Meta(min_length=1)]
TraceId = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]  # W3C trace id: 32 lowercase hex characters

# -- edgerun.detections/1 (edgerun/schema/detections-v1.json) -----------------------------------


class Frame(msgspec.Struct):
    width: Count
    height: Count
    source: str


class ModelRef(msgspec.Struct):
    name: str
    version: Count
    engine: str


class Pose(msgspec.Struct, omit_defaults=True):
    """Camera pose in the swarm's local east/north/up frame (metres) and attitude (degrees); where the node's
    frame has a place on Earth, also the camera's own position there (WGS84 degrees, metres above mean sea level),
    so a station draws the drone at its lat/lon whatever frame it flies in. Absent: a frame not on the map."""

    east_m: float
    north_m: float
    up_m: float
    yaw_deg: float
    pitch_deg: float
    roll_deg: float
    hfov_deg: float
    lat: Latitude | None = None
    lon: Longitude | None = None
    alt_m: Finite | None = None


class Detection(msgspec.Struct, omit_defaults=True):
    label: str
    class_id: int
    score: Fraction
    box: tuple[float, float, float, float]  # x1, y1, x2, y2, source-frame pixels
    keypoints: list[tuple[float, float]] | None = None  # only for models with keypoints


class Detections(msgspec.Struct, kw_only=True):
    """One frame's detections."""

    schema: Literal["edgerun.detections/1"] = DETECTIONS_SCHEMA
    node: str
    seq: Count
    ts: float  # wall-clock capture time, Unix seconds
    frame: Frame
    model: ModelRef
    latency_ms: NonNegative | None  # capture to the sink, None when unknown
    pose: Pose | None
    detections: list[Detection]
    # The OpenTelemetry trace of this frame, present only when the node traced it ([tracing], sampled): an operator
    # goes from a find to its trace in Jaeger or Tempo with it. Absent (not null) otherwise, so older payloads
    # and older readers stay valid.
    trace_id: TraceId | msgspec.UnsetType = msgspec.UNSET


# -- edgerun.object/2 (edgerun/schema/object-v2.json) -------------------------------------------

Latitude = Annotated[float, msgspec.Meta(ge=-90.0, le=90.0)]
Longitude = Annotated[float, msgspec.Meta(ge=-180.0, le=180.0)]


class FleetObject(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One object on the ground, as its owner reports it (swarm.dedup.FleetObject.to_payload, plus the owner's
    local east/north and their ``origin`` from edgerun.fleet.service)."""

    # Required, not defaulted: omit_defaults (so an absent east/north is no null) would drop a default schema.
    schema: Literal["edgerun.object/2"]
    id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{16}$")]
    label: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    lat: Latitude
    lon: Longitude
    alt_m: Finite  # the ground's height above mean sea level
    uncertainty_m: NonNegative
    first_seen: float
    last_seen: float
    score: Fraction
    owner: Name
    seen_by: Annotated[list[Name], msgspec.Meta(min_length=1)]
    ts: float
    east_m: Finite | None = None  # convenience: metres east/north of origin = [lat, lon, alt_m]
    north_m: Finite | None = None
    origin: Annotated[list[Finite], msgspec.Meta(min_length=3, max_length=3)] | None = None

    def __post_init__(self) -> None:
        if len(set(self.seen_by)) != len(self.seen_by):
            raise ValueError("seen_by names a node twice")
        if (self.east_m is None) != (self.north_m is None) or (self.east_m is not None and self.origin is None):
            raise ValueError("east_m and north_m come together, with their origin")


class ObjectReport(msgspec.Struct):
    """What the station and the tools accept as a fleet object: the fields they show, from any producer of
    version 2 (lat/lon) or version 1 (east/north only).

    Looser than FleetObject on purpose: an id may be a number and ``seen_by`` a count.
    """

    id: str | int
    label: str
    schema: Literal["edgerun.object/2", "edgerun.object/1"] | None = None  # None: either position will do
    lat: Latitude | None = None
    lon: Longitude | None = None
    alt_m: Finite | None = None
    east_m: Finite | None = None
    north_m: Finite | None = None
    uncertainty_m: Finite | None = None
    first_seen: Finite | None = None
    last_seen: Finite | None = None
    score: Finite | None = None
    owner: str = ""
    seen_by: list[Any] | int | None = None

    def __post_init__(self) -> None:
        local, geo = self.east_m is not None and self.north_m is not None, self.lat is not None and self.lon is not None
        if self.schema == OBJECT_SCHEMA_V1 and not local:
            raise ValueError("edgerun.object/1 needs east_m and north_m")
        if self.schema == OBJECT_SCHEMA and not geo:
            raise ValueError("edgerun.object/2 needs lat and lon")
        if not (local or geo):
            raise ValueError("a fleet object needs lat/lon or east_m/north_m")


# -- the picture of a fleet object (<fleet topic>/<id>/image) -------------------------------------

OBJECT_IMAGE_CONTENT_TYPE = "image/jpeg"
OBJECT_IMAGE_MAX_BYTES = 64 * 1024  # a node never publishes more; a reader drops a larger payload
OBJECT_IMAGE_MAX_SIDE_PX = 320


class ObjectImageMeta(msgspec.Struct, frozen=True):
    """What the MQTT 5 user properties of an object image say: who took it, how sure, where in the frame.

    ``box`` is the detection's x0, y0, x1, y1 in the source frame's pixels (the JPEG is a crop around it,
    the box drawn); ``ts`` the frame's capture time (Unix seconds).
    """

    node: Name
    score: Fraction
    box: tuple[Finite, Finite, Finite, Finite]
    ts: Finite

    def to_properties(self) -> list[tuple[str, str]]:
        return [
            ("node", self.node),
            ("score", f"{self.score:.3f}"),
            ("box", ",".join(f"{v:.1f}" for v in self.box)),
            ("ts", f"{self.ts:.3f}"),
        ]

    @classmethod
    def from_properties(cls, pairs: list[tuple[str, str]]) -> ObjectImageMeta:
        """From a received message's ``UserProperty`` list; ValueError naming the property that is wrong."""
        found = dict(pairs)
        missing = [key for key in ("node", "score", "box", "ts") if key not in found]
        if missing:
            raise ValueError(f"object image: user property {missing[0]!r} missing")
        try:
            box = tuple(float(v) for v in found["box"].split(","))
        except ValueError:
            raise ValueError(f"object image: box {found['box'][:40]!r} is not four numbers") from None
        if len(box) != 4:
            raise ValueError(f"object image: box has {len(box)} numbers, expected 4")
        try:
            score, ts = float(found["score"]), float(found["ts"])
        except ValueError:
            raise ValueError("object image: score and ts must be numbers") from None
        try:
            return msgspec.convert({"node": found["node"], "score": score, "box": box, "ts": ts}, cls)
        except msgspec.ValidationError as err:
            raise ValueError(f"object image: {describe(err)}") from None


# -- edgerun.swarm/1 ----------------------------------------------------------------------------


class SwarmMember(msgspec.Struct, kw_only=True):
    name: str
    addr: str = ""
    state: str  # alive, suspect, dead, left
    incarnation: int | None = None
    meta: dict[str, Any] | None = None  # edgerun.fleet.member_meta.MemberMeta as JSON, None if it did not decode


class SwarmView(msgspec.Struct, kw_only=True):
    """A node's view of its swarm (retained; also its /healthz ``swarm``)."""

    schema: Literal["edgerun.swarm/1"] = SWARM_SCHEMA
    node: str
    ts: float = 0.0
    members: list[SwarmMember]


# -- edgerun.metrics/1 --------------------------------------------------------------------------


class Metrics(msgspec.Struct, kw_only=True):
    """A node's periodic summary (``Node.summary``) and its MQTT sink's counters."""

    schema: Literal["edgerun.metrics/1"] = METRICS_SCHEMA
    node: str
    ts: float
    summary: dict[str, Any]
    mqtt: dict[str, Any] = {}


class MetricsSummary(msgspec.Struct):
    """The fields of ``Metrics.summary`` a reader relies on (Node.summary has more)."""

    model: str = ""
    model_version: int | None = None
    engine: str = ""
    state: str = ""
    frames: Count | None = None
    detections: Count | None = None
    fps: Finite | None = None
    latency_p99_ms: Finite | None = None
    dropped: Finite | None = None
    http: str | None = None  # host:port of the node's HTTP service


# -- edgerun.event/1 ----------------------------------------------------------------------------


class EventEnvelope(msgspec.Struct):
    """The fields every event has; its data sits beside them in the same object."""

    schema: Literal["edgerun.event/1"] = EVENT_SCHEMA
    node: str | None = None
    kind: str = ""
    ts: Finite | None = None


class HealthEvent(msgspec.Struct):
    state: str = ""
    reasons: dict[str, str] = {}


class EngineEvent(msgspec.Struct):
    event: str = ""
    from_: str | None = msgspec.field(default=None, name="from")
    to: str | None = None
    reason: str | None = None


class ModelEvent(msgspec.Struct):
    name: str = ""
    version: int | None = None


class OtaEvent(msgspec.Struct):
    step: str = ""
    version: int | None = None
    code: str | None = None
    reason: str | None = None


class StationEvent(msgspec.Struct):
    kind: str = ""
    text: str = ""
    level: str = "info"
    origin: str = ""


EVENT_DATA: dict[str, type[msgspec.Struct]] = {
    "health": HealthEvent,
    "engine": EngineEvent,
    "model": ModelEvent,
    "ota": OtaEvent,
}


def event_payload(node: str, kind: str, data: Mapping[str, Any], ts: float | None = None) -> dict[str, Any]:
    """An ``edgerun.event/1`` object: the envelope, then the data's other fields (the envelope wins)."""
    payload: dict[str, Any] = {
        "schema": EVENT_SCHEMA,
        "node": node,
        "kind": kind,
        "ts": time.time() if ts is None else ts,
    }
    for key, value in data.items():
        payload.setdefault(key, value)
    return payload


# -- edgerun.rollout/1 and edgerun.ota.release/1 ------------------------------------------------


class RolloutEnvelope(msgspec.Struct, kw_only=True):
    """The retained rollout state: canonical JSON of the state (base64) and its minisign signature."""

    schema: Literal["edgerun.rollout/1"] = ROLLOUT_SCHEMA
    state: str
    sig: str


class RolloutStateDoc(msgspec.Struct, kw_only=True):
    """The signed state inside a RolloutEnvelope (edgerun.fleet.rollout.RolloutState)."""

    model: str
    version: int
    percent: float
    salt: str
    phase: str
    reason: str = ""
    by: str = ""
    ts: float = 0.0
    base_version: int | None = None
    step: int = 0


class ReleaseEnvelope(msgspec.Struct, kw_only=True):
    """The retained release message (edgerun.ota.transport_mqtt): base64 manifest and keys, their signatures."""

    keys: str | None = None
    keys_sig: str | None = None
    manifest: str
    manifest_sig: str
    schema: Literal["edgerun.ota.release/1"] = RELEASE_SCHEMA


# -- status -------------------------------------------------------------------------------------


def decode_status(payload: bytes) -> str | None:
    """``online``, ``stopped``, ``lost`` or (version 1, either of the two) ``offline``; None for anything else."""
    if len(payload) > 32:
        return None
    text = payload.decode("utf-8", "replace").strip()
    return text if text in STATUS_WORDS else None


# -- edgerun.retire/1 ---------------------------------------------------------------------------

RETIRE_SCHEMA: Final = "edgerun.retire/1"


class RetireNode(msgspec.Struct, kw_only=True):
    """An operator took a node off the fleet view (``edgerun fleet retire``, the station page); retained, so a
    station started later knows. The node comes back when it speaks again after ``ts``."""

    schema: Literal["edgerun.retire/1"] = RETIRE_SCHEMA
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    ts: Finite
    by: Annotated[str, msgspec.Meta(max_length=128)] = ""
    reason: Annotated[str, msgspec.Meta(max_length=500)] = ""


ACK_SCHEMA: Final = "edgerun.ack/1"


class AlertAck(msgspec.Struct, kw_only=True):
    """An operator acknowledged the alert a new fleet object raised (the station page); retained, so every
    station, and one started later, stops alerting for it and shows who and when."""

    schema: Literal["edgerun.ack/1"] = ACK_SCHEMA
    object: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    ts: Finite
    by: Annotated[str, msgspec.Meta(max_length=128)] = ""


# -- decoding helpers ---------------------------------------------------------------------------


class Head(msgspec.Struct):
    """The two fields a consumer checks before it decodes the rest: which schema, from which node."""

    schema: Any = None
    node: Any = None


def describe(err: msgspec.DecodeError) -> str:
    """``detections[0].score: Expected `float` <= 1.0`` from msgspec's ``... - at `$.detections[0].score```."""
    text = str(err)
    message, sep, where = text.rpartition(" - at `$")
    if not sep:
        return text
    path = where.rstrip("`").lstrip(".")
    return f"{path}: {message}" if path else message

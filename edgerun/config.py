"""Typed node configuration, read from TOML and validated strictly.

Every section is a msgspec Struct that forbids unknown keys; every field has a
default that works on a Raspberry Pi or is required. Validation errors are
turned into one line naming the key path, what was expected and what was found:
``pipeline.queue_depth: expected int >= 1, got 0``.
"""

from __future__ import annotations

import math
import re
import socket
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from edgerun import wire
from edgerun.errors import ConfigError
from edgerun.tomlfile import load_toml
from swarm.geo import DEFAULT_ANCHOR

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for config sections: unknown keys are errors."""


class NodeConfig(Section):
    id: str = ""  # empty: the host name
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class ReplayConfig(Section):
    seed: int = 1
    width: PositiveInt = 640
    height: PositiveInt = 480
    frames: NonNegInt = 0  # 0: fly forever (the path loops)
    altitude_m: PositiveFloat = 6.0
    speed_mps: NonNegFloat = 1.5
    hfov_deg: Annotated[float, msgspec.Meta(gt=1.0, lt=170.0)] = 60.0
    scene: str = ""  # empty: the built-in scene made from scikit-image's photos
    # One scene, several drones: each flies the seed's path from its own start and a little to the side.
    path_offset_m: float = 0.0  # start this far along the flight path from the seeded start (negative: behind)
    east_offset_m: float = 0.0  # the whole path shifted east (metres)
    north_offset_m: float = 0.0  # ... and north
    # Where the scene lies on Earth: [lat, lon] (WGS84) of its local origin and the AMSL height of its flat ground,
    # so fleet objects carry true lat/lon. Default swarm.geo.DEFAULT_ANCHOR: a field near Llanberis, Snowdonia.
    origin: list[float] = msgspec.field(default_factory=lambda: list(DEFAULT_ANCHOR[:2]))
    ground_alt_m: float = DEFAULT_ANCHOR[2]


class PoseConfig(Section):
    """Live camera pose from an autopilot (edgerun/sources/pose_mavlink.py); replays carry their own pose."""

    kind: Literal["none", "mavlink"] = "none"
    # "udpin:HOST:PORT" (listen for the autopilot's UDP stream) or a serial port "DEVICE,BAUD" ("/dev/ttyAMA0,57600").
    url: str = "udpin:127.0.0.1:14550"
    system_id: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0  # the autopilot's MAVLink system id; 0: the first heard
    mount: Literal["fixed", "gimbal"] = "fixed"  # fixed: looks down the body's z axis; gimbal: its reported attitude
    hfov_deg: Annotated[float, msgspec.Meta(gt=1.0, lt=170.0)] = 60.0
    origin: list[float] = msgspec.field(default_factory=list)  # [lat, lon] of local east/north; empty: first fix
    # The ground's height above mean sea level (m); unset: the autopilot's HOME_POSITION, else alt - relative_alt.
    ground_alt_m: Annotated[float, msgspec.Meta(ge=-500.0, le=9000.0)] | None = None
    position_timeout_s: PositiveFloat = 1.0  # a frame further than this from a position fix gets no pose
    attitude_timeout_s: PositiveFloat = 0.5  # ... from an attitude (and gimbal attitude) sample


class SourceConfig(Section):
    kind: Literal["replay", "opencv", "images"] = "replay"
    # opencv: a file path, a V4L2 device index ("0"), an rtsp:// URL or a GStreamer pipeline.
    uri: str = ""
    # opencv: a GStreamer pipeline instead of ``uri`` (appsink appended when missing); needs an OpenCV built with
    # GStreamer, which pip's opencv-python wheels are not (checked at start, docs/camera.md).
    pipeline: str = ""
    # Network streams (rtsp://, http://, ...): how RTSP carries the video ("auto": FFmpeg tries UDP, then TCP;
    # "tcp" by default because a lost UDP packet is a torn frame and NAT or firewalls often drop RTP over UDP) ...
    transport: Literal["tcp", "udp", "auto"] = "tcp"
    # ... and how long opening, and then each read, may wait for the camera before it counts as gone.
    open_timeout_s: PositiveFloat = 5.0
    read_timeout_s: PositiveFloat = 5.0
    # images: a directory of images or a video file.
    path: str = ""
    # Pace file/replay sources at this rate; 0 runs them as fast as the pipeline takes frames.
    fps: NonNegFloat = 15.0
    loop: bool = True
    preload: bool = False
    width: NonNegInt = 0  # requested capture size (opencv); 0 keeps the device's
    height: NonNegInt = 0
    reopen_backoff_s: PositiveFloat = 0.5
    reopen_backoff_max_s: PositiveFloat = 10.0
    replay: ReplayConfig = msgspec.field(default_factory=ReplayConfig)
    pose: PoseConfig = msgspec.field(default_factory=PoseConfig)


class ModelConfig(Section):
    bundle: str = ""  # directory or .tar; empty: the demo bundle under .cache/
    score_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class EngineConfig(Section):
    # Failover candidates in order; the bundle's CPU engine ("tflite", else "onnx" on the CPU) is always appended last.
    order: list[str] = msgspec.field(default_factory=lambda: ["tflite"])
    num_threads: NonNegInt = 0  # CPU threads per interpreter; 0: cores / replicas
    # CPU tflite: interpreters run side by side, one frame each; 0: one per core (single-threaded each).
    replicas: NonNegInt = 0
    device: str = ""  # edgetpu: "usb", "usb:0", "pci:0"; tensorrt/onnx: "cuda:0"
    # An accelerator call running longer than this fails over; 0: 10x the engine's p99, at least 250 ms.
    hang_deadline_ms: NonNegInt = 0
    # A failed engine is re-probed after reprobe_min_s, doubling up to reprobe_max_s.
    reprobe_min_s: PositiveFloat = 1.0
    reprobe_max_s: PositiveFloat = 300.0
    state_dir: str = ""  # crash breadcrumbs; empty: $STATE_DIRECTORY, else ./.cache/state


class PipelineConfig(Section):
    queue_depth: PositiveInt = 1
    policy: Literal["drop_oldest", "drop_newest", "block"] = "drop_oldest"
    stage_threads: Literal["auto", "separate", "fused"] = "auto"


class JsonlSinkConfig(Section):
    enabled: bool = True
    path: str = "-"  # "-" for standard output
    outbox: PositiveInt = 1024


class MqttSinkConfig(Section):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: Port = 1883
    client_id: str = ""  # empty: "edgerun-<node id>"
    topic_prefix: str = ""  # empty: "edgerun/<node id>/"
    fleet_topic: str = wire.FLEET_OBJECTS_TOPIC  # fleet objects this node owns (edgerun.object/2), fleet-wide
    # Each fleet object is also retained on <fleet_topic>/<id> for this long (MQTT 5 message expiry), so a station
    # or `edgerun fleet objects` started later gets every find; 0: not retained. Default: a day's mission.
    object_retain_s: NonNegInt = 86400
    qos_detections: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    qos_events: Annotated[int, msgspec.Meta(ge=0, le=1)] = 1
    qos_metrics: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    qos_status: Annotated[int, msgspec.Meta(ge=0, le=1)] = 1
    message_expiry_s: NonNegInt = 10  # 0: detections never expire at the broker
    keepalive_s: PositiveInt = 30
    connect_timeout_s: PositiveFloat = 5.0
    session_expiry_s: NonNegInt = 0
    clean_start: bool = True
    username: str = ""
    password: str = ""
    tls: bool = False  # TLS with the system CAs; implied by tls_ca or tls_cert
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_insecure: bool = False
    outbox: PositiveInt = 1000
    events_outbox: PositiveInt = 100
    # Publishes awaiting PUBACK (QoS 1) or the socket (QoS 0); the broker's Receive Maximum caps it further.
    max_inflight: PositiveInt = 20
    metrics_interval_s: NonNegFloat = 10.0  # 0: no metrics messages
    reconnect_min_s: PositiveFloat = 0.2
    reconnect_max_s: PositiveFloat = 30.0


class DdsSinkConfig(Section):
    enabled: bool = False
    domain_id: Annotated[int, msgspec.Meta(ge=0, le=232)] = 0
    # A Cyclone DDS XML config (path or inline). Empty: one made for ``interface``.
    cyclonedds_config: str = ""
    # Network interface for the generated config; a loopback one ("lo") also turns multicast off.
    interface: str = "lo"
    native: bool = True  # edgerun::DetectionBatch on ``topic``
    topic: str = "edgerun/detections"
    objects_topic: str = "edgerun/objects"  # fleet objects this node owns (edgerun::FleetObject), with native
    ros2: bool = False  # also vision_msgs/msg/Detection2DArray on rt/<ros2_namespace>/detections
    ros2_namespace: str = ""  # empty: the node id (characters outside [A-Za-z0-9_] become "_")
    frame_id: str = "camera"
    reliable: bool = False
    depth: NonNegInt = 0  # 0: 5 for best effort (the ROS sensor-data profile), 10 for reliable
    max_blocking_ms: NonNegInt = 5
    outbox: PositiveInt = 64


class SinksConfig(Section):
    jsonl: JsonlSinkConfig = msgspec.field(default_factory=JsonlSinkConfig)
    mqtt: MqttSinkConfig = msgspec.field(default_factory=MqttSinkConfig)
    dds: DdsSinkConfig = msgspec.field(default_factory=DdsSinkConfig)


class ServiceConfig(Section):
    http_enabled: bool = True
    http_host: str = "127.0.0.1"
    http_port: Port = 8089
    # Bearer token /snapshot.jpg asks for; empty: the camera is served only when http_host is loopback.
    snapshot_token_file: str = ""
    # Stop systemd watchdog pings when no frame has been inferred for this long.
    stall_s: PositiveFloat = 5.0
    snapshot_interval_s: PositiveFloat = 1.0
    shutdown_timeout_s: PositiveFloat = 1.5


class OtaConfig(Section):
    enabled: bool = False
    state_dir: str = ""  # A/B model slots, journal, anti-rollback counter; empty: $STATE_DIRECTORY or ./.cache/state
    root_keys: list[str] = msgspec.field(default_factory=list)  # minisign public key files (or their base64 lines)
    root_threshold: PositiveInt = 1  # distinct root signatures keys.json needs
    watch_dir: str = ""  # a release directory to poll (USB stick, balena volume)
    http_url: str = ""  # base URL of a release directory served over HTTP(S)
    mqtt: bool = False  # retained releases on edgerun/fleet/releases/<model>, via sinks.mqtt's broker settings
    poll_interval_s: PositiveFloat = 60.0
    max_rate_bps: NonNegInt = 0  # download rate cap in bytes/s over every source; 0: none
    # Cap on a payload's unpacked size (the sum of its files); a bigger one (a tar.gz bomb) is rejected while it is
    # unpacked. 1 GiB: several times the largest model bundle a Pi or Jetson runs, and still fits a small SD card.
    max_unpacked_bytes: PositiveInt = 1 << 30
    board: str = ""  # board class matched against a release's compatibility.boards; empty: the machine type
    clock: Literal["auto", "trusted", "untrusted"] = "auto"  # auto: trusted when the kernel says NTP-synchronised
    # With an untrusted clock: "floor" checks expiry against the newest signed time seen; "refuse" waits.
    untrusted_clock: Literal["floor", "refuse"] = "floor"
    health_window_s: PositiveFloat = 30.0  # how long a new model is watched before it is committed
    latency_factor: PositiveFloat = 3.0  # roll back when the new model's p99 inference time is above this x the old
    max_infer_errors: NonNegInt = 0  # roll back when more inferences than this fail in the window


class McuConfig(Section):
    """An MCU sensor node on a serial port (edgerun/mcu): its detections join the node's sinks."""

    enabled: bool = False
    port: str = ""  # serial device, e.g. /dev/ttyUSB0 or /dev/serial/by-id/...; required when enabled
    baud: PositiveInt = 921600
    labels: list[str] = msgspec.field(default_factory=list)  # class id -> label of the MCU's model
    release_keys: list[str] = msgspec.field(default_factory=list)  # minisign .pub files MCU releases are signed by
    ota_chunk: Annotated[int, msgspec.Meta(ge=1, le=236)] = 236  # image bytes per OTA_CHUNK frame
    ack_timeout_s: PositiveFloat = 1.0
    ota_retries: NonNegInt = 5  # resends of one unanswered OTA message before the relay gives up
    reconnect_s: PositiveFloat = 1.0  # wait between attempts to reopen a lost port


class SwarmTimingConfig(Section):
    """Gossip timers; 0 keeps swarm.config.SwarmTiming's default (memberlist's LAN values, probing twice as often)."""

    probe_interval_s: NonNegFloat = 0.0
    probe_timeout_s: NonNegFloat = 0.0
    gossip_interval_s: NonNegFloat = 0.0
    push_pull_interval_s: NonNegFloat = 0.0
    suspicion_mult: NonNegInt = 0
    retransmit_mult: NonNegInt = 0
    indirect_checks: NonNegInt = 0


class SwarmImagesConfig(Section):
    """The picture of each find this node owns (edgerun.fleet.find_images): bounded per object and in total."""

    enabled: bool = True
    max_side_px: Annotated[int, msgspec.Meta(ge=32, le=wire.OBJECT_IMAGE_MAX_SIDE_PX)] = wire.OBJECT_IMAGE_MAX_SIDE_PX
    max_bytes: Annotated[int, msgspec.Meta(ge=4096, le=wire.OBJECT_IMAGE_MAX_BYTES)] = wire.OBJECT_IMAGE_MAX_BYTES
    margin: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.25  # context around the box, a fraction of its size
    better_by: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05  # a view replaces the published one by this score
    min_interval_s: NonNegFloat = 10.0  # at most one picture of one object this often
    # All pictures together: a drone's radio link is shared with detections and gossip (a 40 KB picture every 5 s).
    max_bytes_per_s: PositiveInt = 8192
    crops_per_frame: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4  # the best-scoring detections cropped per frame


class SwarmConfig(Section):
    enabled: bool = False
    bind: str = "127.0.0.1:7946"  # host:port for gossip (UDP) and push-pull (TCP); port 0: any free port
    seeds: list[str] = msgspec.field(default_factory=list)  # host:port of members to join through
    key_file: str = ""  # required when enabled: base64 swarm keys, one per line, the first encrypts
    # Two claims of one class are one object within this distance (not widened by their uncertainties) ...
    radius_m: PositiveFloat = 5.0
    # ... and when seen within this many seconds of each other; also how long a reported object is remembered.
    window_s: PositiveFloat = 60.0
    # Wait this long for neighbours' claims before reporting an object; 0: report at once, suppress later copies.
    # 1.5 s: drones that find an object within a gossip round trip of each other report it once; in the 20-drone
    # sim (seeds 1-20) duplicates are 0.5 % of shared objects on average at 1.5 s (<= 2.5 % a seed), 1.1 % at 1.0,
    # 1.25 % at 2.5, ~39 % at 0 (docs/swarm.md, at-least-once reporting).
    hold_s: NonNegFloat = 1.5
    min_score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0  # detections below this make no claim
    # Drones that find an object already reported tell its owner once per track, so seen_by counts them; cheap
    # in a small swarm, ~1.1 KB/s more per node in the 20-drone sim (docs/swarm.md, fleet objects).
    share_sightings: bool = False
    labels: list[str] = msgspec.field(default_factory=list)  # labels that make claims; empty: every label
    # How often this member's metadata (model, engine, health, camera position) is looked at; it is gossiped
    # when something changed, the camera moved 5 m or turned 30 degrees, or 30 s after the last time.
    meta_interval_s: PositiveFloat = 2.0
    timing: SwarmTimingConfig = msgspec.field(default_factory=SwarmTimingConfig)
    images: SwarmImagesConfig = msgspec.field(default_factory=SwarmImagesConfig)


class TracingConfig(Section):
    """OpenTelemetry traces of frames (edgerun.tracing), exported as OTLP over HTTP; off unless enabled."""

    enabled: bool = False
    # An OTLP/HTTP traces endpoint: an OpenTelemetry Collector, Jaeger or Tempo (their default port is 4318).
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    # The share of frames traced: 0.01 is one frame in a hundred, enough to see where time goes at 15 fps.
    sample_ratio: Fraction = 0.01
    service_name: str = "edgerun"
    headers: dict[str, str] = msgspec.field(default_factory=dict)  # e.g. an API key the collector asks for
    export_interval_s: PositiveFloat = 2.0
    export_timeout_s: PositiveFloat = 5.0
    max_queue_spans: PositiveInt = 4096  # spans waiting for export; beyond this they are dropped, never blocking


class OffloadConfig(Section):
    """Borrowing a neighbour's engine (edgerun.offload, docs/offload.md); needs swarm.enabled."""

    # "never": every frame here. "auto": when the local engine cannot keep up with the source (or a helper is
    # clearly faster), surplus frames go to the best neighbour serving the same model. "always": the helper
    # first, the local engine takes what overflows and every frame while no helper is healthy.
    mode: Literal["never", "auto", "always"] = "never"
    # Serve this node's model for neighbours (advertised in the swarm metadata with the spare capacity).
    serve: bool = False
    # host:port the helper side listens on; empty: the swarm's host, any free port (the port is gossiped).
    bind: str = ""
    window: PositiveInt = 4  # frames in flight to the helper at once
    # A frame whose result is not back this long after it was sent is late: dropped and counted.
    deadline_ms: Annotated[float, msgspec.Meta(gt=0.0, le=60_000.0)] = 500.0
    # How the model-size frame travels: "jpeg" (quality 90, a few KB) or "zstd" (lossless; docs/offload.md).
    codec: Literal["jpeg", "zstd"] = "jpeg"
    serve_workers: PositiveInt = 1  # neighbours' frames inferred at once here
    serve_queue: PositiveInt = 8  # neighbours' frames waiting here; beyond it they are answered "busy"
    # auto: a helper is used while the source's frame rate is above this share of what the local engine
    # can do, and let go below ``release_load`` of it (the gap is the hysteresis).
    engage_load: PositiveFloat = 0.9
    release_load: PositiveFloat = 0.7


class Config(Section):
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    source: SourceConfig = msgspec.field(default_factory=SourceConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    pipeline: PipelineConfig = msgspec.field(default_factory=PipelineConfig)
    sinks: SinksConfig = msgspec.field(default_factory=SinksConfig)
    service: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    ota: OtaConfig = msgspec.field(default_factory=OtaConfig)
    swarm: SwarmConfig = msgspec.field(default_factory=SwarmConfig)
    mcu: McuConfig = msgspec.field(default_factory=McuConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    offload: OffloadConfig = msgspec.field(default_factory=OffloadConfig)

    @property
    def node_id(self) -> str:
        return self.node.id or socket.gethostname()


_PATH_RE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART_RE = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_key(key: str) -> str:
    """A key as TOML spells it: bare when it can be, else quoted with quotes, backslashes, control and
    non-ASCII characters escaped, so any key the parser accepts shows as one unambiguous ASCII word."""
    if _BARE_KEY_RE.fullmatch(key):
        return key
    out = []
    for ch in key:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04X}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08X}")
    return '"' + "".join(out) + '"'


def _key_path(parts: list[str | int | None]) -> str:
    """``sinks.mqtt.host``, ``engine.order[1]``, ``node."a\\nb"``; None is a dict entry not pinned down."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part is None:
            text += "[...]"
        else:
            text += ("." if text else "") + _toml_key(part)
    return text or "<top level>"


def _unwrap(tp: Any) -> Any:
    """The type under ``Annotated[...]`` and ``X | None``."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
            tp = args[0]
            continue
        return tp


def _failing_key(table: dict[str, Any], tp: Any) -> str | None:
    """The first key of a ``dict[str, X]`` table whose value is not an X (the one msgspec stopped at)."""
    for key, value in table.items():
        try:
            msgspec.convert(value, tp)
        except (msgspec.ValidationError, TypeError):
            return key
    return None


def _resolve(data: Any, path: str, root: type) -> tuple[list[str | int | None], bool, Any, Any]:
    """Follow a msgspec error path (``.engine.order[1]``, ``.variants[...]``) through the data and the
    types: the key path (a ``[...]`` dict entry pinned to its key), whether a value is there, the value
    and its type (None where unknown)."""
    parts: list[str | int | None] = []
    tp: Any = root  # a type, a typing form or None as the path goes down
    found, value = True, data
    for name, index in _PATH_PART_RE.findall(path):
        args = typing.get_args(tp)
        if name:
            parts.append(name)
            hints = typing.get_type_hints(tp, include_extras=True) if isinstance(tp, type) else {}
            tp = _unwrap(hints.get(name))
            found = found and isinstance(value, dict) and name in value
            value = value[name] if found else None
        elif index != "...":
            parts.append(int(index))
            tp = _unwrap(args[0]) if args else None
            found = found and isinstance(value, list) and int(index) < len(value)
            value = value[int(index)] if found else None
        else:
            tp = _unwrap(args[1]) if len(args) == 2 else None
            key = _failing_key(value, tp) if found and isinstance(value, dict) and tp is not None else None
            parts.append(key)
            found = key is not None
            value = value[key] if found else None
    return parts, found, value, tp


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return str(value)


def _message(err: msgspec.ValidationError, data: dict[str, Any], root: type | None = None) -> str:
    """Reword msgspec's error as one line ``key.path: expected X, got Y``, keys spelled as in TOML."""
    m = _PATH_RE.match(str(err))
    assert m is not None  # the pattern matches any text
    what, path = m.group("what"), (m.group("path") or "")
    parts, found, value, tp = _resolve(data, path, root or Config)
    unknown = re.match(r"Object contains unknown field `(?P<f>.*)`$", what, re.DOTALL)
    if unknown:
        # The name in msgspec's text may itself hold a backtick or " - at `$.x`" (then a top-level key reads
        # as one in [x]): the table at the path, else the top-level table, says which key it is.
        for at in (path, ""):
            parts, found, value, tp = _resolve(data, at, root or Config)
            fields = getattr(tp, "__struct_encode_fields__", None)
            if found and isinstance(value, dict) and fields is not None:
                extra = [k for k in value if k not in fields]
                if extra:
                    return f"{_key_path([*parts, extra[0]])}: unknown key"
        parts = _resolve(data, path, root or Config)[0]
        return f"{_key_path([*parts, unknown.group('f')])}: unknown key"
    missing = re.match(r"Object missing required field `(?P<f>.*)`$", what, re.DOTALL)
    if missing:
        return f"{_key_path([*parts, missing.group('f')])}: required key is missing"
    if what.startswith("Invalid enum value"):
        choices = [repr(v) for v in typing.get_args(tp)] if typing.get_origin(tp) is Literal else []
        return f"{_key_path(parts)}: expected one of {', '.join(choices)}, got {_describe(value)}"
    expected = re.sub(r"`", "", what)
    expected = re.sub(r"^Expected ", "", expected).replace("object", "table")
    expected = re.sub(r", got \w+$", "", expected)
    expected = " ".join(expected.split())  # one line, whatever msgspec's text holds
    got = f", got {_describe(value)}" if found else ""
    return f"{_key_path(parts)}: expected {expected}{got}"


def parse_config(data: dict[str, Any]) -> Config:
    """Validate a parsed TOML table into a Config, or raise ConfigError naming the key."""
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as err:
        raise ConfigError(_message(err, data)) from None
    _check_semantics(cfg)
    return cfg


def _check_semantics(cfg: Config) -> None:
    """Rules that span fields and cannot be said with types."""
    from edgerun.engines.base import ENGINE_MODULES

    for i, key in enumerate(cfg.engine.order):
        if key not in ENGINE_MODULES:
            known = ", ".join(sorted(ENGINE_MODULES))
            raise ConfigError(f"engine.order[{i}]: expected one of {known}, got {key!r}")
    if cfg.engine.reprobe_max_s < cfg.engine.reprobe_min_s:
        raise ConfigError("engine.reprobe_max_s: expected >= engine.reprobe_min_s")
    if cfg.source.kind == "opencv" and not (cfg.source.uri or cfg.source.pipeline):
        raise ConfigError("source.uri: required when source.kind is 'opencv' (or source.pipeline)")
    if cfg.source.kind == "opencv" and cfg.source.uri and cfg.source.pipeline:
        raise ConfigError("source.pipeline: give source.uri or source.pipeline, not both")
    if cfg.source.kind == "images" and not cfg.source.path:
        raise ConfigError("source.path: required when source.kind is 'images'")
    if cfg.source.reopen_backoff_max_s < cfg.source.reopen_backoff_s:
        raise ConfigError("source.reopen_backoff_max_s: expected >= source.reopen_backoff_s")
    replay = cfg.source.replay
    if not (len(replay.origin) == 2 and -90.0 <= replay.origin[0] <= 90.0 and -180.0 <= replay.origin[1] <= 180.0):
        raise ConfigError(f"source.replay.origin: expected [latitude, longitude] in degrees, got {replay.origin}")
    if not math.isfinite(replay.ground_alt_m):
        raise ConfigError(f"source.replay.ground_alt_m: expected a finite height in metres, got {replay.ground_alt_m}")
    pose = cfg.source.pose
    if pose.origin and not (
        len(pose.origin) == 2 and -90.0 <= pose.origin[0] <= 90.0 and -180.0 <= pose.origin[1] <= 180.0
    ):
        raise ConfigError(f"source.pose.origin: expected [latitude, longitude] in degrees, got {pose.origin}")
    if pose.kind == "mavlink":
        from edgerun.sources.pose_mavlink import parse_link_url

        parse_link_url(pose.url)
    mqtt = cfg.sinks.mqtt
    if bool(mqtt.tls_cert) != bool(mqtt.tls_key):
        raise ConfigError("sinks.mqtt.tls_key: tls_cert and tls_key must be given together")
    offload = cfg.offload
    if (offload.mode != "never" or offload.serve) and not cfg.swarm.enabled:
        raise ConfigError("offload: needs swarm.enabled (helpers are found and keyed through the swarm)")
    if offload.release_load >= offload.engage_load:
        raise ConfigError("offload.release_load: expected < offload.engage_load")
    tracing = cfg.tracing
    if tracing.enabled and not re.match(r"^https?://[^/\s]+(/\S*)?$", tracing.endpoint):
        raise ConfigError(f"tracing.endpoint: expected an http:// or https:// URL, got {tracing.endpoint!r}")
    ota = cfg.ota
    if ota.enabled and not ota.root_keys:
        raise ConfigError("ota.root_keys: required when ota.enabled is true")
    if ota.enabled and ota.root_threshold > len(ota.root_keys):
        raise ConfigError(f"ota.root_threshold: expected <= the {len(ota.root_keys)} ota.root_keys")
    if ota.enabled and not (ota.watch_dir or ota.http_url or ota.mqtt):
        raise ConfigError("ota.watch_dir: ota.enabled needs an update source (watch_dir, http_url or mqtt)")
    if cfg.mcu.enabled and not cfg.mcu.port:
        raise ConfigError("mcu.port: required when mcu.enabled is true")


def load_config(path: str | Path | None) -> Config:
    """Read and validate a TOML file; ``None`` gives the defaults."""
    if path is None:
        return parse_config({})
    path = Path(path)
    data = load_toml(path, ConfigError, "config file")
    from edgerun.config_env import overlay_env  # EDGERUN_<SECTION>_<KEY> variables (balena) override the file

    env = overlay_env(data)
    try:
        return parse_config(env.data)
    except ConfigError as err:
        raise ConfigError(f"{env.source_of(err) or path}: {err}") from None

"""Typed node configuration, read from TOML and validated strictly.

Every section is a msgspec Struct that forbids unknown keys; every field has a
default that works on a Raspberry Pi or is required. Validation errors are
turned into one line naming the key path, what was expected and what was found:
``pipeline.queue_depth: expected int >= 1, got 0``.
"""

from __future__ import annotations

import re
import socket
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomllib

from edgerun.errors import ConfigError

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


class SourceConfig(Section):
    kind: Literal["replay", "opencv", "images"] = "replay"
    # opencv: a file path, a V4L2 device index ("0"), an rtsp:// URL or a GStreamer pipeline.
    uri: str = ""
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


class ModelConfig(Section):
    bundle: str = ""  # directory or .tar; empty: the demo bundle under .cache/
    score_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class EngineConfig(Section):
    # Failover candidates in order; the CPU "tflite" engine is always appended last.
    order: list[str] = msgspec.field(default_factory=lambda: ["tflite"])
    num_threads: NonNegInt = 0  # 0: one per core
    device: str = ""  # edgetpu: "usb", "usb:0", "pci:0"; tensorrt/onnx: "cuda:0"


class PipelineConfig(Section):
    queue_depth: PositiveInt = 1
    policy: Literal["drop_oldest", "drop_newest", "block"] = "drop_oldest"


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
    qos_detections: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    qos_events: Annotated[int, msgspec.Meta(ge=0, le=1)] = 1
    message_expiry_s: NonNegInt = 10
    keepalive_s: PositiveInt = 30
    session_expiry_s: NonNegInt = 0
    clean_start: bool = True
    username: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_insecure: bool = False
    outbox: PositiveInt = 1000
    metrics_interval_s: NonNegFloat = 10.0
    reconnect_min_s: PositiveFloat = 0.2
    reconnect_max_s: PositiveFloat = 30.0


class DdsSinkConfig(Section):
    enabled: bool = False
    domain_id: Annotated[int, msgspec.Meta(ge=0, le=232)] = 0
    # A Cyclone DDS XML config (path or inline). Empty: loopback only, multicast off.
    cyclonedds_config: str = ""
    ros2: bool = False
    ros2_namespace: str = ""
    frame_id: str = "camera"
    reliable: bool = False
    depth: PositiveInt = 5
    max_blocking_ms: NonNegInt = 5


class SinksConfig(Section):
    jsonl: JsonlSinkConfig = msgspec.field(default_factory=JsonlSinkConfig)
    mqtt: MqttSinkConfig = msgspec.field(default_factory=MqttSinkConfig)
    dds: DdsSinkConfig = msgspec.field(default_factory=DdsSinkConfig)


class ServiceConfig(Section):
    http_enabled: bool = True
    http_host: str = "127.0.0.1"
    http_port: Port = 8089
    # Stop systemd watchdog pings when no frame has been inferred for this long.
    stall_s: PositiveFloat = 5.0
    snapshot_interval_s: PositiveFloat = 1.0
    shutdown_timeout_s: PositiveFloat = 1.5


class Config(Section):
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    source: SourceConfig = msgspec.field(default_factory=SourceConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    pipeline: PipelineConfig = msgspec.field(default_factory=PipelineConfig)
    sinks: SinksConfig = msgspec.field(default_factory=SinksConfig)
    service: ServiceConfig = msgspec.field(default_factory=ServiceConfig)

    @property
    def node_id(self) -> str:
        return self.node.id or socket.gethostname()


_PATH_RE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")


def _lookup(data: Any, path: str) -> tuple[bool, Any]:
    """The value at a msgspec path like ``.pipeline.queue_depth`` or ``.engine.order[1]``."""
    for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        key, index = part
        try:
            data = data[key] if key else data[int(index)]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


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


def _choices(path: str, root: type | None = None) -> list[str]:
    """The allowed values of the Literal field at a msgspec path (for enum errors)."""
    tp: Any = root or Config
    for name in re.findall(r"\.([^.\[]+)", path):
        hints = typing.get_type_hints(tp, include_extras=True)
        tp = hints.get(name)
        while typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
    return [repr(v) for v in typing.get_args(tp)] if typing.get_origin(tp) is Literal else []


def _message(err: msgspec.ValidationError, data: dict[str, Any], root: type | None = None) -> str:
    """Reword msgspec's error as ``key.path: expected X, got Y``."""
    m = _PATH_RE.match(str(err))
    assert m is not None
    what, path = m.group("what"), (m.group("path") or "")
    key = path.lstrip(".") or "<top level>"
    unknown = re.match(r"Object contains unknown field `(?P<f>[^`]+)`", what)
    if unknown:
        field = unknown.group("f")
        full = f"{key}.{field}" if path else field
        return f"{full}: unknown key"
    missing = re.match(r"Object missing required field `(?P<f>[^`]+)`", what)
    if missing:
        field = missing.group("f")
        return f"{key + '.' if path else ''}{field}: required key is missing"
    if what.startswith("Invalid enum value"):
        choices = _choices(path, root)
        found, value = _lookup(data, path)
        return f"{key}: expected one of {', '.join(choices)}, got {_describe(value)}"
    expected = re.sub(r"`", "", what)
    expected = re.sub(r"^Expected ", "", expected).replace("object", "table")
    expected = re.sub(r", got \w+$", "", expected)
    found, value = _lookup(data, path)
    got = f", got {_describe(value)}" if found else ""
    return f"{key}: expected {expected}{got}"


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
    if cfg.source.kind == "opencv" and not cfg.source.uri:
        raise ConfigError("source.uri: required when source.kind is 'opencv'")
    if cfg.source.kind == "images" and not cfg.source.path:
        raise ConfigError("source.path: required when source.kind is 'images'")
    if cfg.source.reopen_backoff_max_s < cfg.source.reopen_backoff_s:
        raise ConfigError("source.reopen_backoff_max_s: expected >= source.reopen_backoff_s")
    mqtt = cfg.sinks.mqtt
    if bool(mqtt.tls_cert) != bool(mqtt.tls_key):
        raise ConfigError("sinks.mqtt.tls_key: tls_cert and tls_key must be given together")


def load_config(path: str | Path | None) -> Config:
    """Read and validate a TOML file; ``None`` gives the defaults."""
    if path is None:
        return parse_config({})
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML ({err})") from None
    try:
        return parse_config(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None

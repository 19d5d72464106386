"""What ``edgerun listen`` (edgerun/commands/listen.py) reads with: payload checks, formatting, MQTT and DDS readers.

Everything received is untrusted: a payload that is too big, not UTF-8, not
JSON or not shaped like edgerun.detections/1 is counted and skipped (the first
one is described on stderr), never a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
import time
from typing import Any

import msgspec

from edgerun import wire
from edgerun.errors import EdgerunError
from edgerun.hostport import parse_hostport

DEFAULT_MQTT_TOPIC = "edgerun/+/detections"
DEFAULT_MAX_BYTES = 1 << 20
_PRINT_DETECTIONS = 4  # boxes shown per line before "+N more"


# -- Parsing untrusted payloads ----------------------------------------------------------------


def check_detections(obj: Any) -> wire.Detections:
    """``obj`` as an ``edgerun.detections/1`` Struct; ValueError names the first bad field."""
    try:
        return msgspec.convert(obj, wire.Detections)
    except msgspec.ValidationError as err:
        raise ValueError(wire.describe(err)) from None


def decode_message(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, Any]:
    """Classify one received payload: ``("detections", dict)``, ``("object", dict)`` (a fleet object, version 2
    or 1), ``("json", obj)`` or ``("text", str)``.

    Raises ValueError with an exact reason for anything malformed.
    """
    if len(data) > max_bytes:
        raise ValueError(f"payload of {len(data)} bytes is over the {max_bytes}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("payload is not UTF-8") from None
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        if any(ch < " " and ch not in "\t" for ch in stripped):
            raise ValueError("text payload has control characters")
        return "text", stripped
    try:
        obj = msgspec.json.decode(stripped)
    except msgspec.DecodeError as err:
        raise ValueError(f"payload is not JSON ({str(err).removeprefix('JSON is malformed: ')})") from None
    except RecursionError:
        raise ValueError("payload JSON is nested too deeply") from None
    if isinstance(obj, dict) and obj.get("schema") == wire.DETECTIONS_SCHEMA:
        check_detections(obj)
        return "detections", obj
    if isinstance(obj, dict) and obj.get("schema") in (wire.OBJECT_SCHEMA, wire.OBJECT_SCHEMA_V1):
        try:
            msgspec.convert(obj, wire.ObjectReport)
        except msgspec.ValidationError as err:
            raise ValueError(wire.describe(err)) from None
        return "object", obj
    return "json", obj


# -- Formatting ------------------------------------------------------------------------------


def _clock(ts: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int((ts % 1) * 1000):03d}"
    except (OverflowError, OSError, ValueError):
        return f"{ts:.3f}"


def format_detections(p: dict[str, Any]) -> str:
    """``node #seq hh:mm:ss.mmm model vN/engine 12.3 ms  2 det: face 0.93 [x1,y1,x2,y2] ...`` and, for a traced
    frame, ``  trace <trace id>`` (what Jaeger or Tempo find it by)."""
    model = p["model"]
    latency = p.get("latency_ms")
    parts = [
        f"{p['node']} #{p['seq']} {_clock(p['ts'])}",
        f"{model['name']} v{model.get('version', '?')}/{model.get('engine', '?')}",
        f"{latency:.1f} ms" if latency is not None else "- ms",
    ]
    dets = p["detections"]
    shown = [
        f"{d['label']} {d['score']:.2f} [{','.join(f'{v:.0f}' for v in d['box'])}]" for d in dets[:_PRINT_DETECTIONS]
    ]
    more = f" +{len(dets) - _PRINT_DETECTIONS} more" if len(dets) > _PRINT_DETECTIONS else ""
    trace = f"  trace {p['trace_id']}" if p.get("trace_id") else ""
    return " ".join(parts) + f"  {len(dets)} det" + (": " + "; ".join(shown) if shown else "") + more + trace


def format_object(p: dict[str, Any]) -> str:
    """``object 9f2c41d07b3e8a15 face at 53.1172073, -4.1297391 +-0.6 m  owner drone-2, seen by 2`` (version 1:
    its local ``E 17.4 N 23.1 m``)."""
    if p.get("lat") is not None:
        where = f"at {p['lat']:.7f}, {p['lon']:.7f}"
    else:
        where = f"at E {p['east_m']:.1f} N {p['north_m']:.1f} m (local, {p['schema']})"
    sigma = p.get("uncertainty_m")
    seen = p.get("seen_by")
    seen_n = len(seen) if isinstance(seen, list) else seen
    return (
        f"object {p['id']} {p['label']} {where}" + (f" +-{sigma:.1f} m" if isinstance(sigma, (int, float)) else "")
        + f"  owner {p.get('owner') or '?'}, seen by {seen_n if seen_n is not None else '?'}"
    )  # fmt: skip


def format_ros2(topic: str, msg: Any) -> str:
    stamp = msg.header.stamp
    shown = []
    for det in msg.detections[:_PRINT_DETECTIONS]:
        hyp = det.results[0].hypothesis if det.results else None
        label = f"{hyp.class_id} {hyp.score:.2f}" if hyp is not None else "?"
        c = det.bbox.center.position
        shown.append(f"{label} c=({c.x:.0f},{c.y:.0f}) {det.bbox.size_x:.0f}x{det.bbox.size_y:.0f}")
    n = len(msg.detections)
    more = f" +{n - _PRINT_DETECTIONS} more" if n > _PRINT_DETECTIONS else ""
    ts = stamp.sec + stamp.nanosec / 1e9
    return f"{topic} [{msg.header.frame_id}] {_clock(ts)}  {n} det" + (": " + "; ".join(shown) if shown else "") + more


class Printer:
    """Writes one line per message and keeps the counts; thread-safe (paho calls from its thread)."""

    def __init__(self, as_json: bool, count: int, out: Any = None, err: Any = None) -> None:
        self.as_json = as_json
        self.count = count
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.printed = 0
        self.bad = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            if self.done.is_set():
                return
            try:
                self.out.write(text + "\n")
                self.out.flush()
            except BrokenPipeError:  # `edgerun listen | head`: the reader has gone, so have we
                self.done.set()
                return
            self.printed += 1
            if self.count and self.printed >= self.count:
                self.done.set()

    def bad_message(self, where: str, reason: str) -> None:
        with self._lock:
            self.bad += 1
            if self.bad == 1:
                self.err.write(f"listen: skipped a bad message on {where}: {reason} (further ones are only counted)\n")
                self.err.flush()

    def mqtt_message(self, topic: str, data: bytes, max_bytes: int, node: str = "") -> None:
        try:
            kind, obj = decode_message(data, max_bytes)
        except ValueError as err:
            self.bad_message(topic, str(err))
            return
        if node and kind == "detections" and obj["node"] != node:
            return
        if self.as_json:
            if kind == "text":
                self.line(json.dumps({"topic": topic, "text": obj}))
            else:
                self.line(json.dumps(obj, separators=(",", ":")))
        elif kind == "detections":
            self.line(format_detections(obj))
        elif kind == "object":
            self.line(format_object(obj))
        elif kind == "json":
            self.line(f"{topic} {json.dumps(obj, separators=(',', ':'))}")
        else:
            self.line(f"{topic} {obj}")


# -- MQTT ------------------------------------------------------------------------------------


def parse_host_port(text: str, default_port: int = 1883) -> tuple[str, int]:
    """``--mqtt HOST:PORT`` (edgerun.hostport) of a broker to connect to, so port 0 is no port."""
    host, port = parse_hostport(text, "listen: --mqtt", default_port, error=EdgerunError)
    if port == 0:
        raise EdgerunError(f"listen: --mqtt: port must be 1..65535, got {port}")
    return host, port


def listen_login(args: argparse.Namespace, host: str, port: int) -> Any:
    """The broker login from the shared ``--mqtt-user`` options (a MqttSinkConfig; no login: an empty one).

    The password: ``--mqtt-password-env``/``--mqtt-password-file``, else the old ``--password``, else
    ``EDGERUN_MQTT_PASSWORD`` as listen always read it. Bad options are one ``listen:`` line.
    """
    from edgerun.commands.options import mqtt_client_config
    from edgerun.config import MqttSinkConfig
    from edgerun.errors import ConfigError

    try:
        login = mqtt_client_config(args, host, port) or MqttSinkConfig(host=host, port=port)
    except ConfigError as err:
        raise EdgerunError(f"listen: {err}") from None
    if login.username and not login.password:
        login.password = getattr(args, "listen_password", None) or os.environ.get("EDGERUN_MQTT_PASSWORD", "")
    login.tls_insecure = bool(getattr(args, "mqtt_tls_insecure", False))
    if login.tls_insecure and not (login.tls or login.tls_ca):
        raise EdgerunError("listen: --mqtt-tls-insecure needs --mqtt-tls or --mqtt-tls-ca")
    return login


def _listen_mqtt(args: argparse.Namespace, printer: Printer) -> None:
    """Connect once (a broker that cannot be reached or refuses is one MqttError line, as mosquitto_sub exits),
    then subscribe and print until done; a connection lost later is retried by paho's thread."""
    from edgerun.mqtt_client import MqttError, connect_blocking, new_client

    host, port = parse_host_port(args.mqtt)
    topics = args.topic or [DEFAULT_MQTT_TOPIC]
    login = listen_login(args, host, port)
    client = new_client(login, id_prefix="edgerun-listen", reconnect=(1.0, 5.0))
    subscriptions = [(t, args.qos) for t in topics]

    def report(text: str) -> None:
        print(f"listen: {host}:{port}: {text}", file=sys.stderr, flush=True)

    def on_connect(c: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            report(f"the broker refused the reconnection ({reason}); retrying")
            return
        c.subscribe(subscriptions)  # a clean session after a reconnection: subscribe again
        report("reconnected")

    def on_disconnect(c: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if not printer.done.is_set():
            report(f"connection lost ({reason}); reconnecting")

    def on_message(c: Any, userdata: Any, msg: Any) -> None:
        printer.mqtt_message(msg.topic, msg.payload, args.max_bytes, args.node)

    client.on_message = on_message
    try:
        connect_blocking(client, host, port, keepalive=30)
    except MqttError as err:
        raise type(err)(f"listen: {err}") from None  # the same class: a refused login keeps its exit code 2
    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    client.subscribe(subscriptions)
    report(f"listening on {', '.join(topics)}")
    try:
        printer.done.wait(args.seconds or None)
    finally:
        printer.done.set()  # the disconnect below is ours, not a lost connection
        client.disconnect()
        client.loop_stop()


# -- DDS -------------------------------------------------------------------------------------


def _listen_dds(args: argparse.Namespace, printer: Printer) -> None:
    from edgerun.sinks.dds import require_cyclonedds

    require_cyclonedds("listen --dds", "listen with --mqtt")  # the [dds] extra: one line, not an ImportError
    from cyclonedds.builtin import BuiltinDataReader, BuiltinTopicDcpsPublication
    from cyclonedds.core import DDSException
    from cyclonedds.domain import DomainParticipant
    from cyclonedds.qos import Policy, Qos
    from cyclonedds.sub import DataReader
    from cyclonedds.topic import Topic

    from edgerun.sinks.dds import open_domain, release_domain, resolve_config
    from edgerun.sinks.idl import native, ros2

    config = resolve_config(args.dds_config, args.interface, key="--dds-config")
    try:
        open_domain(args.domain, config)
        participant: Any = DomainParticipant(args.domain)
    except DDSException as err:
        raise EdgerunError(f"listen: cannot start Cyclone DDS on domain {args.domain} ({err})") from None
    # Best effort reads from best-effort and reliable writers alike; a deep history rides out bursts.
    policies: list[Any] = [Policy.Reliability.BestEffort, Policy.History.KeepLast(100), Policy.Durability.Volatile]
    if args.ros2:
        policies.append(Policy.DataRepresentation(use_cdrv0_representation=True))  # what rmw_cyclonedds writes
    qos = Qos(*policies)
    readers: dict[str, Any] = {}

    def add_reader(name: str, datatype: type) -> None:
        if name not in readers:
            readers[name] = DataReader(participant, Topic(participant, name, datatype, qos=qos), qos=qos)
            print(f"listen: domain {args.domain}: reading {name}", file=sys.stderr, flush=True)

    discovery = None
    if args.ros2:
        if args.namespace:
            add_reader(ros2.topic_name(args.namespace), ros2.Detection2DArray)
        else:
            discovery = BuiltinDataReader(participant, BuiltinTopicDcpsPublication)
    else:
        for name in args.topic or [native.TOPIC]:
            add_reader(name, native.DetectionBatch)

    deadline = time.monotonic() + args.seconds if args.seconds else math.inf
    try:
        while not printer.done.is_set() and time.monotonic() < deadline:
            if discovery is not None:
                for ep in discovery.take(N=64):
                    name = getattr(ep, "topic_name", "")
                    if getattr(ep, "type_name", "") == ros2.TYPE_NAME and name.endswith("/detections"):
                        add_reader(name, ros2.Detection2DArray)
            got = False
            for name, reader in list(readers.items()):
                try:
                    samples = reader.take(N=64)
                except Exception as err:  # a sample that does not deserialize is untrusted input
                    printer.bad_message(name, f"{type(err).__name__}: {err}")
                    continue
                for sample in samples:
                    got = True
                    _print_dds_sample(printer, name, sample, args)
            if not got:
                time.sleep(0.02)
    finally:
        readers.clear()
        discovery = None
        participant = None
        release_domain(args.domain)


def _print_dds_sample(printer: Printer, topic: str, sample: Any, args: argparse.Namespace) -> None:
    from edgerun.sinks.dds import native_to_payload
    from edgerun.sinks.idl import native, ros2

    if isinstance(sample, native.DetectionBatch):
        if args.node and sample.node != args.node:
            return
        payload = native_to_payload(sample)
        printer.line(json.dumps(payload, separators=(",", ":")) if args.json else format_detections(payload))
    elif isinstance(sample, ros2.Detection2DArray):
        if args.json:
            printer.line(json.dumps({"topic": topic, **dataclasses.asdict(sample)}, separators=(",", ":")))
        else:
            printer.line(format_ros2(topic, sample))
    # Anything else is a state change of an instance (dispose, no writers), not data.

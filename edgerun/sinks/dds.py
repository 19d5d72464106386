"""DDS sink (Cyclone DDS): native ``edgerun::DetectionBatch`` and, for ROS 2, ``vision_msgs/Detection2DArray``.

DDS has no broker, so there is nothing to reconnect to: the sink is "up" once
its participant exists. ``submit`` puts the batch in a bounded outbox (the
oldest is dropped and counted when it is full) and one writer thread converts
and writes. A reliable write blocks up to ``max_blocking_ms`` for every
stalled reader, so writing on the loop could hold it for
depth x writers x max_blocking_ms; on the writer thread a stalled reader
only fills the outbox, and MQTT, HTTP and the watchdog keep running. A write
that times out is counted as dropped (``write_timeouts``).

DDS carries detections only; events, status and metrics go over MQTT and
HTTP (``publish_event`` is the base class's no-op).

Cyclone is never left to its defaults (every interface, multicast): the
domain is created with an explicit config, by default confined to the
loopback interface with multicast off and 127.0.0.1 as the only peer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgerun.config import DdsSinkConfig
from edgerun.errors import ConfigError
from edgerun.sinks.base import Outbox, Sink
from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)

# Fleet objects waiting for the writer thread; more than this and the oldest is dropped (and counted).
OBJECTS_QUEUE = 256
LOOPBACK_INTERFACES = frozenset({"lo", "lo0", "127.0.0.1", "localhost"})


def require_cyclonedds(what: str = "sinks.dds.enabled", instead: str = "set sinks.dds.enabled = false") -> None:
    """ConfigError (exit 2, one line) when DDS is asked for but Cyclone DDS's Python binding is not installed."""
    try:
        import cyclonedds  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"{what}: Cyclone DDS is not installed ({err}); pip install 'edgerun[dds]' "
            f"(on aarch64 it builds against Cyclone's C library: docs/installing.md), or {instead}"
        ) from None


_LOOPBACK_XML = (
    '<CycloneDDS><Domain id="any">'
    '<General><Interfaces><NetworkInterface name="{iface}"/></Interfaces>'
    "<AllowMulticast>false</AllowMulticast></General>"
    '<Discovery><Peers><Peer address="127.0.0.1"/></Peers>'
    "<ParticipantIndex>auto</ParticipantIndex><MaxAutoParticipantIndex>50</MaxAutoParticipantIndex></Discovery>"
    "</Domain></CycloneDDS>"
)
_INTERFACE_XML = (
    '<CycloneDDS><Domain id="any">'
    '<General><Interfaces><NetworkInterface name="{iface}"/></Interfaces></General>'
    "</Domain></CycloneDDS>"
)


def domain_config(interface: str = "lo") -> str:
    """Cyclone XML for one network interface; a loopback one also turns multicast off."""
    iface = interface.strip() or "lo"
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]+", iface):
        raise ConfigError(f"sinks.dds.interface: expected an interface name, got {interface!r}")
    if iface in LOOPBACK_INTERFACES:
        return _LOOPBACK_XML.format(iface="lo" if iface in ("127.0.0.1", "localhost") else iface)
    return _INTERFACE_XML.format(iface=iface)


def loopback_config() -> str:
    """The config tests, the demo and ``edgerun listen --dds`` use: loopback only, multicast off."""
    return domain_config("lo")


def resolve_config(cyclonedds_config: str, interface: str, key: str = "sinks.dds.cyclonedds_config") -> str:
    """Inline XML as is, a file path as a file:// URI Cyclone reads itself, or one made for ``interface``."""
    text = cyclonedds_config.strip()
    if not text:
        return domain_config(interface)
    if text.startswith("<"):
        return text
    path = Path(text.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}: {path} is not a file (give inline XML or the path of one)")
    return path.resolve().as_uri()


def ros2_namespace(namespace: str, node_id: str) -> str:
    """A ROS-legal namespace: the configured one, else the node id with odd characters made ``_``."""
    raw = namespace.strip("/") or node_id
    parts = [re.sub(r"[^A-Za-z0-9_]", "_", part) for part in raw.split("/") if part]
    parts = [("n" + p if p[0].isdigit() else p) for p in parts if p]
    return "/".join(parts)


# -- Domains are process-wide in Cyclone: one config per id, shared by every participant. ---------

_domains: dict[int, tuple[Any, int]] = {}


def open_domain(domain_id: int, config: str) -> Any:
    """Create (or share) the domain with ``config``, so no participant ever joins a default-configured one."""
    from cyclonedds.domain import Domain

    entry = _domains.get(domain_id)
    if entry is not None:
        _domains[domain_id] = (entry[0], entry[1] + 1)
        return entry[0]
    domain = Domain(domain_id, config)
    _domains[domain_id] = (domain, 1)
    return domain


def release_domain(domain_id: int) -> None:
    entry = _domains.get(domain_id)
    if entry is None:
        return
    if entry[1] <= 1:
        del _domains[domain_id]  # the last reference goes: Cyclone deletes the domain
    else:
        _domains[domain_id] = (entry[0], entry[1] - 1)


def writer_qos(reliable: bool, depth: int, max_blocking_ms: int, xcdr1: bool = False) -> Any:
    """BestEffort KeepLast(5) (ROS sensor data) or Reliable KeepLast(10) with a bounded blocking time."""
    from cyclonedds.qos import Policy, Qos
    from cyclonedds.util import duration

    policies: list[Any] = [Policy.Durability.Volatile]
    if reliable:
        policies += [
            Policy.Reliability.Reliable(max_blocking_time=duration(milliseconds=max_blocking_ms)),
            Policy.History.KeepLast(depth or 10),
        ]
    else:
        policies += [Policy.Reliability.BestEffort, Policy.History.KeepLast(depth or 5)]
    if xcdr1:
        policies.append(Policy.DataRepresentation(use_cdrv0_representation=True))
    return Qos(*policies)


# -- Conversions between the JSON payload and the wire types -------------------------------------


_NATIVE_POSE_FIELDS = ("east_m", "north_m", "up_m", "yaw_deg", "pitch_deg", "roll_deg", "hfov_deg")


def payload_to_native(payload: dict[str, Any]) -> Any:
    """The native sample with the same values as the JSON payload."""
    from edgerun.sinks.idl import native

    latency = payload["latency_ms"]
    pose = payload["pose"]
    return native.DetectionBatch(
        node=payload["node"],
        schema=payload["schema"],
        seq=payload["seq"],
        ts=payload["ts"],
        frame=native.FrameInfo(**payload["frame"]),
        model=native.ModelInfo(**payload["model"]),
        latency_ms=math.nan if latency is None else float(latency),
        # The DDS type has the pose in its local frame only: the camera's lat/lon/alt_m (wire.Pose) stay out.
        pose=[] if pose is None else [native.Pose(**{k: pose[k] for k in _NATIVE_POSE_FIELDS})],
        detections=[
            native.Detection(
                label=d["label"],
                class_id=d["class_id"],
                score=d["score"],
                box=list(d["box"]),
                keypoints=[native.Keypoint(x, y) for x, y in d.get("keypoints", ())],
            )
            for d in payload["detections"]
        ],
        trace_id=payload.get("trace_id", ""),
    )


def native_to_payload(sample: Any) -> dict[str, Any]:
    """The JSON payload back from a native sample (the inverse of ``payload_to_native``)."""
    detections = []
    for d in sample.detections:
        item: dict[str, Any] = {"label": d.label, "class_id": d.class_id, "score": d.score, "box": list(d.box)}
        if d.keypoints:
            item["keypoints"] = [[k.x, k.y] for k in d.keypoints]
        detections.append(item)
    pose = sample.pose[0] if sample.pose else None
    payload: dict[str, Any] = {
        "schema": sample.schema,
        "node": sample.node,
        "seq": sample.seq,
        "ts": sample.ts,
        "frame": {"width": sample.frame.width, "height": sample.frame.height, "source": sample.frame.source},
        "model": {"name": sample.model.name, "version": sample.model.version, "engine": sample.model.engine},
        "latency_ms": None if math.isnan(sample.latency_ms) else sample.latency_ms,
        "pose": None
        if pose is None
        else {
            "east_m": pose.east_m,
            "north_m": pose.north_m,
            "up_m": pose.up_m,
            "yaw_deg": pose.yaw_deg,
            "pitch_deg": pose.pitch_deg,
            "roll_deg": pose.roll_deg,
            "hfov_deg": pose.hfov_deg,
        },
        "detections": detections,
    }
    if sample.trace_id:
        payload["trace_id"] = sample.trace_id
    return payload


def payload_to_object(payload: dict[str, Any]) -> Any:
    """An ``edgerun.object/2`` payload as a native ``edgerun::FleetObject`` sample (east/north 0 when absent)."""
    from edgerun.sinks.idl import native

    return native.FleetObject(
        id=str(payload["id"]),
        schema=str(payload["schema"]),
        label=str(payload["label"]),
        east_m=float(payload.get("east_m") or 0.0),
        north_m=float(payload.get("north_m") or 0.0),
        uncertainty_m=float(payload["uncertainty_m"]),
        first_seen=float(payload["first_seen"]),
        last_seen=float(payload["last_seen"]),
        score=float(payload["score"]),
        owner=str(payload["owner"]),
        seen_by=[str(n) for n in payload["seen_by"]],
        ts=float(payload["ts"]),
        lat=float(payload["lat"]),
        lon=float(payload["lon"]),
        alt_m=float(payload["alt_m"]),
    )


def stamp_of(ts: float) -> tuple[int, int]:
    """Unix seconds as ROS ``builtin_interfaces/Time`` (sec, nanosec)."""
    sec = math.floor(ts)
    nanosec = min(int(round((ts - sec) * 1e9)), 999_999_999)
    return int(sec), nanosec


def payload_to_ros2(payload: dict[str, Any], frame_id: str) -> Any:
    """``vision_msgs/Detection2DArray``: one Detection2D per box, its label as the hypothesis class_id."""
    from edgerun.sinks.idl import ros2

    sec, nanosec = stamp_of(payload["ts"])
    header = ros2.Header(stamp=ros2.Time(sec=sec, nanosec=nanosec), frame_id=frame_id)
    detections = []
    for d in payload["detections"]:
        x1, y1, x2, y2 = d["box"]
        detections.append(
            ros2.Detection2D(
                header=header,
                results=[
                    ros2.ObjectHypothesisWithPose(
                        hypothesis=ros2.ObjectHypothesis(class_id=d["label"], score=float(d["score"]))
                    )
                ],
                bbox=ros2.BoundingBox2D(
                    center=ros2.Pose2D(position=ros2.Point2D(x=(x1 + x2) / 2.0, y=(y1 + y2) / 2.0), theta=0.0),
                    size_x=float(x2 - x1),
                    size_y=float(y2 - y1),
                ),
                id="",
            )
        )
    return ros2.Detection2DArray(header=header, detections=detections)


class DdsSink(Sink):
    """Writes each batch as a native sample (keyed by node) and, in ROS 2 mode, a Detection2DArray."""

    KEY = "dds"

    def __init__(self, cfg: DdsSinkConfig, node_id: str = "") -> None:
        super().__init__()
        require_cyclonedds()
        self.cfg = cfg
        self.node_id = node_id or socket.gethostname()
        self.namespace = ros2_namespace(cfg.ros2_namespace, self.node_id)
        self.stats.connected = False
        self.status_reason = "not started"
        self.write_timeouts = 0  # reliable writes that hit max_blocking_ms (also in stats.dropped)
        # The outbox and the counters are shared by the loop (submit) and the writer thread.
        self._lock = threading.Condition()
        self._outbox = Outbox(cfg.outbox, self.stats)
        self._writing = False  # a batch is out of the outbox and in a write call
        self._closing = False
        self._writer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._config = ""
        self._domain: Any = None
        self._participant: Any = None
        self._native_writer: Any = None
        self._ros2_writer: Any = None
        self._objects_writer: Any = None
        # Fleet objects this node owns: few, and each one matters, so they queue apart from the batches.
        self._objects: collections.deque[dict[str, Any]] = collections.deque()
        self.objects_sent = 0
        self.objects_dropped = 0
        self._retry_task: asyncio.Task[None] | None = None
        self._error_logged = False

    @property
    def ros2_topic(self) -> str:
        from edgerun.sinks.idl import ros2

        return ros2.topic_name(self.namespace)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._config = resolve_config(self.cfg.cyclonedds_config, self.cfg.interface)
        if self._try_open():
            self._start_writer()
        else:
            # An interface that is not up yet (Wi-Fi at boot) is an outage, not a config error: retry.
            self._retry_task = self._loop.create_task(self._retry_open(), name="edgerun-dds-open")

    def _try_open(self) -> bool:
        from cyclonedds.core import DDSException

        try:
            self._open()
        except DDSException as err:
            self._close_entities()
            self.stats.connected = False
            self.status_reason = (
                f"dds domain {self.cfg.domain_id} on {self.cfg.interface or 'configured interfaces'}:"
                f" cannot start Cyclone DDS ({err.msg if hasattr(err, 'msg') else err})"
            )
            log.error("%s; retrying", self.status_reason)
            return False
        self.stats.connected = True
        self.status_reason = ""
        topics = [t for t, on in ((self.cfg.topic, self.cfg.native), (self.ros2_topic, self.cfg.ros2)) if on]
        log.info(
            "dds: domain %d, %s %s, publishing on %s",
            self.cfg.domain_id,
            "reliable" if self.cfg.reliable else "best effort",
            self.cfg.interface if not self.cfg.cyclonedds_config else "custom config",
            ", ".join(topics) or "nothing",
        )
        return True

    def _open(self) -> None:
        from cyclonedds.domain import DomainParticipant
        from cyclonedds.pub import DataWriter
        from cyclonedds.topic import Topic

        from edgerun.sinks.idl import native, ros2

        cfg = self.cfg
        self._domain = open_domain(cfg.domain_id, self._config)
        self._participant = participant = DomainParticipant(cfg.domain_id)
        if cfg.native:
            qos = writer_qos(cfg.reliable, cfg.depth, cfg.max_blocking_ms)
            native_topic = Topic(participant, cfg.topic, native.DetectionBatch, qos=qos)
            self._native_writer = DataWriter(participant, native_topic, qos=qos)
            # Reliable and kept per object id: a found person must reach a DDS ground station too.
            objects_qos = writer_qos(True, 1, cfg.max_blocking_ms)
            objects_topic = Topic(participant, cfg.objects_topic, native.FleetObject, qos=objects_qos)
            self._objects_writer = DataWriter(participant, objects_topic, qos=objects_qos)
        if cfg.ros2:
            ros_qos = writer_qos(cfg.reliable, cfg.depth, cfg.max_blocking_ms, xcdr1=True)
            ros_topic = Topic(participant, self.ros2_topic, ros2.Detection2DArray, qos=ros_qos)
            self._ros2_writer = DataWriter(participant, ros_topic, qos=ros_qos)

    async def _retry_open(self) -> None:
        delay = 1.0
        while not self.stats.connected:
            await asyncio.sleep(delay)
            delay = min(delay * 2.0, 30.0)
            if self._try_open():
                self._start_writer()

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="edgerun-dds-writer", daemon=True)
            self._writer.start()

    def submit(self, batch: DetectionBatch, t_submit: float) -> None:
        with self._lock:
            self.stats.submitted += 1
            self._outbox.put((batch, t_submit))  # full: drops the oldest and counts it
            self._lock.notify()

    def publish_object(self, payload: dict[str, Any], on_delivered: Callable[[], None] | None = None) -> None:
        """A fleet object on ``objects_topic`` (native edgerun::FleetObject), written by the writer thread."""
        with self._lock:
            self._objects.append(payload)
            while len(self._objects) > OBJECTS_QUEUE:
                self._objects.popleft()
                self.objects_dropped += 1
            self._lock.notify()

    def _write_loop(self) -> None:
        """The writer thread: takes objects and batches off their queues and writes them until the sink closes."""
        lock = self._lock
        while True:
            with lock:
                while not len(self._outbox) and not self._objects and not self._closing:
                    lock.wait()
                if self._objects:
                    item: Any = self._objects.popleft()
                elif len(self._outbox):
                    item = self._outbox.pop()
                else:
                    return  # closing and nothing left
                self._writing = True
            try:
                if isinstance(item, dict):
                    self._write_object(item)
                else:
                    self._write(*item)
            finally:
                with lock:
                    self._writing = False
                    lock.notify_all()

    def _write(self, batch: DetectionBatch, t_submit: float) -> None:
        """One batch to every writer (on the writer thread); counters are updated under the lock."""
        from cyclonedds.core import DDSException

        payload = batch.to_payload(t_submit)
        timestamp = int(batch.meta.wall_time * 1e9)
        try:
            if self._native_writer is not None:
                self._native_writer.write(payload_to_native(payload), timestamp=timestamp)
            if self._ros2_writer is not None:
                self._ros2_writer.write(payload_to_ros2(payload, self.cfg.frame_id), timestamp=timestamp)
        except DDSException as err:
            with self._lock:
                if err.code == DDSException.DDS_RETCODE_TIMEOUT:
                    # A reliable reader is too slow: this batch is lost to flow control, not to a fault.
                    self.write_timeouts += 1
                    self.stats.dropped += 1
                    return
                self.stats.errors += 1
                first = not self._error_logged
                self._error_logged = True
            if first:
                log.error("dds: write failed: %s (further failures are only counted)", err)
            return
        with self._lock:
            self.stats.sent += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dds: wrote batch seq %d", batch.meta.seq)

    def _write_object(self, payload: dict[str, Any]) -> None:
        from cyclonedds.core import DDSException

        if self._objects_writer is None:
            return
        try:
            self._objects_writer.write(payload_to_object(payload))
        except (DDSException, TypeError, ValueError, KeyError) as err:
            with self._lock:
                self.objects_dropped += 1
            log.warning("dds: fleet object %s not written: %s", payload.get("id"), err)
            return
        with self._lock:
            self.objects_sent += 1

    def set_metrics_provider(self, provider: Any) -> None:
        """Accepted for the same API as the MQTT sink; DDS carries detections only (metrics go to MQTT/HTTP)."""

    def counters(self) -> dict[str, Any]:
        s = self.stats
        return {
            "connected": s.connected,
            "submitted": s.submitted,
            "sent": s.sent,
            "dropped": s.dropped,
            "write_timeouts": self.write_timeouts,
            "errors": s.errors,
            "queued": len(self._outbox),
            "objects_sent": self.objects_sent,
            "objects_dropped": self.objects_dropped,
        }

    def _drained(self, timeout: float) -> bool:
        """Wait (on an executor thread) until the writer has written everything queued."""
        with self._lock:
            return self._lock.wait_for(lambda: not len(self._outbox) and not self._writing, timeout)

    async def close(self, timeout: float = 1.0) -> None:
        """Write what is queued (bounded by ``timeout``), then delete the DDS entities."""
        loop = asyncio.get_running_loop()
        if self._retry_task is not None:
            self._retry_task.cancel()
            await asyncio.gather(self._retry_task, return_exceptions=True)
        writer = self._writer
        if writer is not None:
            await loop.run_in_executor(None, self._drained, timeout)
        with self._lock:
            left = len(self._outbox)
            for _ in range(left):
                self._outbox.pop()
            self.stats.dropped += left
            self._closing = True
            self._lock.notify_all()
        if writer is not None:
            # A write in progress ends within max_blocking_ms; the entities must outlive it.
            await loop.run_in_executor(None, writer.join)
            self._writer = None
        self._close_entities()
        self.stats.connected = False
        self.status_reason = "closed"

    def _close_entities(self) -> None:
        # Cyclone entities live as long as their Python objects: dropping the references deletes them.
        self._native_writer = None
        self._ros2_writer = None
        self._objects_writer = None
        self._participant = None
        if self._domain is not None:
            self._domain = None
            release_domain(self.cfg.domain_id)

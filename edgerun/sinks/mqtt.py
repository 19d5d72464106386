"""MQTT 5 sink: paho-mqtt driven by the node's own asyncio loop.

paho runs without its network thread: the loop watches the socket
(``add_reader``/``add_writer`` from paho's socket callbacks) and calls
``loop_read``/``loop_write``/``loop_misc``. Only the blocking TCP connect and
TLS handshake run in a short-lived daemon thread, so a broker that is slow to
answer never stalls frames.

Each connection gets a fresh paho client. Publishes in flight when a
connection dies go back to the front of the outbox and are sent again on the
next connection (at-least-once for QoS 1), so topic aliases and packet ids
never outlive the connection they were made for, and every batch is either
sent, still queued, or counted as dropped.

Topics under ``topic_prefix`` (default ``edgerun/<node id>/``)::

    detections  one message per frame (edgerun.detections/1 JSON), expires at the broker
    events      node events (edgerun.event/1 JSON): health changes, failover, OTA steps
    status      retained "online"; a clean shutdown says "stopped", the will (retained) "lost"
    metrics     periodic summary (edgerun.metrics/1 JSON)
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edgerun import wire
from edgerun.config import MqttSinkConfig
from edgerun.mqtt_client import (
    ClosedBeforeConnack,
    Will,
    backoff_delay,
    build_ssl_context,
    describe_connect_error,
    new_client,
    send_connect,
)
from edgerun.sinks.base import Outbox, Sink
from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)

STATUS_ONLINE = wire.STATUS_ONLINE
STATUS_STOPPED = wire.STATUS_STOPPED
STATUS_LOST = wire.STATUS_LOST
TOPIC_KEYS = wire.NODE_ALIAS_KEYS  # also the order topic aliases are handed out
_MISC_INTERVAL_S = 1.0
_LINE_MAX = 300  # a status reason is one line for health and logs


def default_topic_prefix(node_id: str) -> str:
    return wire.node_topic_prefix(node_id)


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _LINE_MAX else text[: _LINE_MAX - 3] + "..."


def _to_builtin(obj: Any) -> Any:
    """numpy scalars (in a metrics summary or event data) as the Python numbers they hold."""
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


class _Message:
    """A pre-encoded non-detection message (event, metrics) waiting in the events queue."""

    __slots__ = (
        "topic_key",
        "payload",
        "qos",
        "retain",
        "content_type",
        "expiry_s",
        "topic",
        "on_delivered",
        "user_properties",
    )

    def __init__(
        self,
        topic_key: str,
        payload: bytes,
        qos: int,
        retain: bool,
        content_type: str,
        expiry_s: int = 0,
        topic: str | None = None,  # instead of the key's topic (a fleet object's own retained topic)
        on_delivered: Callable[[], None] | None = None,  # called on the broker's PUBACK
        user_properties: list[tuple[str, str]] | None = None,
    ) -> None:
        self.user_properties = user_properties
        self.topic = topic
        self.on_delivered = on_delivered
        self.topic_key = topic_key
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.content_type = content_type
        self.expiry_s = expiry_s


def _set_future(
    fut: asyncio.Future[Any], result: Any, error: BaseException | None, abandon: Callable[[], None]
) -> None:
    if fut.done():  # cancelled while connecting (shutdown): close what the thread opened
        abandon()
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _run_in_daemon_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], Any], abandon: Callable[[], None]
) -> asyncio.Future[Any]:
    """Run ``fn`` in a daemon thread; ``abandon`` cleans up if nobody waits for the result any more.

    Not the default executor: its threads are joined at interpreter exit, so a
    connect hanging on a dead route would hold up the node's shutdown.
    """
    fut: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as err:  # handed to the loop as is
            error = err
        try:
            loop.call_soon_threadsafe(_set_future, fut, result, error, abandon)
        except RuntimeError:  # the loop is closed: nobody will use this connection
            abandon()

    threading.Thread(target=run, name="edgerun-mqtt-connect", daemon=True).start()
    return fut


class MqttSink(Sink):
    """Publishes detection batches, events, status and metrics to an MQTT 5 broker."""

    KEY = "mqtt"

    def __init__(self, cfg: MqttSinkConfig, node_id: str = "") -> None:
        super().__init__()
        self.cfg = cfg
        self.node_id = node_id or socket.gethostname()
        self.client_id = cfg.client_id or f"edgerun-{self.node_id}"
        prefix = cfg.topic_prefix or default_topic_prefix(self.node_id)
        if not prefix.endswith("/"):
            prefix += "/"
        self.topics: dict[str, str] = {key: prefix + key for key in TOPIC_KEYS}
        # Fleet-wide (not under the node's prefix): the one place every owner reports its objects.
        self.topics["objects"] = cfg.fleet_topic
        self.topics["swarm"] = prefix + "swarm"
        self.objects_sent = 0
        self.images_sent = 0  # pictures of fleet objects the broker acknowledged
        self.stats.connected = False
        self.status_reason = "not started"
        # Counters beyond SinkStats, for /metrics and the metrics topic.
        self.expired = 0  # batches older than message_expiry_s before they could be sent (also in stats.dropped)
        self.shutdown_dropped = 0  # batches still queued at close (also in stats.dropped)
        self.events_sent = 0
        self.events_dropped = 0
        self.connects = 0
        self.bad_metrics = 0
        # What the broker granted in its last CONNACK.
        self.broker_receive_maximum = 0
        self.broker_topic_alias_maximum = 0
        self.inflight_limit = 0
        self.peak_inflight = 0  # the most publishes ever in flight at once (<= inflight_limit)

        self._outbox = Outbox(cfg.outbox, self.stats)
        self._events: collections.deque[_Message] = collections.deque()
        self._encoder = msgspec.json.Encoder(enc_hook=_to_builtin)
        self._ssl_context: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: mqtt.Client | None = None
        self._inflight: dict[int, tuple[str, Any]] = {}
        self._max_qos = 1
        self._retain_available = True
        self._alias_of: dict[str, int] = {}
        self._alias_bound: set[str] = set()
        self._attached_at = 0.0
        self._lost: asyncio.Event | None = None
        self._first_attempt_done: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pump_scheduled = False
        self._closing = False
        self._metrics_provider: Callable[[], dict[str, Any]] | None = None
        self._last_logged_reason = ""
        self._refused = ""
        self._rand = random.Random()

    # -- the Sink API ----------------------------------------------------------

    async def start(self) -> None:
        """Start connecting in the background; returns once the first attempt is settled (<= 1 s)."""
        self._ssl_context = build_ssl_context(self.cfg)
        self._loop = loop = asyncio.get_running_loop()
        self._first_attempt_done = asyncio.Event()
        self.status_reason = f"mqtt {self.cfg.host}:{self.cfg.port}: connecting"
        self._tasks.append(loop.create_task(self._connection_loop(), name="edgerun-mqtt-connection"))
        self._tasks.append(loop.create_task(self._misc_loop(), name="edgerun-mqtt-misc"))
        if self.cfg.metrics_interval_s > 0:
            self._tasks.append(loop.create_task(self._metrics_loop(), name="edgerun-mqtt-metrics"))
        # A short wait keeps health from flapping "down" on a normal start; an absent broker costs <= 1 s.
        try:
            await asyncio.wait_for(self._first_attempt_done.wait(), min(1.0, self.cfg.connect_timeout_s))
        except asyncio.TimeoutError:
            pass

    def submit(self, batch: DetectionBatch, t_submit: float) -> None:
        self.stats.submitted += 1
        self._outbox.put((batch, t_submit))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("mqtt: queued batch seq %d (%d queued)", batch.meta.seq, len(self._outbox))
        self._schedule_pump()

    def publish_event(self, kind: str, data: dict[str, Any]) -> None:
        """Queue an event; events wait through an outage in their own bounded queue."""
        try:
            body = self._encoder.encode(wire.event_payload(self.node_id, kind, data))
        except (TypeError, msgspec.EncodeError) as err:
            self.stats.errors += 1
            log.warning("mqtt: event %r is not JSON-encodable (%s); not published", kind, err)
            return
        self._queue_message(_Message("events", body, self.cfg.qos_events, False, "application/json"))

    confirms_objects = True

    def publish_object(self, payload: dict[str, Any], on_delivered: Callable[[], None] | None = None) -> None:
        """A fleet object this node owns, at QoS 1: a found person must reach the ground station.
        ``on_delivered`` runs when the broker acknowledged it (PUBACK with success), through reconnects.

        Also retained on the object's own topic (``<fleet_topic>/<id>``) for ``object_retain_s``, so a station or
        ``edgerun fleet objects`` that starts later still gets every find the broker holds.
        """
        self._queue_json("objects", payload, 1, retain=False, on_delivered=on_delivered)
        if self.cfg.object_retain_s and isinstance(payload.get("id"), str):
            topic = f"{self.topics['objects']}/{payload['id']}"
            self._queue_json("objects", payload, 1, retain=True, topic=topic, expiry_s=self.cfg.object_retain_s)

    carries_images = True

    def publish_object_image(self, object_id: str, jpeg: bytes, properties: list[tuple[str, str]]) -> bool:
        """The picture of a fleet object this node owns, retained on ``<fleet_topic>/<id>/image`` (QoS 1) for as
        long as the object itself; who took it, its score, box and time in MQTT 5 user properties."""
        topic = wire.object_image_topic(object_id, self.topics["objects"])
        expiry_s = self.cfg.object_retain_s
        message = _Message("images", jpeg, 1, True, wire.OBJECT_IMAGE_CONTENT_TYPE, expiry_s, topic, None, properties)
        self._queue_message(message)
        return True

    def publish_swarm_view(self, view: dict[str, Any]) -> None:
        """This node's swarm view, retained, so a station that starts later sees the fleet at once."""
        self._queue_json("swarm", view, self.cfg.qos_status, retain=True)

    def _queue_json(
        self,
        topic_key: str,
        payload: dict[str, Any],
        qos: int,
        *,
        retain: bool,
        topic: str | None = None,
        expiry_s: int = 0,
        on_delivered: Callable[[], None] | None = None,
    ) -> None:
        try:
            body = self._encoder.encode(payload)
        except (TypeError, msgspec.EncodeError) as err:
            self.stats.errors += 1
            log.warning("mqtt: %s message is not JSON-encodable (%s); not published", topic_key, err)
            return
        self._queue_message(_Message(topic_key, body, qos, retain, "application/json", expiry_s, topic, on_delivered))

    def set_metrics_provider(self, provider: Callable[[], dict[str, Any]]) -> None:
        """Where the periodic ``metrics`` message gets the node's summary."""
        self._metrics_provider = provider

    def counters(self) -> dict[str, Any]:
        """Every counter this sink keeps, for /metrics and the metrics topic."""
        s = self.stats
        return {
            "connected": s.connected,
            "submitted": s.submitted,
            "sent": s.sent,
            "dropped": s.dropped,
            "expired": self.expired,
            "errors": s.errors,
            "queued": len(self._outbox),
            "inflight": len(self._inflight),
            "events_sent": self.events_sent,
            "events_dropped": self.events_dropped,
            "objects_sent": self.objects_sent,
            "images_sent": self.images_sent,
            "connects": self.connects,
        }

    async def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued, publish ``stopped`` (retained), disconnect cleanly; all within ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.05)
        self._closing = True
        client = self._client
        if client is not None and self.stats.connected:
            # Most of the budget flushes; the rest says goodbye.
            await self._wait_until(lambda: not self._work_left(), deadline - 0.25 * timeout)
            if self._client is client and len(self._inflight) < self.inflight_limit:
                mid = self._publish_now(
                    client, "status", STATUS_STOPPED, self.cfg.qos_status, True, "text/plain", "status", None
                )
                if mid is not None:
                    await self._wait_until(lambda: mid not in self._inflight, deadline - 0.1 * timeout)
                reason = ReasonCode(PacketTypes.DISCONNECT, "Normal disconnection")
            else:
                # No room in the window for our own goodbye: the broker publishes the will instead.
                reason = ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message")
            if self._client is client:
                client.disconnect(reasoncode=reason)
                await self._wait_until(lambda: self._client is not client, deadline)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            self._teardown(self._client, "closed")
        left = [item for kind, item in self._inflight.values() if kind == "batch"]
        self._inflight.clear()
        left += [self._outbox.pop() for _ in range(len(self._outbox))]
        if left:
            self.shutdown_dropped += len(left)
            self.stats.dropped += len(left)
            log.warning("mqtt: %d batches were still queued at shutdown and are dropped", len(left))
        self.stats.connected = False
        self.status_reason = "closed"

    # -- connection management ----------------------------------------------------

    def _new_client(self) -> mqtt.Client:
        cfg = self.cfg
        # No paho reconnects: the connection loop retries with its own jittered backoff.
        client = new_client(
            cfg,
            client_id=self.client_id,
            reconnect=None,
            ssl_context=self._ssl_context,
            will=Will(self.topics["status"], STATUS_LOST, qos=cfg.qos_status, retain=True),
        )
        # The sink keeps its own window (Receive Maximum) and queue; paho's would only hide them.
        client.max_inflight_messages = 0
        client.max_queued_messages = 0
        client.connect_timeout = cfg.connect_timeout_s
        return client

    def _connect_blocking(self, client: mqtt.Client) -> None:
        """TCP connect, TLS handshake and CONNECT; runs in a daemon thread before any loop callback is set."""
        send_connect(client, self.cfg)
        sock: Any = client.socket()
        if sock is not None:
            # Detections are small and latency matters more than packet count.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def _abandon(client: mqtt.Client) -> None:
        sock = client.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    async def _connection_loop(self) -> None:
        """Connect, wait until the connection is lost, back off with full jitter, repeat until closed."""
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        attempt = 0
        while not self._closing:
            self._lost = lost = asyncio.Event()
            connected_before = self.connects
            client: mqtt.Client | None = None
            try:
                client = self._new_client()
                await _run_in_daemon_thread(
                    loop, functools.partial(self._connect_blocking, client), functools.partial(self._abandon, client)
                )
            except asyncio.CancelledError:
                if client is not None:
                    self._abandon(client)
                raise
            except ClosedBeforeConnack:
                self._set_down(self._closed_early())
            except Exception as err:  # every failure is one line in health
                self._set_down(describe_connect_error(err, cfg.connect_timeout_s))
            else:
                if self._closing:
                    self._abandon(client)
                    break
                try:
                    self._attach(client)
                except (OSError, ValueError) as err:  # the socket died between connect and attach
                    if self._client is client:
                        self._teardown(client, describe_connect_error(err, cfg.connect_timeout_s))
                    else:
                        self._abandon(client)
                        self._set_down(describe_connect_error(err, cfg.connect_timeout_s))
                        lost.set()
                await lost.wait()
            if self._first_attempt_done is not None:
                self._first_attempt_done.set()
            if self._closing:
                break
            attempt = 0 if self.connects > connected_before else attempt + 1
            await asyncio.sleep(backoff_delay(attempt, cfg.reconnect_min_s, cfg.reconnect_max_s, self._rand.uniform))

    def _attach(self, client: mqtt.Client) -> None:
        """Hand the connected socket to the loop: from here on paho only runs inside loop callbacks."""
        loop = self._loop
        assert loop is not None
        sock: Any = client.socket()
        if sock is None:
            raise OSError("the connection closed before it could be used")
        self._client = client
        self._attached_at = loop.time()
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_socket_register_write
        client.on_socket_unregister_write = self._on_socket_unregister_write
        loop.add_reader(sock, self._on_readable)
        if client.want_write():
            loop.add_writer(sock, self._on_writable)

    def _teardown(self, client: mqtt.Client, reason: str) -> None:
        """Drop a connection paho has not closed itself (no CONNACK in time, shutdown)."""
        loop = self._loop
        sock = client.socket()
        if sock is not None and loop is not None:
            loop.remove_reader(sock)
            loop.remove_writer(sock)
        self._abandon(client)
        self._connection_lost(client, reason)

    def _connection_lost(self, client: mqtt.Client, reason: str) -> None:
        if client is not self._client:
            return
        self._client = None
        was_connected = self.stats.connected
        # In-flight publishes may not have reached the broker: they go first on the next connection.
        batches = [item for kind, item in self._inflight.values() if kind == "batch"]
        events = [item for kind, item in self._inflight.values() if kind in ("event", "object", "image")]
        self._inflight.clear()
        if batches:
            queued = [self._outbox.pop() for _ in range(len(self._outbox))]
            for item in batches + queued:
                self._outbox.put(item)  # drop-oldest keeps the newest and counts the rest
        for message in reversed(events):
            self._events.appendleft(message)
        self._trim_events()
        self._alias_of.clear()
        self._alias_bound.clear()
        if not self._closing:
            self._set_down(reason, was_connected)
        if self._lost is not None:
            self._lost.set()

    def _closed_early(self) -> str:
        # Under TLS 1.3 a missing or rejected client certificate shows up only as this early close.
        hint = ""
        if self._ssl_context is not None and not self.cfg.tls_cert:
            hint = " (does it require a client certificate? set tls_cert and tls_key)"
        return "broker closed the connection before CONNACK" + hint

    def _set_down(self, what: str, was_connected: bool = False) -> None:
        reason = _one_line(f"mqtt {self.cfg.host}:{self.cfg.port}: {what}")
        self.stats.connected = False
        self.status_reason = reason
        if reason != self._last_logged_reason or was_connected:
            # A broker that stays away is logged once per distinct reason, not once per retry.
            log.warning("%s; retrying with backoff (%d batches queued)", reason, len(self._outbox))
            self._last_logged_reason = reason

    # -- paho callbacks (always on the loop) -----------------------------------------

    def _on_readable(self) -> None:
        client = self._client
        if client is None:
            return
        rc = client.loop_read()
        sock = client.socket()
        # TLS may hold decrypted bytes that select() will never report.
        pending = getattr(sock, "pending", None)
        while rc == MQTTErrorCode.MQTT_ERR_SUCCESS and pending is not None and client.socket() is sock and pending():
            rc = client.loop_read()

    def _on_writable(self) -> None:
        client = self._client
        if client is not None:
            client.loop_write()

    def _on_socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        loop = self._loop
        if loop is not None:
            loop.remove_reader(sock)
            loop.remove_writer(sock)

    def _on_socket_register_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        if self._loop is not None and client is self._client:
            self._loop.add_writer(sock, self._on_writable)

    def _on_socket_unregister_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        if self._loop is not None:
            self._loop.remove_writer(sock)

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: ReasonCode, properties: Properties | None
    ) -> None:
        if client is not self._client:
            return
        if reason_code.is_failure:
            # The broker closes the socket next; _on_disconnect then schedules the retry.
            self._refused = f"broker refused the connection ({reason_code})"
            self._set_down(self._refused)
            return
        props = properties
        self.broker_receive_maximum = int(getattr(props, "ReceiveMaximum", 65535))
        self.broker_topic_alias_maximum = int(getattr(props, "TopicAliasMaximum", 0))
        self._max_qos = int(getattr(props, "MaximumQoS", 1))
        self._retain_available = bool(getattr(props, "RetainAvailable", 1))
        self.inflight_limit = max(1, min(self.cfg.max_inflight, self.broker_receive_maximum))
        self._alias_of = {
            key: i + 1 for i, key in enumerate(TOPIC_KEYS[: min(len(TOPIC_KEYS), self.broker_topic_alias_maximum)])
        }
        self._alias_bound.clear()
        self.connects += 1
        self.stats.connected = True
        self.status_reason = ""
        self._last_logged_reason = ""
        log.info(
            "mqtt: connected to %s:%d as %s (receive maximum %d, topic aliases %d, %d batches queued)",
            self.cfg.host,
            self.cfg.port,
            self.client_id,
            self.broker_receive_maximum,
            self.broker_topic_alias_maximum,
            len(self._outbox),
        )
        if self._first_attempt_done is not None:
            self._first_attempt_done.set()
        if not self._closing:
            self._publish_now(client, "status", STATUS_ONLINE, self.cfg.qos_status, True, "text/plain", "status", None)
        self._schedule_pump()

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: ReasonCode, properties: Properties | None
    ) -> None:
        if self._refused:
            what, self._refused = self._refused, ""
        elif getattr(flags, "is_disconnect_packet_from_server", False):
            what = f"broker disconnected ({reason_code})"
        elif not self.stats.connected:
            what = self._closed_early()
        else:
            what = "connection lost"
        self._connection_lost(client, what)

    def _on_publish(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_code: ReasonCode, properties: Properties | None
    ) -> None:
        entry = self._inflight.pop(mid, None)
        if entry is None:
            return
        kind, item = entry
        if reason_code.is_failure:
            self.stats.errors += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("mqtt: broker rejected a %s publish: %s", kind, reason_code)
        elif kind == "batch":
            self.stats.sent += 1
        elif kind == "event":
            self.events_sent += 1
        elif kind == "image":
            self.images_sent += 1
        elif kind == "object":
            self.objects_sent += 1
            if isinstance(item, _Message) and item.on_delivered is not None:
                item.on_delivered()
        # paho holds its message lock here; publish the next ones from a fresh loop callback.
        self._schedule_pump()

    # -- publishing ---------------------------------------------------------------------

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self._loop is not None and self._client is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    @staticmethod
    def _kind_of(topic_key: str) -> str:
        """Metrics are periodic (a lost one is replaced by the next); events, fleet objects and pictures are kept."""
        return {"events": "event", "objects": "object", "images": "image", "metrics": "metrics"}.get(topic_key, "event")

    def _work_left(self) -> bool:
        return bool(len(self._outbox) or self._events or self._inflight)

    def _pump(self) -> None:
        """Publish queued messages while the in-flight window has room."""
        self._pump_scheduled = False
        client = self._client
        if client is None or not self.stats.connected:
            return
        limit = self.inflight_limit
        while len(self._inflight) < limit and self._events:
            message = self._events.popleft()
            props = Properties(PacketTypes.PUBLISH)
            if message.expiry_s:
                props.MessageExpiryInterval = message.expiry_s
            if message.user_properties:
                props.UserProperty = message.user_properties
            mid = self._publish_now(
                client,
                message.topic_key,
                message.payload,
                message.qos,
                message.retain,
                message.content_type,
                self._kind_of(message.topic_key),
                message,
                props,
                message.topic,
            )
            if mid is None:
                return
        expiry_s = self.cfg.message_expiry_s
        now = time.monotonic()
        while len(self._inflight) < limit and len(self._outbox):
            batch, t_submit = item = self._outbox.pop()
            props = Properties(PacketTypes.PUBLISH)
            if expiry_s:
                remaining = expiry_s - (now - t_submit)
                if remaining <= 0:
                    self.expired += 1
                    self.stats.dropped += 1
                    continue
                props.MessageExpiryInterval = max(1, math.ceil(remaining))
            props.UserProperty = [
                ("schema", wire.DETECTIONS_SCHEMA),
                ("model", batch.model_name),
                ("model_version", str(batch.model_version)),
            ]
            body = self._encoder.encode(batch.to_wire(t_submit))
            mid = self._publish_now(
                client, "detections", body, self.cfg.qos_detections, False, "application/json", "batch", item, props
            )
            if mid is None:
                return

    def _publish_now(
        self,
        client: mqtt.Client,
        topic_key: str,
        payload: bytes,
        qos: int,
        retain: bool,
        content_type: str,
        kind: str,
        item: Any,
        props: Properties | None = None,
        topic_override: str | None = None,
    ) -> int | None:
        """One PUBLISH on the current connection; returns its mid, or None if the connection is gone."""
        if props is None:
            props = Properties(PacketTypes.PUBLISH)
        props.ContentType = content_type
        if not content_type.startswith("image/"):
            props.PayloadFormatIndicator = 1  # UTF-8 text (a broker may check it: never said of a JPEG)
        topic = topic_override or self.topics[topic_key]
        alias = None if topic_override else self._alias_of.get(topic_key)
        if alias is not None:
            props.TopicAlias = alias
            if topic_key in self._alias_bound:
                topic = ""  # the broker maps the alias back to the topic
            else:
                self._alias_bound.add(topic_key)
        info = client.publish(
            topic, payload, qos=min(qos, self._max_qos), retain=retain and self._retain_available, properties=props
        )
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            self.stats.errors += 1
            # The connection is going away; keep the item for the next one.
            if kind == "batch":
                self._inflight[info.mid] = (kind, item)
            elif kind in ("event", "object", "image") and item is not None:
                self._events.appendleft(item)
            return None
        self._inflight[info.mid] = (kind, item)
        if len(self._inflight) > self.peak_inflight:
            self.peak_inflight = len(self._inflight)
        return int(info.mid)

    def _queue_message(self, message: _Message) -> None:
        self._events.append(message)
        self._trim_events()
        self._schedule_pump()

    def _trim_events(self) -> None:
        while len(self._events) > self.cfg.events_outbox:
            self._events.popleft()
            self.events_dropped += 1

    # -- periodic work ------------------------------------------------------------------

    async def _misc_loop(self) -> None:
        """Keepalive pings (paho's loop_misc) and the CONNACK deadline."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_MISC_INTERVAL_S)
            client = self._client
            if client is None:
                continue
            if not self.stats.connected and loop.time() - self._attached_at > self.cfg.connect_timeout_s:
                self._teardown(client, f"no CONNACK within {self.cfg.connect_timeout_s:g} s")
                continue
            client.loop_misc()

    async def _metrics_loop(self) -> None:
        interval = self.cfg.metrics_interval_s
        while True:
            await asyncio.sleep(interval)
            if not self.stats.connected:
                continue  # a summary is only worth its moment; none are queued through an outage
            summary: dict[str, Any] = {}
            if self._metrics_provider is not None:
                try:
                    summary = self._metrics_provider()
                except Exception as err:  # a broken provider must not end the metrics
                    self.bad_metrics += 1
                    if self.bad_metrics == 1:
                        log.warning("mqtt: metrics provider failed: %s", err)
            payload = wire.Metrics(node=self.node_id, ts=time.time(), summary=summary, mqtt=self.counters())
            try:
                body = self._encoder.encode(payload)
            except (TypeError, msgspec.EncodeError) as err:
                self.bad_metrics += 1
                if self.bad_metrics == 1:
                    log.warning("mqtt: metrics summary is not JSON-encodable: %s", err)
                continue
            # A summary older than two periods has been replaced by a newer one.
            expiry = max(1, math.ceil(2 * interval))
            self._queue_message(_Message("metrics", body, self.cfg.qos_metrics, False, "application/json", expiry))

    @staticmethod
    async def _wait_until(done: Callable[[], bool], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not done() and loop.time() < deadline:
            await asyncio.sleep(0.005)

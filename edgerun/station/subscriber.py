"""The station's MQTT connection: subscribes to the fleet's topics and hands messages to the event loop, bounded.

paho runs its own network thread (edgerun/mqtt_client.py) and reconnects by itself (backoff 0.5-10 s);
with ``session_expiry_s`` and a ``client_id`` that stays the same across restarts, the broker keeps the
station's subscriptions and queues their QoS 1 messages while it is away, and a restart gets what it missed;
messages wait in a bounded queue (the oldest dropped and counted when the loop
falls behind) and are drained on the loop in one callback per burst, so a
fleet of 50 nodes at 15 fps costs one wake-up per burst, not per message.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from edgerun.station.model import STATION_EVENTS_TOPIC, SUBSCRIPTIONS

log = logging.getLogger(__name__)


class FleetSubscriber:
    def __init__(
        self,
        host: str,
        port: int,
        on_message: Callable[[str, bytes, bool, dict[str, str]], None],  # topic, payload, retained, user properties
        on_state: Callable[[bool, str], None],
        *,
        backlog: int = 20000,
        client_id: str = "",  # empty: edgerun-station-<random>, so two stations on one broker never evict each other
        cfg: Any = None,
        session_expiry_s: int = 0,
    ) -> None:
        self.host, self.port = host, port
        self.cfg = cfg  # credentials and TLS (a MqttSinkConfig) for a broker with access control
        self.on_message, self.on_state = on_message, on_state
        self.client_id = client_id
        self.session_expiry_s = session_expiry_s
        self.dropped_backlog = 0
        self._queue: deque[tuple[str, bytes, bool, dict[str, str]]] = deque(maxlen=backlog)
        self._lock = threading.Lock()
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._stopping = False
        self.connected_once = False
        self._refused = False  # a failed CONNACK since the last success: paho's next disconnect only repeats it
        self.last_failure = ""
        # Set on the loop when the broker refuses this login for good (bad password, not authorized):
        # retrying cannot help, so ``edgerun station`` stops with that reason (exit 2) instead of retrying forever.
        self.refused_for_good = asyncio.Event()
        self.refusal = ""

    def start(self) -> None:
        from edgerun.mqtt_client import (
            MQTT_CLEAN_START_FIRST_ONLY,
            connect_in_background,
            new_client,
            on_connect_failure,
        )

        self._loop = asyncio.get_running_loop()
        client = new_client(self.cfg, client_id=self.client_id, id_prefix="edgerun-station", reconnect=(0.5, 10.0))
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        on_connect_failure(client, self._on_connect_fail)
        client.on_message = self._on_message
        resume = bool(self.session_expiry_s and self.client_id)
        connect_in_background(
            client,
            self.host,
            self.port,
            keepalive=15,
            session_expiry_s=self.session_expiry_s if resume else 0,
            # Resuming: even the first CONNECT asks for the session the broker kept while the station was down.
            clean_start=False if resume else MQTT_CLEAN_START_FIRST_ONLY,
        )
        self._client = client

    async def stop(self) -> None:
        self._stopping = True
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            await asyncio.to_thread(client.loop_stop)

    def publish_event(self, payload: bytes) -> None:
        """A station event (auto-halt, actions) on the station's events topic; lost if the broker is away."""
        if self._client is not None:
            self._client.publish(STATION_EVENTS_TOPIC, payload, qos=1)

    def publish_retained(self, topic: str, payload: bytes, expiry_s: int = 0) -> bool:
        """A retained QoS 1 message (a retire or ack mark; empty: clears the topic's), which the broker forgets
        after ``expiry_s`` (MQTT 5 message expiry; 0: kept until cleared); False when there is no connection."""
        if self._client is None:
            return False
        props = None
        if expiry_s > 0:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = expiry_s
        info = self._client.publish(topic, payload, qos=1, retain=True, properties=props)
        return bool(info.rc == 0)

    # -- paho's thread ----------------------------------------------------------------

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    def _failed(self, text: str) -> None:
        if text != self.last_failure:  # a broker that stays away is one warning, not one per retry
            self.last_failure = text
            log.warning("station: %s", text)
        self._call(self.on_state, False, text)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any = None) -> None:
        from edgerun.mqtt_client import refused_for_good

        if getattr(reason, "is_failure", False):
            self._refused = True
            text = f"mqtt://{self.host}:{self.port} refused the connection ({reason})"
            if refused_for_good(reason):
                self._call(self._refuse_for_good, text)
            self._failed(f"{text}; retrying")
            return
        self._refused = False
        self.connected_once = True
        self.last_failure = ""
        client.subscribe([(topic, 1) for topic in SUBSCRIPTIONS])
        log.info("station: connected to mqtt://%s:%d", self.host, self.port)
        self._call(self.on_state, True, "")

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any = None) -> None:
        # paho follows an MQTT 5 CONNACK refusal with a disconnect it calls "Protocol error": the refusal said why.
        if self._stopping or self._refused:
            return
        broker = f"mqtt://{self.host}:{self.port}"
        if self.connected_once:
            self._failed(f"connection to {broker} lost ({reason}); reconnecting")
        else:
            self._failed(f"{broker} closed the connection before CONNACK ({reason}); reconnecting")

    def _on_connect_fail(self, why: str) -> None:
        self._refused = False
        self._failed(f"cannot reach mqtt://{self.host}:{self.port} ({why}); retrying")

    def _refuse_for_good(self, text: str) -> None:
        self.refusal = text
        self.refused_for_good.set()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self._lock:
            if len(self._queue) == self._queue.maxlen:
                self.dropped_backlog += 1
            self._queue.append((msg.topic, bytes(msg.payload), bool(msg.retain), user_properties(msg)))
            if self._scheduled:
                return
            self._scheduled = True
        self._call(self._drain)

    # -- the loop ---------------------------------------------------------------------

    def _drain(self) -> None:
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
            self._scheduled = False
        for topic, payload, retained, props in batch:
            self.on_message(topic, payload, retained, props)


def user_properties(msg: Any) -> dict[str, str]:
    """A message's MQTT 5 user properties (the first 16, bounded); untrusted, so only strings are kept."""
    pairs = getattr(getattr(msg, "properties", None), "UserProperty", None) or []
    out: dict[str, str] = {}
    for pair in pairs[:16]:
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], str):
            out.setdefault(pair[0][:40], pair[1][:200])
    return out

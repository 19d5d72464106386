"""Every MQTT connection edgerun makes, built one way: a paho MQTT 5 client from a ``MqttSinkConfig``.

One place decides the login (username/password), TLS (``build_ssl_context``),
the client id (unique unless the caller names one: two stations sharing
``edgerun-station`` would evict each other from the broker), the last will,
the MQTT 5 session (expiry, clean start) and how a lost connection is retried.

Two ways to run a client:

* paho's network thread (``connect_in_background``): paho reconnects by itself,
  doubling its delay between ``reconnect=(min_s, max_s)``; the OTA transport,
  the station, ``edgerun listen`` and the HIL observer;
* the caller's own loop (``send_connect``, ``reconnect=None``): the node's sink
  drives paho from asyncio and retries with ``backoff_delay`` (full jitter).

Operator tools connect with ``connect_blocking`` (a refused or unreachable
broker is one ``MqttError`` line naming why; a refused login exits 2) and publish with
``publish_confirmed`` (a PUBACK reason code the broker's ACL refused is an
error, not a silent drop).
"""

from __future__ import annotations

import secrets
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.client import MQTT_CLEAN_START_FIRST_ONLY as MQTT_CLEAN_START_FIRST_ONLY  # re-exported for callers
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgerun.backoff import backoff_delay as backoff_delay  # re-exported: the MQTT users' retry delay
from edgerun.config import MqttSinkConfig
from edgerun.errors import EXIT_NEEDS_OPERATOR, ConfigError, EdgerunError

# paho's own default: clients that do not say otherwise retry after 1 s, doubling up to 120 s.
PAHO_RECONNECT = (1.0, 120.0)


class MqttError(EdgerunError):
    """A broker that refused, could not be reached, or did not acknowledge: one line naming the broker and why."""


class MqttLoginRefused(MqttError):
    """The broker answered and refused this client for good (its login, its id): retrying cannot help."""

    exit_code = EXIT_NEEDS_OPERATOR


# CONNACK reason codes a person must act on (MQTT 5, 3.2.2.2): the same CONNECT would be refused again.
_REFUSALS_FOR_GOOD = frozenset({0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C})  # version, client id, login, not authorized,
# banned, authentication method; 0x88 (unavailable), 0x89 (busy) and 0x9F (rate) may pass with a retry.


def refused_for_good(reason: Any) -> bool:
    """Whether a failed CONNACK's reason code means the same login would be refused again."""
    return getattr(reason, "value", None) in _REFUSALS_FOR_GOOD


class ClosedBeforeConnack(ConnectionError):
    """The broker hung up while the CONNECT was being sent."""


@dataclass(frozen=True)
class Will:
    """What the broker publishes for a client that vanishes without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True
    content_type: str = "text/plain"


def unique_client_id(prefix: str) -> str:
    """``prefix`` plus a random suffix: two processes of the same kind never take each other's session."""
    return f"{prefix}-{secrets.token_hex(4)}"


def describe_connect_error(err: BaseException, connect_timeout_s: float) -> str:
    """A short operator-facing reason for a failed TCP connect or TLS handshake."""
    if isinstance(err, ssl.SSLCertVerificationError):
        return f"TLS: broker certificate not trusted ({err.verify_message or err.reason})"
    if isinstance(err, ssl.SSLError):
        return f"TLS handshake failed ({err.reason or err})"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, (socket.timeout, TimeoutError)):
        return f"no answer within {connect_timeout_s:g} s"
    if isinstance(err, socket.gaierror):
        return f"cannot resolve host ({err.strerror})"
    if isinstance(err, OSError):
        return err.strerror or str(err) or type(err).__name__
    return f"{type(err).__name__}: {err}"


def config_key(field: str) -> str:
    """Where a setting lives in node.toml, for errors about it."""
    return f"sinks.mqtt.{field}"


def build_ssl_context(cfg: MqttSinkConfig, name: Callable[[str], str] = config_key) -> ssl.SSLContext | None:
    """TLS settings from the config, or None for plain TCP; unreadable files are config errors.

    ``name`` turns a field ("tls_ca") into what the person set it as (a config key, a command-line option).
    """
    if not (cfg.tls or cfg.tls_ca or cfg.tls_cert):
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca or None)
    except ssl.SSLError as err:  # first: SSLError is an OSError too
        raise ConfigError(f"{name('tls_ca')}: {cfg.tls_ca} is not a PEM CA file ({err.reason or err})") from None
    except OSError as err:
        raise ConfigError(f"{name('tls_ca')}: cannot read {cfg.tls_ca} ({err.strerror or err})") from None
    if cfg.tls_cert:
        try:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        except ssl.SSLError as err:  # first: SSLError is an OSError too
            raise ConfigError(
                f"{name('tls_cert')}: {cfg.tls_cert} and {cfg.tls_key} are not a PEM certificate and its key"
                f" ({err.reason or err})"
            ) from None
        except OSError as err:
            raise ConfigError(
                f"{name('tls_cert')}: cannot read {cfg.tls_cert} or {cfg.tls_key} ({err.strerror or err})"
            ) from None
    if cfg.tls_insecure:
        ctx.check_hostname = False  # the chain is still verified; only the name check is skipped
    return ctx


def new_client(
    settings: MqttSinkConfig | None = None,
    *,
    client_id: str = "",
    id_prefix: str = "edgerun",
    will: Will | None = None,
    reconnect: tuple[float, float] | None = PAHO_RECONNECT,
    ssl_context: ssl.SSLContext | None = None,
) -> mqtt.Client:
    """A paho MQTT 5 client with the login and TLS of ``settings`` (None: anonymous, plain TCP).

    ``client_id`` is used as given; without one the id is ``id_prefix`` plus a random suffix.
    ``reconnect``: paho's own retry delays (min, max seconds), or None when the caller reconnects itself.
    ``ssl_context``: one the caller built already (once, not per connection); else built from ``settings``.
    """
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id or unique_client_id(id_prefix),
        protocol=MQTTProtocolVersion.MQTTv5,
        reconnect_on_failure=reconnect is not None,
    )
    if reconnect is not None:
        client.reconnect_delay_set(reconnect[0], reconnect[1])  # type: ignore[arg-type]  # paho sleeps floats fine
    if settings is not None:
        if settings.username:
            client.username_pw_set(settings.username, settings.password or None)
        context = ssl_context if ssl_context is not None else build_ssl_context(settings)
        if context is not None:
            client.tls_set_context(context)
            if settings.tls_insecure:
                client.tls_insecure_set(True)
    if will is not None:
        props = Properties(PacketTypes.WILLMESSAGE)
        props.ContentType = will.content_type
        client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain, properties=props)
    return client


def connect_properties(session_expiry_s: int) -> Properties | None:
    """The CONNECT's MQTT 5 properties: a session that outlives the connection by ``session_expiry_s``."""
    if not session_expiry_s:
        return None  # the same bytes on the wire as empty properties
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = session_expiry_s
    return props


def send_connect(client: mqtt.Client, cfg: MqttSinkConfig) -> None:
    """Blocking TCP connect, TLS handshake and CONNECT, for a caller that drives paho itself (no thread).

    Raises OSError (``describe_connect_error`` names it) or ClosedBeforeConnack.
    """
    rc = client.connect(
        cfg.host,
        cfg.port,
        keepalive=cfg.keepalive_s,
        clean_start=cfg.clean_start,
        properties=connect_properties(cfg.session_expiry_s),
    )
    if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
        raise ClosedBeforeConnack(mqtt.error_string(rc))


def connect_in_background(
    client: mqtt.Client,
    host: str,
    port: int,
    *,
    keepalive: int = 30,
    session_expiry_s: int = 0,
    clean_start: mqtt.CleanStartOption = MQTT_CLEAN_START_FIRST_ONLY,
) -> None:
    """Start paho's network thread, which connects, and reconnects as ``new_client(reconnect=...)`` said."""
    client.connect_async(
        host,
        port,
        keepalive=keepalive,
        clean_start=clean_start,
        properties=connect_properties(session_expiry_s),
    )
    client.loop_start()


def on_connect_failure(client: mqtt.Client, report: Callable[[str], None]) -> None:
    """Call ``report(why)`` each time paho's thread cannot reach the broker, with the OS's reason."""
    timeout_s = float(client.connect_timeout)

    def on_connect_fail(c: Any, userdata: Any) -> None:
        # paho calls this inside its ``except OSError``: the error it swallowed is still the one being handled.
        err = sys.exc_info()[1]
        report(describe_connect_error(err, timeout_s) if err is not None else "cannot connect")

    client.on_connect_fail = on_connect_fail


def connect_blocking(client: mqtt.Client, host: str, port: int, timeout: float = 10.0, keepalive: int = 30) -> None:
    """Connect, wait for the CONNACK and leave paho's thread running; otherwise one MqttError naming why.

    Takes ``on_connect`` for itself; set your own after this returns.
    """
    broker = f"mqtt://{host}:{port}"
    answered = threading.Event()
    outcome: list[str] = []
    for_good = [False]

    def on_connect(c: Any, u: Any, flags: Any, reason: Any, props: Any = None) -> None:
        if reason.is_failure:
            outcome.append(f"refused the connection ({reason})")
            for_good[0] = refused_for_good(reason)
        answered.set()

    def on_disconnect(c: Any, u: Any, flags: Any, reason: Any, props: Any = None) -> None:
        if not answered.is_set():  # under TLS 1.3, a missing client certificate looks like this
            outcome.append("closed the connection before CONNACK")
            answered.set()

    callers_on_disconnect = client.on_disconnect
    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    try:
        client.connect(host, port, keepalive=keepalive)
    except OSError as err:
        raise MqttError(f"{broker}: {describe_connect_error(err, float(client.connect_timeout))}") from None
    client.loop_start()
    if not answered.wait(timeout) or outcome:
        client.loop_stop()
        error = MqttLoginRefused if for_good[0] else MqttError
        raise error(f"{broker}: {outcome[0] if outcome else f'no CONNACK within {timeout:g} s'}")
    client.on_disconnect = callers_on_disconnect


def publish_confirmed(
    client: mqtt.Client,
    broker: str,
    messages: Sequence[tuple[str, bytes | str]],
    *,
    retain: bool = True,
    timeout: float = 10.0,
    refused_hint: str = "",
) -> None:
    """Publish each ``(topic, payload)`` at QoS 1 and wait for every PUBACK; a refusal or a timeout is one MqttError.

    An MQTT 5 broker answers a publish its ACL forbids with a PUBACK reason code (135, Not authorized), not by
    dropping the connection: without this check the publisher would report success. ``refused_hint``
    follows a refusal ("is this the operator's identity?").
    """
    refused: dict[int, str] = {}

    def on_publish(c: Any, u: Any, mid: int, reason: Any = None, props: Any = None) -> None:
        # paho calls this before it marks the message published, so the waiter below sees it in time.
        if getattr(reason, "is_failure", False):
            refused[mid] = str(reason)

    client.on_publish = on_publish
    infos = [(topic, client.publish(topic, payload, qos=1, retain=retain)) for topic, payload in messages]
    for topic, info in infos:
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise MqttError(f"{broker}: publishing {topic} failed ({mqtt.error_string(info.rc)})")
        info.wait_for_publish(timeout)
        if not info.is_published():
            raise MqttError(f"{broker}: publishing timed out")
        if info.mid in refused:
            hint = f": {refused_hint}" if refused_hint else ""
            raise MqttError(f"{broker}: the broker refused {topic} ({refused[info.mid]}){hint}")

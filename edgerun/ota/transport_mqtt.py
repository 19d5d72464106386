"""Releases over MQTT: a retained release message per model, payload files in retained, hashed chunks.

Topics (``P`` = ``edgerun/fleet/releases/<model>``)::

    P                       retained JSON: manifest, its signatures, keys.json and its signatures
    P/files/<file>/index    retained JSON: {"size", "chunk_size", "chunks": [sha256 of each chunk]}
    P/files/<file>/<n>      retained: chunk n of the file

Every chunk is retained, so a node needs no live publisher: it subscribes to
one chunk at a time (flow control, and the rate limit applies between
chunks), checks each against the index and the whole against the signed
hash, and after a dropped connection or a restart resumes at the first chunk
it does not have. The index is not signed; a lying index can only waste a
download, which the signed size and hash then refuse.

This client is our own paho-mqtt connection (edgerun/mqtt_client.py), running
paho's network thread; messages reach the event loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

import msgspec

from edgerun import wire
from edgerun.mqtt_client import connect_blocking, connect_in_background, new_client, publish_confirmed
from edgerun.ota.errors import Rejected
from edgerun.ota.manifest import parse_manifest
from edgerun.ota.rollout_gate import halted_for
from edgerun.ota.transport import MAX_METADATA, CappedWriter, Offer, RateLimiter, Transport, TransportError

log = logging.getLogger(__name__)

# The topics and the schema id live in edgerun.wire; these names stay for the modules that import them from here.
TOPIC_PREFIX = wire.RELEASES_PREFIX
RELEASE_SCHEMA = wire.RELEASE_SCHEMA
CHUNK_SIZE = 64 * 1024
MIN_CHUNK, MAX_CHUNK = 1024, 1 << 20
MAX_ENVELOPE = 4 * MAX_METADATA
WAIT_S = 10.0
CHUNK_TRIES = 3


release_topic = wire.release_topic
file_topic = wire.release_file_topic


def encode_release(manifest: bytes, manifest_sig: str, keys: bytes | None, keys_sig: str | None) -> bytes:
    """The retained release message, through wire.ReleaseEnvelope (base64 manifest and keys beside their
    signatures; the signatures cover the decoded bytes, not this envelope)."""
    envelope = wire.ReleaseEnvelope(
        manifest=base64.b64encode(manifest).decode(),
        manifest_sig=manifest_sig,
        keys=None if keys is None else base64.b64encode(keys).decode(),
        keys_sig=keys_sig,
    )
    return msgspec.json.encode(envelope)


def decode_release(payload: bytes, source: str) -> Offer:
    """The retained release message, length-checked before parsing, decoded through edgerun.wire."""
    if len(payload) > MAX_ENVELOPE:
        raise TransportError(f"{source}: release message larger than {MAX_ENVELOPE} bytes")
    try:
        # The schema first: the envelope's default must not pass a message that names none.
        schema = msgspec.json.decode(payload, type=wire.Head).schema
        if schema != RELEASE_SCHEMA:
            raise ValueError(f"schema {schema!r}")
        envelope = msgspec.json.decode(payload, type=wire.ReleaseEnvelope)
        manifest = base64.b64decode(envelope.manifest, validate=True)
        keys = None if envelope.keys is None else base64.b64decode(envelope.keys, validate=True)
    except (ValueError, binascii.Error, RecursionError) as err:  # msgspec.DecodeError is a ValueError
        raise TransportError(f"{source}: malformed release message ({err})") from None
    return Offer(source, manifest, envelope.manifest_sig, keys, envelope.keys_sig)


class MqttTransport(Transport):
    KEY = "mqtt"

    def __init__(self, host: str, port: int, client_id: str = "", cfg: Any = None, node_id: str = "") -> None:
        self.host, self.port = host, port
        self.client_id = client_id
        self.node_id = node_id  # for the rollout gate between chunks; empty: no gate
        self.cfg = cfg
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._subs: set[str] = set()
        self._latest: dict[str, bytes] = {}  # release topic -> last retained payload
        self._offered: dict[str, Offer] = {}  # model -> the offer poll() last handed the updater
        self._waiters: dict[str, asyncio.Queue[bytes]] = {}
        self._connected = False

    @classmethod
    def from_sink_config(cls, cfg: Any, node_id: str) -> MqttTransport:
        return cls(cfg.host, cfg.port, f"edgerun-ota-{node_id}", cfg, node_id)

    def describe(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    # -- connection (paho's thread) ---------------------------------------------------

    def _ensure(self) -> None:
        if self._client is not None:
            return
        self._loop = asyncio.get_running_loop()
        client = new_client(self.cfg, client_id=self.client_id, id_prefix="edgerun-ota", reconnect=(0.2, 10.0))
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        connect_in_background(client, self.host, self.port, keepalive=30)
        self._client = client

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any = None) -> None:
        if getattr(reason, "is_failure", False):
            log.warning("ota: mqtt %s refused the connection: %s", self.describe(), reason)
            return
        self._connected = True
        with self._lock:
            topics = list(self._subs)
        for topic in topics:
            client.subscribe(topic, qos=1)

    def _on_disconnect(self, *args: Any) -> None:
        self._connected = False

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        payload = bytes(msg.payload)
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._deliver, msg.topic, payload)

    def _deliver(self, topic: str, payload: bytes) -> None:
        if topic.count("/") == TOPIC_PREFIX.count("/") + 1:
            self._latest[topic] = payload
        queue = self._waiters.get(topic)
        if queue is not None:
            queue.put_nowait(payload)

    def _subscribe(self, topic: str) -> None:
        with self._lock:
            self._subs.add(topic)
        if self._connected:
            self._client.subscribe(topic, qos=1)

    def _unsubscribe(self, topic: str) -> None:
        with self._lock:
            self._subs.discard(topic)
        if self._connected:
            self._client.unsubscribe(topic)

    async def _wait(self, topic: str, what: str) -> bytes:
        """Subscribe to ``topic`` and return its (retained) message."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._waiters[topic] = queue
        self._subscribe(topic)
        try:
            return await asyncio.wait_for(queue.get(), WAIT_S)
        except asyncio.TimeoutError:
            state = "connected" if self._connected else "not connected"
            raise TransportError(f"{self.describe()}: no {what} on {topic} within {WAIT_S:.0f} s ({state})") from None
        finally:
            self._waiters.pop(topic, None)
            self._unsubscribe(topic)

    # -- the transport ------------------------------------------------------------------

    async def poll(self, model: str) -> Offer | None:
        self._ensure()
        topic = release_topic(model)
        if topic not in self._subs:
            self._subscribe(topic)  # stays subscribed: a new release arrives as a message
        payload = self._latest.get(topic)
        if not payload:
            return None
        offer = decode_release(payload, f"{self.describe()}/{topic}")
        self._offered[model] = offer
        return offer

    async def fetch(self, model: str, file: str, size: int, dest: Path, limiter: RateLimiter) -> None:
        self._ensure()
        raw = await self._wait(file_topic(model, file, "index"), "chunk index")
        chunk_size, hashes = _parse_index(raw, file, size)
        # Resume at a chunk boundary: a partial last chunk is fetched again whole.
        have = dest.stat().st_size if dest.exists() else 0
        keep = min(have - have % chunk_size, size)
        if keep != have:
            with open(dest, "r+b") as f:
                f.truncate(keep)
        writer = CappedWriter(dest, size, file)
        try:
            for index in range(keep // chunk_size, len(hashes)):
                self._check_rollout(model)
                chunk = await self._chunk(model, file, index, hashes[index])
                expected = min(chunk_size, size - index * chunk_size)
                if len(chunk) != expected:
                    raise TransportError(f"{file}: chunk {index} has {len(chunk)} bytes, expected {expected}")
                await limiter.consume(len(chunk))
                writer.write(chunk)
        finally:
            writer.close()
        writer.finish()

    def _check_rollout(self, model: str) -> None:
        """Stop between chunks when a signed step of this release (a halt) no longer covers this node."""
        offered, payload = self._offered.get(model), self._latest.get(release_topic(model))
        if offered is None or not payload:
            return
        try:
            newer = decode_release(payload, release_topic(model))
        except TransportError:
            return
        why = halted_for(self.node_id, offered, newer)
        if why is not None:
            log.warning("ota: stopped downloading %s: %s", model, why)
            raise TransportError(f"{self.describe()}: stopped downloading {model}: {why}")

    async def _chunk(self, model: str, file: str, index: int, sha256: str) -> bytes:
        for attempt in range(CHUNK_TRIES):
            chunk = await self._wait(file_topic(model, file, str(index)), f"chunk {index}")
            if hashlib.sha256(chunk).hexdigest() == sha256:
                return chunk
            log.warning("ota: %s chunk %d does not match its index hash (try %d)", file, index, attempt + 1)
        raise TransportError(f"{file}: chunk {index} does not match its hash after {CHUNK_TRIES} tries")

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            await asyncio.to_thread(client.loop_stop)


def _parse_index(raw: bytes, file: str, size: int) -> tuple[int, list[str]]:
    if len(raw) > MAX_ENVELOPE:
        raise TransportError(f"{file}: chunk index larger than {MAX_ENVELOPE} bytes")
    try:
        doc = json.loads(raw)
        declared, chunk_size, hashes = int(doc["size"]), int(doc["chunk_size"]), [str(h) for h in doc["chunks"]]
    except (ValueError, KeyError, TypeError) as err:
        raise TransportError(f"{file}: malformed chunk index ({err})") from None
    if declared > size:
        raise Rejected("oversized", f"{file}: the chunk index says {declared} bytes, the manifest signed {size}")
    if declared < size:
        raise Rejected("truncated", f"{file}: the chunk index says {declared} bytes, the manifest signed {size}")
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK or len(hashes) != -(-size // chunk_size):
        raise TransportError(f"{file}: chunk index does not describe {size} bytes in chunks of {chunk_size}")
    return chunk_size, hashes


def publish_release(
    root: Path, model: str, host: str, port: int, chunk_size: int = CHUNK_SIZE, cfg: Any = None, timeout: float = 30.0
) -> None:
    """Publish a release directory (``edgerun ota publish --to``) retained on the broker."""
    model_dir = root / model
    manifest = (model_dir / "manifest.json").read_bytes()
    sig = (model_dir / "manifest.json.minisig").read_text()
    keys = (root / "keys.json").read_bytes() if (root / "keys.json").is_file() else None
    keys_sig = (root / "keys.json.minisig").read_text() if (root / "keys.json.minisig").is_file() else None
    parsed = parse_manifest(manifest)
    files = [f for f in (parsed.target.file, parsed.delta.file if parsed.delta else "") if f]
    client = new_client(cfg, id_prefix=f"edgerun-ota-publisher-{model}")
    connect_blocking(client, host, port)
    try:
        files_messages: list[tuple[str, bytes | str]] = []
        for file in files:
            data = (model_dir / file).read_bytes()
            chunks = [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]
            files_messages += [(file_topic(model, file, str(index)), chunk) for index, chunk in enumerate(chunks)]
            index_doc = {
                "size": len(data),
                "chunk_size": chunk_size,
                "chunks": [hashlib.sha256(c).hexdigest() for c in chunks],
            }
            files_messages.append((file_topic(model, file, "index"), json.dumps(index_doc)))
        broker = f"mqtt://{host}:{port}"
        hint = "is this the operator's identity?"
        # Every chunk acknowledged first, the release message last: a node that sees it finds every chunk there,
        # and a broker that refuses the chunks (its ACL) never gets a release pointing at nothing.
        publish_confirmed(client, broker, files_messages, timeout=timeout, refused_hint=hint)
        release = encode_release(manifest, sig, keys, keys_sig)
        publish_confirmed(client, broker, [(release_topic(model), release)], timeout=timeout, refused_hint=hint)
    finally:
        client.disconnect()
        client.loop_stop()

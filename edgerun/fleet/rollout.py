"""Staged model rollouts: canary cohorts, promotion and halt, each step a release the nodes verify.

What steers a node is the signed manifest alone: its ``rollout`` block (percent
and salt) is covered by the release key's signature, and the node's updater
takes a release only when ``sha256(salt:node id)`` falls below the percent
(``edgerun.ota.manifest.in_rollout``). Promoting re-signs the same manifest
with a higher percent and the same salt, so every node inside the 10 % cohort
is still inside at 50 %; halting re-signs it at 0 %, so no further node takes
it. An unsigned or forged message cannot move a node: it fails the signature
check before the percent is read.

Beside the release, a retained rollout state (``edgerun/fleet/rollouts/<model>``,
schema ``edgerun.rollout/1``) tells the ground station and ``edgerun fleet
status`` which phase the rollout is in and why it was halted. It is signed by
the same release key (a minisign signature over canonical JSON), so a station
shows who set it and a forged one is marked unverified.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from edgerun import wire
from edgerun.errors import EXIT_NEEDS_OPERATOR
from edgerun.ota.errors import OtaError, Rejected, SignatureError
from edgerun.ota.manifest import canonical_json, encode_manifest, format_time, parse_manifest
from edgerun.ota.minisign import PublicKey, SecretKey, comment_fields, parse_signatures
from edgerun.ota.transport import Offer
from edgerun.ota.transport_mqtt import encode_release, release_topic

if TYPE_CHECKING:
    from edgerun.fleet.trusted_release import CheckedRelease

ROLLOUT_SCHEMA = wire.ROLLOUT_SCHEMA
ROLLOUT_PREFIX = wire.ROLLOUTS_PREFIX
MAX_STATE_BYTES = 16 * 1024
Phase = Literal["canary", "promoted", "complete", "halted"]
PHASES = ("canary", "promoted", "complete", "halted")


def rollout_topic(model: str) -> str:
    return wire.rollout_topic(model)


def default_salt(model: str, version: int) -> str:
    """A fresh cohort for every release, fixed for all of that release's steps."""
    return f"{model}-v{version}"


@dataclass(frozen=True)
class RolloutState:
    """One step of a rollout, as the station and ``fleet status`` show it."""

    model: str
    version: int
    percent: float
    salt: str
    phase: str
    reason: str = ""
    by: str = "operator"  # "operator" or "auto" (the station's canary watch)
    ts: float = 0.0
    base_version: int | None = None
    step: int = 0  # the release's signed rollout.step this state goes with (edgerun.ota.steps)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def state_comment(state: RolloutState, timestamp: int) -> str:
    return (
        f"timestamp:{timestamp}\tfile:rollout.json\tname:{state.model}\tversion:{state.version}"
        f"\tpercent:{state.percent:g}\tphase:{state.phase}"
    )


def encode_state(state: RolloutState, key: SecretKey) -> bytes:
    """The retained rollout message: the state as canonical JSON and its minisign signature."""
    doc = canonical_json(state.to_json())
    sig = key.sign(doc, state_comment(state, int(state.ts or time.time()))).to_text()
    return msgspec.json.encode(wire.RolloutEnvelope(state=base64.b64encode(doc).decode(), sig=sig))


@dataclass(frozen=True)
class SignedState:
    state: RolloutState
    key_id: str  # the key that signed it (as the signature says)
    verified: bool  # checked against a release key we trust


def decode_state(payload: bytes, trusted: dict[str, PublicKey] | None = None) -> SignedState:
    """Parse a rollout message (untrusted bytes; ValueError says what is wrong) and check its signature."""
    if len(payload) > MAX_STATE_BYTES:
        raise ValueError(f"rollout message larger than {MAX_STATE_BYTES} bytes")
    try:
        env = msgspec.json.decode(payload, type=wire.RolloutEnvelope)
        doc = base64.b64decode(env.state, validate=True)
        sigs = parse_signatures(env.sig, "rollout signature")
        raw = msgspec.json.decode(doc, type=wire.RolloutStateDoc)
        state = RolloutState(
            model=raw.model,
            version=raw.version,
            percent=raw.percent,
            salt=raw.salt,
            phase=raw.phase,
            reason=raw.reason[:500],
            by=raw.by,
            ts=raw.ts,
            base_version=raw.base_version,
            step=raw.step,
        )
    except (ValueError, binascii.Error, SignatureError, RecursionError) as err:  # msgspec.DecodeError is one
        raise ValueError(f"malformed rollout message ({type(err).__name__}: {err})"[:300]) from None
    if state.phase not in PHASES or not 0.0 <= state.percent <= 100.0:
        raise ValueError(f"rollout message: phase {state.phase!r} or percent {state.percent} out of range")
    sig = sigs[0]
    verified = False
    key = (trusted or {}).get(sig.key_id_hex)
    if key is not None:
        try:
            sig.verify(doc, key)
            fields = comment_fields(sig.trusted_comment)
            verified = fields.get("name") == state.model and fields.get("version") == str(state.version)
        except SignatureError:
            verified = False
    return SignedState(state, sig.key_id_hex, verified)


class RolloutRefused(OtaError):
    """A rollout step the operator must not take (an unverified or halted release); exit 2."""

    exit_code = EXIT_NEEDS_OPERATOR


def resign(offer: Offer, percent: float, key: SecretKey, now: float | None = None) -> Offer:
    """The same release with its rollout percent changed and its step counted up, signed again by ``key``.

    The salt, target, delta and expiry stay: cohorts are nested and the payload already on the broker still matches.
    Callers re-sign only an offer they verified (``RolloutControl.step`` takes a ``CheckedRelease``).
    """
    if not 0.0 <= percent <= 100.0:
        raise OtaError(f"rollout percent must be within 0..100, got {percent:g}")
    manifest = parse_manifest(offer.manifest)
    now = time.time() if now is None else now
    if manifest.expires_ts <= now:
        raise OtaError(f"{manifest.name} v{manifest.version} expired at {manifest.expires}; publish a new release")
    changed = msgspec.structs.replace(
        manifest,
        created=format_time(now),
        rollout=msgspec.structs.replace(manifest.rollout, percent=float(percent), step=manifest.rollout.step + 1),
    )
    data = encode_manifest(changed)
    sig = key.sign(data, changed.trusted_comment(int(now))).to_text()
    return Offer(offer.source, data, sig, offer.keys, offer.keys_sig)


def check_signing_key(offer: Offer, key: SecretKey) -> None:
    """Refuse to re-sign a release with a key its keys.json does not list (the nodes would reject it)."""
    if offer.keys is None:
        return
    try:
        listed = {entry["id"] for entry in json.loads(offer.keys)["keys"]}
    except (ValueError, KeyError, TypeError) as err:
        raise OtaError(f"the release's keys.json is malformed ({err})") from None
    kid = key.public_key.id_hex
    if kid not in listed:
        known = ", ".join(sorted(listed))
        raise Rejected("unknown_key", f"signing key {kid} is not a release key in keys.json ({known})")


class RolloutControl:
    """Publishes rollout steps (re-signed releases and signed states) to the broker; blocking, use from a thread."""

    def __init__(
        self, host: str, port: int, key: SecretKey, client_id: str = "edgerun-rollout", cfg: Any = None
    ) -> None:
        self.host, self.port, self.key = host, port, key
        self.client_id = client_id  # a prefix: each publish connects with a fresh unique id
        self.cfg = cfg  # credentials and TLS (a MqttSinkConfig), for a broker with access control
        self._lock = threading.Lock()

    def _publish(self, messages: list[tuple[str, bytes]], timeout: float = 10.0) -> None:
        from edgerun.mqtt_client import connect_blocking, new_client, publish_confirmed

        with self._lock:
            client = new_client(self.cfg, id_prefix=self.client_id)
            connect_blocking(client, self.host, self.port)
            try:
                # The broker's ACL answers a forbidden publish with a PUBACK reason code, checked here.
                publish_confirmed(
                    client,
                    f"mqtt://{self.host}:{self.port}",
                    messages,
                    timeout=timeout,
                    refused_hint="is this the operator's identity?",
                )
            finally:
                client.disconnect()
                client.loop_stop()

    def step(
        self,
        release: CheckedRelease,
        percent: float,
        phase: str,
        reason: str = "",
        by: str = "operator",
        base_version: int | None = None,
    ) -> RolloutState:
        """Re-sign a verified release at ``percent`` and publish it with the matching rollout state.

        Only a release that verified against the root keys is signed again; a halt is final for its version.
        """
        current = release.require_verified()
        offer = release.offer
        assert offer is not None  # require_verified checked it
        if current.rollout.percent <= 0.0 and percent > 0.0:
            raise RolloutRefused(
                f"{current.name} v{current.version} is halted and a halted release is never taken again by the "
                "nodes: publish a new version (edgerun fleet publish)"
            )
        check_signing_key(offer, self.key)
        new = resign(offer, percent, self.key)
        manifest = parse_manifest(new.manifest)
        state = RolloutState(
            model=manifest.name,
            version=manifest.version,
            percent=float(percent),
            salt=manifest.rollout.salt,
            phase=phase,
            reason=reason,
            by=by,
            ts=time.time(),
            base_version=base_version,
            step=manifest.rollout.step,
        )
        envelope = encode_release(new.manifest, new.manifest_sig, new.keys, new.keys_sig)
        # The state first: a station that sees the new release already knows why it changed.
        self._publish(
            [(rollout_topic(manifest.name), encode_state(state, self.key)), (release_topic(manifest.name), envelope)]
        )
        return state

    def announce(self, state: RolloutState) -> None:
        """Publish a rollout state for a release just published (``fleet publish``)."""
        self._publish([(rollout_topic(state.model), encode_state(state, self.key))])


def phase_for(percent: float) -> str:
    if percent <= 0.0:
        return "halted"
    if percent >= 100.0:
        return "complete"
    return "promoted"


def read_topics(
    host: str, port: int, topics: list[str], seconds: float = 2.0, quiet_s: float | None = 0.3, cfg: Any = None
) -> dict[str, bytes]:
    """The last message on each topic under ``topics`` (wildcards allowed) within ``seconds``.

    With ``quiet_s`` it returns as soon as nothing arrived for that long: retained messages follow the SUBACK at
    once, so that is all a late subscriber is handed. ``quiet_s=None`` listens the whole time (live topics).
    """
    from edgerun.mqtt_client import connect_blocking, new_client

    got: dict[str, bytes] = {}
    subscribed = threading.Event()
    lock = threading.Lock()
    last = [time.monotonic()]

    def on_subscribe(*args: Any) -> None:
        with lock:
            last[0] = time.monotonic()
        subscribed.set()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        with lock:
            if msg.payload:
                got[msg.topic] = bytes(msg.payload)
            else:
                got.pop(msg.topic, None)
            last[0] = time.monotonic()

    client = new_client(cfg, id_prefix="edgerun-fleet")
    client.on_subscribe, client.on_message = on_subscribe, on_message
    connect_blocking(client, host, port)
    client.subscribe([(t, 1) for t in topics])
    try:
        if not subscribed.wait(5.0):
            raise OtaError(f"mqtt://{host}:{port}: no answer to the subscription within 5 s")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with lock:
                if quiet_s is not None and time.monotonic() - last[0] > quiet_s:
                    break
        with lock:
            return dict(got)
    finally:
        client.disconnect()
        client.loop_stop()

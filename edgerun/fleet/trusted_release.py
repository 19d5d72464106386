"""A retained release checked exactly as a node checks it, before the station or a ``fleet`` command believes it.

Anyone who can publish to the broker can retain a release message, so the
station never shows, promotes or halts what it read there until it verified
it the node's way: the root keys (``--root-key``) -> ``keys.json`` at or above
the newest version verified -> a release key -> the manifest's signatures and
their trusted comments, the model named by the topic, the manifest's expiry, and the step order
(``edgerun.ota.steps``). The rollout state message beside it is believed only
when a release key of that verified ``keys.json`` signed it, and a release
older than its signed state is a replay.

Only a ``CheckedRelease`` whose ``trust`` is ``"verified"`` can be re-signed
(``edgerun.fleet.rollout.RolloutControl.step`` refuses anything else), so the
release key never signs bytes an attacker chose.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from edgerun.fleet.rollout import RolloutRefused, SignedState, decode_state
from edgerun.ota.errors import OtaError, Rejected, SignatureError
from edgerun.ota.manifest import Manifest, parse_manifest
from edgerun.ota.minisign import PublicKey
from edgerun.ota.steps import StepLedger
from edgerun.ota.transport import Offer
from edgerun.ota.transport_mqtt import decode_release, release_topic
from edgerun.ota.trust import Keyring, TrustStore

# "forged": the signature chain does not hold now (a bad or unknown signature, or a keys.json or manifest past its
# signed expiry, as the node's updater refuses them; ``code`` says which); "replayed": signed, but older than a step
# already verified (or of a halted version); "unverified": no root key was given, so nothing can be checked;
# "unreadable": not a release.
Trust = Literal["verified", "forged", "replayed", "unverified", "unreadable"]


class UnverifiedRelease(RolloutRefused):
    """An action on a release that did not verify: refused, exit 2 (a person must look at the broker)."""


@dataclass(frozen=True)
class CheckedRelease:
    model: str
    offer: Offer | None
    manifest: Manifest | None  # parsed for display even when not verified; trust says whether to believe it
    trust: Trust
    code: str = ""  # the node's rejection code when not verified (bad_signature, unknown_key, replayed, ...)
    reason: str = ""
    keyring: Keyring | None = None
    state: SignedState | None = None  # the rollout state, only when a trusted release key signed it
    state_error: str = ""

    @property
    def verified(self) -> bool:
        return self.trust == "verified"

    def require_verified(self) -> Manifest:
        """The manifest, or UnverifiedRelease naming why every action on this release is refused."""
        if self.trust != "verified" or self.manifest is None or self.offer is None:
            raise UnverifiedRelease(f"release of {self.model!r} is {self.trust}: {self.reason}; refusing to act on it")
        return self.manifest


class ReleaseVerifier:
    """Verifies retained releases and rollout states as a node would; remembers keys.json and step order."""

    def __init__(self, roots: list[PublicKey], threshold: int = 1, steps_path: Path | None = None) -> None:
        self.trust = TrustStore(roots, threshold) if roots else None
        self.keyring: Keyring | None = None  # the newest keys.json verified so far (a replayed older one is refused)
        self.steps = StepLedger(steps_path)
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        return self.trust is not None

    def check(
        self, model: str, payload: bytes, state_payload: bytes | None = None, now: float | None = None
    ) -> CheckedRelease:
        """Never raises for what came over the broker: the result says what is wrong."""
        now = time.time() if now is None else now
        try:
            offer = decode_release(payload, release_topic(model))
            shown = parse_manifest(offer.manifest)
        except OtaError as err:
            return CheckedRelease(model, None, None, "unreadable", "malformed", str(err)[:300])
        if self.trust is None:
            return CheckedRelease(
                model,
                offer,
                shown,
                "unverified",
                "no_root_key",
                "no root key given (--root-key), so the release cannot be verified",
            )
        with self._lock:
            try:
                keyring = self._keyring(offer, now)
                manifest = TrustStore.verify_manifest(offer.manifest, offer.manifest_sig, keyring)
                if manifest.name != model:
                    raise Rejected("wrong_model", f"a release of {manifest.name!r} on the topic of {model!r}")
                if manifest.expires_ts <= now:
                    # The updater's own rule and words (ota.updater.Updater.check): no node takes it any more.
                    raise Rejected("expired", f"manifest v{manifest.version} expired at {manifest.expires}")
            except (Rejected, SignatureError) as err:
                code = err.code if isinstance(err, Rejected) else "bad_signature"
                return CheckedRelease(model, offer, shown, "forged", code, str(err)[:300])
            state, state_error = self._state(state_payload, keyring, manifest)
            try:
                self.steps.check(manifest)
                if (
                    state is not None
                    and state.state.version == manifest.version
                    and (
                        state.state.step > manifest.rollout.step
                        or (
                            state.state.phase == "halted"
                            and manifest.rollout.percent > 0
                            and state.state.step >= manifest.rollout.step
                        )
                    )
                ):
                    raise Rejected(
                        "replayed",
                        f"{model} v{manifest.version}: the release is step {manifest.rollout.step} at "
                        f"{manifest.rollout.percent:g}%, the signed rollout state is step {state.state.step} "
                        f"({state.state.phase}): an older step was replayed",
                    )
            except Rejected as err:
                return CheckedRelease(
                    model, offer, manifest, "replayed", err.code, str(err)[:300], keyring, state, state_error
                )
            self.steps.record(manifest)
        return CheckedRelease(model, offer, manifest, "verified", keyring=keyring, state=state, state_error=state_error)

    def _keyring(self, offer: Offer, now: float) -> Keyring:
        assert self.trust is not None
        # The node's own rule (ota.trust.TrustStore.release_keyring), so the station trusts exactly what a node would.
        keyring = self.trust.release_keyring(offer.keys, offer.keys_sig, now, self.keyring, offer.source)
        if self.keyring is None or keyring.version > self.keyring.version:
            self.keyring = keyring
        return keyring

    @staticmethod
    def _state(payload: bytes | None, keyring: Keyring, manifest: Manifest) -> tuple[SignedState | None, str]:
        if payload is None:
            return None, ""
        revoked = set(keyring.doc.revoked)
        keys = {kid: key for kid, key in keyring.public_keys().items() if kid not in revoked}
        try:
            signed = decode_state(payload, keys)
        except ValueError as err:
            return None, str(err)[:300]
        if not signed.verified:
            return None, f"rollout state signed by key {signed.key_id}, not a release key of keys.json: ignored"
        if signed.state.model != manifest.name:
            return None, f"rollout state is for {signed.state.model!r}: ignored"
        return signed, ""


async def check_payload_on_broker(release: CheckedRelease, host: str, port: int, cfg: Any = None) -> str:
    """Download a verified release's payload from the broker as a node would and check its signed hash.

    Before a promote, so the operator learns of swapped chunks before the nodes do. Returns a note; raises
    UnverifiedRelease when the bytes on the broker are not the signed ones. A payload the broker does not hold
    (a release served by HTTP or a directory) cannot be checked here: the note says so and the nodes check it.
    """
    from edgerun.ota.payload import sha256_file
    from edgerun.ota.transport import RateLimiter, TransportError
    from edgerun.ota.transport_mqtt import MqttTransport

    manifest = release.require_verified()
    if manifest.target.file:
        file, size, sha256 = manifest.target.file, manifest.target.size, manifest.target.sha256
    else:
        assert manifest.delta is not None  # parse_manifest refuses a release with neither
        file, size, sha256 = manifest.delta.file, manifest.delta.size, manifest.delta.sha256
    transport = MqttTransport(host, port, f"edgerun-verify-{secrets.token_hex(4)}", cfg)
    try:
        with tempfile.TemporaryDirectory(prefix="edgerun-verify-") as tmp:
            dest = Path(tmp) / "payload"
            try:
                await transport.fetch(release.model, file, size, dest, RateLimiter(0))
            except Rejected as err:
                what = f"{release.model} v{manifest.version}: payload {file} on the broker"
                raise UnverifiedRelease(f"{what}: {err}") from None
            except TransportError as err:
                return f"payload {file} not checked ({err}); the nodes check its hash"
            got = await asyncio.to_thread(sha256_file, dest)
    finally:
        await transport.close()
    if got != sha256:
        raise UnverifiedRelease(
            f"{release.model} v{manifest.version}: payload {file} on the broker hashes to "
            f"{got[:16]}..., the manifest signed {sha256[:16]}..."
        )
    return f"payload {file} on the broker matches its signed sha256"

"""Two levels of keys, as in TUF: offline root keys sign the list of release keys, release keys sign manifests.

The node is provisioned with root public keys only (``ota.root_keys`` and
``ota.root_threshold``). ``keys.json`` names the release keys, how many of
them must sign a manifest, and the keys revoked; it is signed by at least
``root_threshold`` distinct root keys, has a version that only goes up and an
expiry. Rotating or revoking a release key is a new ``keys.json`` with a
higher version; the node keeps the newest it has verified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

import msgspec

from edgerun.ota.errors import Rejected, SignatureError
from edgerun.ota.manifest import Manifest, canonical_json, format_time, parse_manifest, parse_time
from edgerun.ota.minisign import PublicKey, Signature, comment_fields, parse_signatures

KEYS_SCHEMA = "edgerun.ota.keys/1"
MAX_KEYS = 256 * 1024
MAX_SIGNATURES = 64 * 1024


class ReleaseKey(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(pattern=r"^[0-9A-F]{16}$")]
    public: str  # the base64 line of the minisign public key
    comment: str = ""


class KeyList(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    schema: str = KEYS_SCHEMA
    version: Annotated[int, msgspec.Meta(ge=1)]
    created: str
    expires: str
    threshold: Annotated[int, msgspec.Meta(ge=1)] = 1
    keys: list[ReleaseKey]
    revoked: list[Annotated[str, msgspec.Meta(pattern=r"^[0-9A-F]{16}$")]] = msgspec.field(default_factory=list)


def make_key_list(
    release_keys: list[PublicKey], version: int, expires_days: float, threshold: int = 1, revoked: tuple[str, ...] = ()
) -> bytes:
    """Canonical ``keys.json`` bytes, ready to be signed by root keys."""
    now = time.time()
    doc = KeyList(
        version=version,
        created=format_time(now),
        expires=format_time(now + expires_days * 86400),
        threshold=threshold,
        keys=[ReleaseKey(id=k.id_hex, public=k.line(), comment=k.comment) for k in release_keys],
        revoked=sorted(set(revoked)),
    )
    return canonical_json(msgspec.to_builtins(doc))


def keys_trusted_comment(version: int, timestamp: int) -> str:
    return f"timestamp:{timestamp}\tfile:keys.json\tkeys-version:{version}"


@dataclass(frozen=True)
class Keyring:
    """A verified ``keys.json``: the release keys in force."""

    doc: KeyList
    raw: bytes
    signatures: str

    @property
    def version(self) -> int:
        return self.doc.version

    def public_keys(self) -> dict[str, PublicKey]:
        out = {}
        for entry in self.doc.keys:
            key = PublicKey.parse(entry.public, f"keys.json: key {entry.id}")
            if key.id_hex != entry.id:
                raise Rejected("malformed", f"keys.json: key {entry.id} has id {key.id_hex} in its public key")
            out[entry.id] = key
        return out


def _signatures(text: str, what: str) -> list[Signature]:
    if len(text) > MAX_SIGNATURES:
        raise Rejected("bad_signature", f"{what}: larger than {MAX_SIGNATURES} bytes")
    try:
        return parse_signatures(text, what)
    except SignatureError as err:
        raise Rejected("bad_signature", str(err)) from None


def _count_valid(
    data: bytes, sigs: list[Signature], keys: dict[str, PublicKey], revoked: set[str], what: str
) -> tuple[list[Signature], tuple[str, str] | None]:
    """Signatures by distinct trusted keys that verify, and why the others did not count."""
    valid: list[Signature] = []
    seen: set[str] = set()
    reasons: list[tuple[str, str]] = []  # (code, message), worst first when reported
    for sig in sigs:
        kid = sig.key_id_hex
        if kid in revoked:
            reasons.append(("revoked_key", f"{what}: signed by key {kid}, which is revoked"))
            continue
        key = keys.get(kid)
        if key is None:
            reasons.append(("unknown_key", f"{what}: signed by unknown key {kid}"))
            continue
        try:
            sig.verify(data, key)
        except SignatureError as err:
            reasons.append(("bad_signature", f"{what}: bad signature: {err}"))
            continue
        if kid not in seen:
            seen.add(kid)
            valid.append(sig)
    order = {"bad_signature": 0, "revoked_key": 1, "unknown_key": 2}
    reasons.sort(key=lambda r: order[r[0]])
    return valid, reasons[0] if reasons else None


def _require(valid: list[Signature], why: tuple[str, str] | None, threshold: int, what: str) -> None:
    if len(valid) >= threshold:
        return
    if valid:
        raise Rejected(
            "below_threshold", f"{what}: {len(valid)} valid signature(s) from trusted keys, {threshold} needed"
        )
    if why is not None:
        raise Rejected(*why)
    raise Rejected("bad_signature", f"{what}: no signature")


class TrustStore:
    """Root keys, and the checks that take a release from signed bytes to a trusted manifest."""

    def __init__(self, roots: list[PublicKey], threshold: int = 1) -> None:
        if threshold < 1 or threshold > len(roots):
            raise Rejected("config", f"root threshold {threshold} needs at least that many root keys ({len(roots)})")
        self.roots = {k.id_hex: k for k in roots}
        self.threshold = threshold

    def verify_keys(self, data: bytes, signatures: str, now: float, trusted: Keyring | None) -> Keyring:
        """Check ``keys.json``: signed by enough roots, not older than ``trusted``, not expired."""
        if len(data) > MAX_KEYS:
            raise Rejected("malformed", f"keys.json: larger than {MAX_KEYS} bytes")
        sigs = _signatures(signatures, "keys.json.minisig")
        valid, why = _count_valid(data, sigs, self.roots, set(), "keys.json")
        _require(valid, why, self.threshold, "keys.json")
        try:
            doc = msgspec.json.decode(data, type=KeyList)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise Rejected("malformed", f"keys.json: {err}") from None
        if doc.schema != KEYS_SCHEMA:
            raise Rejected("malformed", f"keys.json: schema {doc.schema!r} is not {KEYS_SCHEMA!r}")
        for sig in valid:
            said = comment_fields(sig.trusted_comment).get("keys-version")
            if said != str(doc.version):
                raise Rejected(
                    "bad_signature",
                    f"keys.json: trusted comment of key {sig.key_id_hex} says keys-version {said}, "
                    f"the file {doc.version}",
                )
        if trusted is not None and doc.version < trusted.version:
            raise Rejected(
                "rollback", f"keys.json: version {doc.version} is older than the trusted version {trusted.version}"
            )
        if parse_time(doc.expires, "keys.json expires") <= now:
            raise Rejected("expired", f"keys.json: version {doc.version} expired at {doc.expires}")
        if doc.threshold > len(doc.keys):
            raise Rejected("malformed", f"keys.json: threshold {doc.threshold} is above its {len(doc.keys)} keys")
        keyring = Keyring(doc, data, signatures)
        keyring.public_keys()  # every entry must parse
        return keyring

    def release_keyring(
        self, keys: bytes | None, keys_sig: str | None, now: float, trusted: Keyring | None, source: str
    ) -> Keyring:
        """The release keys an offer is checked with: its own ``keys.json`` once verified against the roots and
        ``trusted`` (never older), else the trusted one while it has not expired. The node and the station both
        take their keys from here, so the station believes a release exactly when a node would; each caller
        keeps a returned keyring newer than ``trusted`` its own way (the node on disk, the station in memory).
        """
        if keys is None or keys_sig is None:
            if trusted is None:
                raise Rejected("no_keys", f"{source}: no keys.json and none trusted yet")
            if trusted.doc.expires and now >= parse_time(trusted.doc.expires, "keys.json expires"):
                raise Rejected("expired", f"keys.json: version {trusted.version} expired at {trusted.doc.expires}")
            return trusted
        return self.verify_keys(keys, keys_sig, now, trusted)

    @staticmethod
    def verify_manifest(data: bytes, signatures: str, keyring: Keyring) -> Manifest:
        """Check a manifest's signatures against the release keys (threshold, revocations), then parse it."""
        sigs = _signatures(signatures, "manifest.json.minisig")
        keys = keyring.public_keys()
        valid, why = _count_valid(data, sigs, keys, set(keyring.doc.revoked), "manifest.json")
        _require(valid, why, keyring.doc.threshold, "manifest.json")
        manifest = parse_manifest(data)
        for sig in valid:
            fields = comment_fields(sig.trusted_comment)
            if fields.get("name") != manifest.name or fields.get("version") != str(manifest.version):
                raise Rejected(
                    "bad_signature",
                    f"manifest.json: trusted comment of key {sig.key_id_hex} says "
                    f"{fields.get('name')} v{fields.get('version')}, the manifest {manifest.name} v{manifest.version}",
                )
        return manifest

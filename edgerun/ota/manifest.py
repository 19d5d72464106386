"""The release manifest: what a signed release promises, and the checks a node makes of it.

A manifest is canonical JSON (sorted keys, no spaces) signed as a whole file,
so the signature covers every byte; the node parses it only after the
signature checked out, with a size cap first. It pins the target's hash and
size (and for a delta, the base's), so no byte the node downloads is trusted
until it hashes to a value a release key signed.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from typing import Annotated, Any, Final, Literal

import msgspec

from edgerun.ota.errors import Rejected

MANIFEST_SCHEMA: Final = "edgerun.ota.manifest/1"  # Final: the Literal schema field takes it as its default
MAX_MANIFEST = 64 * 1024
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

Sha256 = Annotated[str, msgspec.Meta(pattern=SHA256_RE.pattern)]
# File names are joined to directories, URLs and MQTT topics: keep them plain.
FileName = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$")]
Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Target(Strict, kw_only=True):
    sha256: Sha256
    size: Size
    file: FileName = ""  # empty: the release ships only a delta


class Delta(Strict, kw_only=True):
    base_version: Annotated[int, msgspec.Meta(ge=0)]
    base_sha256: Sha256
    algorithm: Literal["bsdiff4", "zstd"]
    sha256: Sha256
    size: Size
    file: FileName


class Compatibility(Strict, kw_only=True):
    boards: list[str] = msgspec.field(default_factory=list)  # empty: any board
    min_runtime: str = "0"


class Rollout(Strict, kw_only=True):
    percent: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 100.0
    salt: str = ""
    # Every re-signed step of one version (promote, halt) counts up, so a node and the station can refuse an
    # older step replayed after a newer one (a recorded promote after a halt); see edgerun.ota.steps.
    step: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0


class Manifest(Strict, kw_only=True):
    schema: Literal["edgerun.ota.manifest/1"] = MANIFEST_SCHEMA
    name: Annotated[str, msgspec.Meta(pattern=NAME_RE.pattern)]
    version: Annotated[int, msgspec.Meta(ge=1)]
    created: str
    expires: str
    target: Target
    delta: Delta | None = None
    compatibility: Compatibility = msgspec.field(default_factory=Compatibility)
    rollout: Rollout = msgspec.field(default_factory=Rollout)

    @property
    def created_ts(self) -> float:
        return parse_time(self.created, "created")

    @property
    def expires_ts(self) -> float:
        return parse_time(self.expires, "expires")

    def trusted_comment(self, timestamp: int) -> str:
        """What the signature's trusted comment says: the name and version, bound to the signature."""
        return f"timestamp:{timestamp}\tfile:manifest.json\tname:{self.name}\tversion:{self.version}"


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def encode_manifest(manifest: Manifest) -> bytes:
    return canonical_json(msgspec.to_builtins(manifest))


def parse_manifest(data: bytes, what: str = "manifest.json") -> Manifest:
    """Parse signed manifest bytes; every error names the field."""
    if len(data) > MAX_MANIFEST:
        raise Rejected("malformed", f"{what}: larger than {MAX_MANIFEST} bytes")
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.ValidationError as err:
        raise Rejected("malformed", f"{what}: {err}") from None
    except msgspec.DecodeError as err:
        raise Rejected("malformed", f"{what}: not JSON ({err})") from None
    manifest.created_ts, manifest.expires_ts  # noqa: B018 - validates both times
    if manifest.delta is None and not manifest.target.file:
        raise Rejected("malformed", f"{what}: target.file is empty and there is no delta: nothing to download")
    return manifest


def parse_time(value: str, what: str) -> float:
    """RFC 3339 UTC time ("2025-01-31T12:00:00Z") as a Unix timestamp."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise Rejected("malformed", f"manifest.json: {what}: expected an RFC 3339 time, got {value!r}") from None
    if parsed.tzinfo is None:
        raise Rejected("malformed", f"manifest.json: {what}: {value!r} has no time zone")
    return parsed.timestamp()


def format_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cohort_position(salt: str, node_id: str) -> float:
    """Where ``node_id`` sits in [0, 100) for a release salted ``salt``: a stable hash of salt and node id.

    The node's updater (``in_rollout``) and the station's cohort view both use it, so they agree exactly.
    """
    digest = hashlib.sha256(f"{salt}:{node_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def in_rollout(rollout: Rollout, node_id: str) -> bool:
    """Whether this node is in the release's cohort: its ``cohort_position`` is below the percent."""
    if rollout.percent >= 100.0:
        return True
    return cohort_position(rollout.salt, node_id) < rollout.percent


def version_tuple(text: str) -> tuple[int, ...]:
    """ "0.10.2" -> (0, 10, 2); a suffix on a part ("1rc1") counts by its leading digits."""
    parts = []
    for part in text.split("."):
        leading = re.match(r"\d*", part)
        digits = leading.group() if leading else ""  # \d* always matches; the check narrows the type
        parts.append(int(digits or 0))
    return tuple(parts)

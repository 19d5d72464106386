"""Building a release on the publisher's side: payload tar, delta, manifest and its signature.

``build_release`` writes the directory layout the node reads (see
``transport_dir``); the same directory can be copied to a USB stick, served
over HTTP, or pushed to an MQTT broker with ``transport_mqtt.publish_release``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.ota.delta import make_best, make_delta
from edgerun.ota.errors import OtaError
from edgerun.ota.manifest import (
    Compatibility,
    Delta,
    Manifest,
    Rollout,
    Target,
    encode_manifest,
    format_time,
)
from edgerun.ota.minisign import SecretKey
from edgerun.ota.payload import pack_bundle, sha256_bytes
from edgerun.ota.store import atomic_write


@dataclass
class ReleaseSpec:
    expires_days: float = 30.0
    boards: list[str] = field(default_factory=list)
    min_runtime: str = "0"
    rollout_percent: float = 100.0
    rollout_salt: str = ""
    full: bool = True  # ship the full payload (a delta alone needs every node on its base)
    algorithm: str = "auto"  # "auto" keeps the smaller of bsdiff4 and zstd


@dataclass
class Release:
    manifest: Manifest
    manifest_bytes: bytes
    directory: Path
    delta_sizes: dict[str, int] = field(default_factory=dict)
    note: str = ""


def read_payload(path: str | Path) -> tuple[ModelBundle, bytes]:
    """A bundle directory (packed reproducibly) or an already packed payload tar."""
    path = Path(path)
    bundle = load_bundle(path)
    data = path.read_bytes() if path.is_file() else pack_bundle(bundle.root)
    return bundle, data


def build_release(
    bundle_path: str | Path,
    out_dir: str | Path,
    spec: ReleaseSpec,
    *,
    base_path: str | Path | None = None,
    key: SecretKey | None = None,
    now: float | None = None,
) -> Release:
    """Write ``out_dir/<model>/``: the payload, a delta from ``base_path``, manifest.json and its signature."""
    bundle, payload = read_payload(bundle_path)
    out = Path(out_dir) / bundle.name
    out.mkdir(parents=True, exist_ok=True)
    now = time.time() if now is None else now
    target = Target(sha256=sha256_bytes(payload), size=len(payload))
    note = ""
    delta = None
    sizes: dict[str, int] = {}
    if base_path is not None:
        base_bundle, base = read_payload(base_path)
        if base_bundle.name != bundle.name:
            raise OtaError(f"base is {base_bundle.name!r}, the release {bundle.name!r}")
        if base_bundle.version >= bundle.version:
            raise OtaError(f"base v{base_bundle.version} is not below the release v{bundle.version}")
        if spec.algorithm == "auto":
            choice = make_best(base, payload)
            sizes = choice.sizes
            algorithm, patch = choice.algorithm, choice.patch
        else:
            patch = make_delta(base, payload, spec.algorithm)
            algorithm, sizes = spec.algorithm, {spec.algorithm: len(patch), "full": len(payload)}
        if algorithm == "full" or len(patch) >= len(payload):
            note = f"the full payload ({len(payload)} bytes) is smaller than any delta ({sizes}); no delta shipped"
        else:
            name = f"{bundle.name}-{base_bundle.version}-to-{bundle.version}.{algorithm}"
            atomic_write(out / name, patch)
            delta = Delta(
                base_version=base_bundle.version,
                base_sha256=sha256_bytes(base),
                algorithm=algorithm,  # type: ignore[arg-type]  # a str: "full" is out above, make_delta takes no other
                sha256=sha256_bytes(patch),
                size=len(patch),
                file=name,
            )
    if spec.full or delta is None:
        target.file = f"{bundle.name}-{bundle.version}.tar"
        atomic_write(out / target.file, payload)
    manifest = Manifest(
        name=bundle.name,
        version=bundle.version,
        created=format_time(now),
        expires=format_time(now + spec.expires_days * 86400),
        target=target,
        delta=delta,
        compatibility=Compatibility(boards=spec.boards, min_runtime=spec.min_runtime),
        rollout=Rollout(percent=spec.rollout_percent, salt=spec.rollout_salt),
    )
    data = encode_manifest(manifest)
    atomic_write(out / "manifest.json", data)
    if key is not None:
        sig = key.sign(data, manifest.trusted_comment(int(now)))
        atomic_write(out / "manifest.json.minisig", sig.to_text().encode())
    return Release(manifest, data, out, sizes, note)

"""Release payloads: a bundle directory packed as a byte-for-byte reproducible tar, and file hashing.

The tar is the unit that is hashed, signed (through the manifest), diffed and
stored in a slot, so packing the same bundle twice must give the same bytes:
sorted names, regular files only, zero times and owners, fixed modes.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from edgerun.ota.errors import OtaError

CHUNK = 1 << 20


def pack_bundle(bundle_dir: Path) -> bytes:
    """The reproducible tar of a bundle directory (its files at the top level of the archive)."""
    bundle_dir = Path(bundle_dir)
    if not (bundle_dir / "model.toml").is_file():
        raise OtaError(f"{bundle_dir}: not a model bundle directory (no model.toml)")
    files = sorted(p for p in bundle_dir.rglob("*") if p.is_file() and not p.is_symlink())
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in files:
            rel = path.relative_to(bundle_dir).as_posix()
            if rel.startswith(".edgerun-bundles/"):
                continue  # extraction cache of nested tars, not part of the bundle
            data = path.read_bytes()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

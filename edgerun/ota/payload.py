"""Release payloads: a bundle directory packed as a byte-for-byte reproducible tar, and file hashing.

The tar is the unit that is hashed, signed (through the manifest), diffed and
stored in a slot, so packing the same bundle twice must give the same bytes:
sorted names, regular files only, zero times and owners, fixed modes.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import tarfile
import zlib
from pathlib import Path
from typing import TypeVar

from edgerun.ota.errors import OtaError, Rejected

CHUNK = 1 << 20
DEFAULT_MAX_UNPACKED = 1 << 30  # ota.max_unpacked_bytes' default
# pax and GNU long-name headers are read whole into memory by tarfile: a real one is a few hundred bytes.
MAX_EXTENDED_HEADER = 64 * 1024
# tar framing (512-byte headers, padding, end blocks) on top of the members' bytes, allowed in the stream count.
_FRAMING_SLACK = 1 << 20
MAX_MEMBERS = 10_000  # a bundle holds a handful of files; tarfile keeps every header in memory
_EXTENDED = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)
# What a damaged or hostile archive can raise from the tar, gzip, bzip2 and xz readers.
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)


class _Oversized(Exception):
    """Raised inside the scan the moment a limit is passed."""


_Info = TypeVar("_Info", bound="_BoundedTarInfo")


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses a pax/GNU extended header bigger than MAX_EXTENDED_HEADER before tarfile reads it into memory."""

    @classmethod
    def frombuf(cls: type[_Info], buf: bytes | bytearray, encoding: str, errors: str) -> _Info:
        info = super().frombuf(buf, encoding, errors)
        if info.type in _EXTENDED and info.size > MAX_EXTENDED_HEADER:
            raise _Oversized(f"an extended tar header of {info.size} bytes (at most {MAX_EXTENDED_HEADER})")
        return info


def check_unpacked_size(payload: bytes, limit: int) -> None:
    """Rejected('oversized') if unpacking ``payload`` would write more than ``limit`` bytes; writes nothing.

    Reads the archive once, front to back, and stops as soon as the members' declared sizes, the bytes actually
    read out of them, or the decompressed stream itself pass the limit, so a small tar.gz bomb costs at most
    ``limit`` bytes of decompression, never disk or memory. An archive it cannot read is Rejected('bad_bundle').
    """
    declared = extracted = 0
    try:
        # "r:*" detects the compression exactly as load_bundle's tarfile.open does, so both read the same stream.
        with tarfile.open(fileobj=io.BytesIO(payload), mode="r:*", tarinfo=_BoundedTarInfo) as tar:
            for count, member in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    raise _Oversized(f"more than {MAX_MEMBERS} members")
                declared += member.size if member.isfile() else 0
                if declared > limit:
                    raise _Oversized(f"its files declare more than {limit} bytes")
                if tar.offset > limit + _FRAMING_SLACK:  # the decompressed position: headers and padding count too
                    raise _Oversized(f"its tar stream passes {limit} bytes")
                if not member.isfile():
                    continue
                body = tar.extractfile(member)
                while body is not None and (chunk := body.read(CHUNK)):
                    extracted += len(chunk)
                    if extracted > limit:
                        raise _Oversized(f"its files unpack to more than {limit} bytes")
    except _Oversized as err:
        raise Rejected("oversized", f"payload: {err} (ota.max_unpacked_bytes = {limit})") from None
    except _ARCHIVE_ERRORS as err:
        if isinstance(err, tarfile.ReadError) and "opened successfully" in str(err):
            raise Rejected("bad_bundle", "payload: not a tar archive (plain, gzip, bzip2 or xz)") from None
        detail = (str(err).splitlines() or [""])[0]
        raise Rejected("bad_bundle", f"payload: damaged tar archive ({type(err).__name__}: {detail})") from None


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

"""Releases from a directory: a USB stick, an SD card, a balena volume, a folder synced by something else.

Layout (what ``edgerun ota publish --to DIR`` writes)::

    DIR/keys.json, DIR/keys.json.minisig
    DIR/<model>/manifest.json, DIR/<model>/manifest.json.minisig
    DIR/<model>/<payload and delta files named in the manifest>
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from edgerun.ota.errors import Rejected
from edgerun.ota.transport import MAX_METADATA, CappedWriter, Offer, RateLimiter, Transport, TransportError

CHUNK = 256 * 1024


def _read_small(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise TransportError(f"{path}: {err.strerror}") from None
    if len(data) > MAX_METADATA:
        raise TransportError(f"{path}: larger than {MAX_METADATA} bytes")
    return data


def read_offer(root: Path, model: str, source: str) -> Offer | None:
    manifest = _read_small(root / model / "manifest.json")
    if manifest is None:
        return None
    sig = _read_small(root / model / "manifest.json.minisig")
    if sig is None:
        raise TransportError(f"{root / model}: manifest.json has no manifest.json.minisig")
    keys = _read_small(root / "keys.json")
    keys_sig = _read_small(root / "keys.json.minisig")
    return Offer(
        source=source,
        manifest=manifest,
        manifest_sig=sig.decode("utf-8", "replace"),
        keys=keys,
        keys_sig=None if keys_sig is None else keys_sig.decode("utf-8", "replace"),
    )


class DirectoryTransport(Transport):
    KEY = "dir"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return f"dir:{self.root}"

    async def poll(self, model: str) -> Offer | None:
        # A USB stick can be slow to answer: keep the file reads off the loop.
        return await asyncio.to_thread(read_offer, self.root, model, self.describe())

    async def fetch(self, model: str, file: str, size: int, dest: Path, limiter: RateLimiter) -> None:
        src = self.root / model / file
        try:
            have = src.stat().st_size
        except FileNotFoundError:
            raise Rejected("missing_file", f"{src}: not found (named in the manifest)", final=False) from None
        except OSError as err:
            raise TransportError(f"{src}: {err.strerror}") from None
        if have > size:
            raise Rejected("oversized", f"{file}: {have} bytes, the manifest signed {size}")
        writer = CappedWriter(dest, size, file)
        try:
            with open(src, "rb") as f:
                f.seek(writer.have)
                while not writer.complete:
                    # Read one byte past the cap: a file that grew since stat() is caught, not trusted.
                    chunk = await asyncio.to_thread(f.read, min(CHUNK, size - writer.have + 1))
                    if not chunk:
                        break
                    await limiter.consume(len(chunk))
                    writer.write(chunk)
        except OSError as err:
            writer.close()
            raise TransportError(f"{src}: {err.strerror}") from None
        writer.finish()

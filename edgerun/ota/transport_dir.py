"""Releases from a directory: a USB stick, an SD card, a balena volume, a folder synced by something else.

Layout (what ``edgerun ota publish --to DIR`` writes)::

    DIR/keys.json, DIR/keys.json.minisig
    DIR/<model>/manifest.json, DIR/<model>/manifest.json.minisig
    DIR/<model>/<payload and delta files named in the manifest>
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from edgerun.ota.errors import Rejected
from edgerun.ota.transport import MAX_METADATA, CappedWriter, Offer, RateLimiter, Transport, TransportError

T = TypeVar("T")

CHUNK = 256 * 1024
# A USB stick that stops answering must not hold the updater for ever: each open or read has this long.
READ_TIMEOUT_S = 30.0


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path) -> tuple[int, int] | None:
    """(fd, size) of ``path`` opened for reading, or None if it does not exist.

    Only a regular file is opened: O_NOFOLLOW refuses a symlink and O_NONBLOCK keeps a FIFO (which a USB
    stick can hold) from blocking the open; anything else is a TransportError naming the path.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise TransportError(f"{path}: is a symbolic link; only regular files are read") from None
        raise TransportError(f"{path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TransportError(f"{path}: is {_kind(st.st_mode)}; only regular files are read")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_small(path: Path) -> bytes | None:
    opened = open_regular(path)
    if opened is None:
        return None
    fd, _size = opened
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_METADATA + 1)
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

    def __init__(self, root: str | Path, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.root = Path(root)
        self.read_timeout_s = read_timeout_s

    def describe(self) -> str:
        return f"dir:{self.root}"

    async def _off_loop(self, what: Path, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking file call in a thread, with a deadline: a stuck medium is a TransportError."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise TransportError(f"{what}: no answer from the medium in {self.read_timeout_s:g} s") from None

    async def poll(self, model: str) -> Offer | None:
        # A USB stick can be slow to answer: keep the file reads off the loop, with a deadline.
        return await self._off_loop(self.root / model, read_offer, self.root, model, self.describe())

    async def fetch(self, model: str, file: str, size: int, dest: Path, limiter: RateLimiter) -> None:
        src = self.root / model / file
        opened = await self._off_loop(src, open_regular, src)
        if opened is None:
            raise Rejected("missing_file", f"{src}: not found (named in the manifest)", final=False)
        fd, have = opened
        try:
            if have > size:
                raise Rejected("oversized", f"{file}: {have} bytes, the manifest signed {size}")
            writer = CappedWriter(dest, size, file)
            try:
                while not writer.complete:
                    # Read one byte past the cap: a file that grew since fstat() is caught, not trusted.
                    n = min(CHUNK, size - writer.have + 1)
                    chunk = await self._off_loop(src, os.pread, fd, n, writer.have)
                    if not chunk:
                        break
                    await limiter.consume(len(chunk))
                    writer.write(chunk)
            except OSError as err:
                writer.close()
                raise TransportError(f"{src}: {err.strerror}") from None
            except BaseException:
                writer.close()
                raise
            writer.finish()
        finally:
            # A read still stuck in its thread holds its own reference to the file: closing the fd is safe.
            with contextlib.suppress(OSError):
                os.close(fd)

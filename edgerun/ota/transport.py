"""How releases reach a node: the transport contract, the offer it returns, and the download cap.

A transport finds the newest release of a model (``poll``) and downloads one
of its files into a staging file (``fetch``). It never decides whether to
trust anything: it hands signed bytes to the updater, and every download is
capped at the size the manifest signed, so a hostile or broken source cannot
feed the node endless data. Partial downloads stay in staging so the next
attempt resumes where the last one stopped.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from edgerun.ota.errors import OtaError, Rejected

MAX_METADATA = 256 * 1024  # keys.json, manifest.json and their signatures are far smaller


class TransportError(OtaError):
    """The source could not be reached or read right now; try again later."""


@dataclass(frozen=True)
class Offer:
    """A release as a source presents it: signed bytes, not yet trusted."""

    source: str
    manifest: bytes
    manifest_sig: str
    keys: bytes | None = None
    keys_sig: str | None = None

    def identity(self) -> bytes:
        """What makes two offers the same release (to skip one already judged)."""
        return b"\0".join([self.manifest, self.manifest_sig.encode(), self.keys or b"", (self.keys_sig or "").encode()])


class RateLimiter:
    """A token bucket in bytes per second shared by every download; 0 means no limit."""

    def __init__(self, rate_bps: int, burst: int | None = None) -> None:
        self.rate = rate_bps
        self.burst = burst or max(rate_bps, 1)
        self._tokens = float(self.burst)
        self._last = time.monotonic()

    async def consume(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= min(n, self.burst):
                self._tokens -= n
                return
            await asyncio.sleep((min(n, self.burst) - self._tokens) / self.rate)


class CappedWriter:
    """Appends to a staging file and refuses to go past the signed size."""

    def __init__(self, dest: Path, size: int, name: str, resume: bool = True) -> None:
        self.dest = dest
        self.size = size
        self.name = name
        if not resume and dest.exists():
            dest.unlink()
        self.have = dest.stat().st_size if dest.exists() else 0
        if self.have > size:
            dest.unlink()
            self.have = 0
        self._file = open(dest, "ab")

    def write(self, chunk: bytes) -> None:
        if self.have + len(chunk) > self.size:
            self.close()
            self.dest.unlink(missing_ok=True)
            raise Rejected("oversized", f"{self.name}: the source sends more than the signed {self.size} bytes")
        self._file.write(chunk)
        self.have += len(chunk)

    def restart(self) -> None:
        """The source ignored our resume offset: start the file again."""
        self._file.truncate(0)
        self._file.seek(0)
        self.have = 0

    @property
    def complete(self) -> bool:
        return self.have == self.size

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def finish(self) -> None:
        """Close; Rejected('truncated') if the source ended before the signed size."""
        self.close()
        if self.have < self.size:
            raise Rejected(
                "truncated",
                f"{self.name}: the source ended after {self.have} of the signed {self.size} bytes",
                final=False,
            )


class Transport(ABC):
    KEY: ClassVar[str]

    @abstractmethod
    async def poll(self, model: str) -> Offer | None:
        """The release the source offers for ``model`` now, or None when it has none."""

    @abstractmethod
    async def fetch(self, model: str, file: str, size: int, dest: Path, limiter: RateLimiter) -> None:
        """Download ``file`` of ``model``'s release into ``dest`` (resuming what is there), at most ``size`` bytes.

        Raises Rejected('oversized'/'truncated') or TransportError.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def describe(self) -> str:
        return self.KEY

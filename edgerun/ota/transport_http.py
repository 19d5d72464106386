"""Releases over HTTP(S): the directory layout of ``transport_dir`` served at a base URL.

Downloads resume with ``Range: bytes=N-`` after a dropped connection (a
server that answers 200 instead of 206 is read from the start), and are cut
off one byte past the signed size. A source that trickles (bytes arriving just
often enough to beat the socket timeout) is cut off too: every body must keep
``min_rate_bps`` averaged over ``rate_window_s``, and every download must end
within ``size / min_rate_bps + DEADLINE_SLACK_S`` seconds, retries included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import aiohttp

from edgerun.ota.errors import Rejected
from edgerun.ota.transport import MAX_METADATA, CappedWriter, Offer, RateLimiter, Transport, TransportError

log = logging.getLogger(__name__)
T = TypeVar("T")

CHUNK = 64 * 1024
ATTEMPTS = 5
MIN_RATE_BPS = 1024  # a 20 MB model still arrives in ~6 hours at this; a trickle below it is an attack or a dead link
RATE_WINDOW_S = 30.0  # long enough to ride out a radio fade, short enough that a trickle is dropped within a minute
DEADLINE_SLACK_S = 60.0  # on top of size / min rate: connection set-up, retries and their back-off


class _Pace:
    """Fails a body that falls below ``min_rate`` bytes/s over a window (tumbling windows of ``window_s``)."""

    def __init__(self, url: str, min_rate: float, window_s: float, progress: Callable[[], str]) -> None:
        self.url = url
        self.min_rate = min_rate
        self.window_s = window_s
        self.progress = progress
        self._t0 = time.monotonic()
        self._bytes = 0

    def wait_s(self) -> float:
        """How long the next read may wait before the window must be judged."""
        return max(0.001, self._t0 + self.window_s - time.monotonic())

    def add(self, n: int) -> None:
        self._bytes += n
        now = time.monotonic()
        elapsed = now - self._t0
        if elapsed < self.window_s:
            return
        rate = self._bytes / elapsed
        if self.min_rate > 0 and rate < self.min_rate:
            raise TransportError(
                f"{self.url}: {rate:.0f} B/s over the last {elapsed:.0f} s, below the minimum {self.min_rate:.0f} B/s"
                f" ({self.progress()})"
            )
        self._t0, self._bytes = now, 0

    async def read(self, content: aiohttp.StreamReader, n: int) -> bytes:
        """One read of at most ``n`` bytes that cannot wait past the end of the window."""
        # One read task across windows (its own timeouts stay its own): only the window ends interrupt the wait.
        task = asyncio.ensure_future(content.read(n))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.wait_s())
                if done:
                    chunk = task.result()
                    self.add(len(chunk))
                    return chunk
                self.add(0)  # nothing for the rest of the window: judge it (raises when too slow)
        finally:
            if not task.done():
                task.cancel()


class HttpTransport(Transport):
    KEY = "http"

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 30.0,
        retry_delay_s: float = 0.5,
        min_rate_bps: float = MIN_RATE_BPS,
        rate_window_s: float = RATE_WINDOW_S,
        deadline_slack_s: float = DEADLINE_SLACK_S,
    ) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        self.retry_delay_s = retry_delay_s
        self.min_rate_bps = min_rate_bps
        self.rate_window_s = rate_window_s
        self.deadline_slack_s = deadline_slack_s
        self._session: aiohttp.ClientSession | None = None

    def describe(self) -> str:
        return self.base

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # auto_decompress off: a gzip bomb must not expand past the cap before we count bytes.
            self._session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)
        return self._session

    def _deadline_s(self, size: int, min_rate: float) -> float:
        return self.deadline_slack_s + (size / min_rate if min_rate > 0 else 0.0)

    async def _within(self, url: str, deadline_s: float, progress: Callable[[], str], work: Awaitable[T]) -> T:
        """Await ``work`` for at most ``deadline_s``: a source that never finishes is one TransportError."""
        try:
            return await asyncio.wait_for(work, deadline_s)
        except asyncio.TimeoutError:
            raise TransportError(f"{url}: not done after the {deadline_s:.0f} s deadline ({progress()})") from None

    async def _get_small(self, path: str) -> bytes | None:
        url = f"{self.base}/{path}"
        got = bytearray()
        progress = lambda: f"{len(got)} bytes received"  # noqa: E731
        deadline = self._deadline_s(MAX_METADATA, self.min_rate_bps)
        return await self._within(url, deadline, progress, self._get_small_body(url, got, progress))

    async def _get_small_body(self, url: str, got: bytearray, progress: Callable[[], str]) -> bytes | None:
        try:
            async with self._client().get(url) as resp:
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    raise TransportError(f"{url}: HTTP {resp.status}")
                pace = _Pace(url, self.min_rate_bps, self.rate_window_s, progress)
                while len(got) <= MAX_METADATA:
                    chunk = await pace.read(resp.content, MAX_METADATA + 1 - len(got))
                    if not chunk:
                        break
                    got += chunk
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise TransportError(f"{url}: {err or type(err).__name__}") from None
        data = bytes(got)
        if len(data) > MAX_METADATA:
            raise TransportError(f"{url}: larger than {MAX_METADATA} bytes")
        return data

    async def poll(self, model: str) -> Offer | None:
        manifest = await self._get_small(f"{model}/manifest.json")
        if manifest is None:
            return None
        sig = await self._get_small(f"{model}/manifest.json.minisig")
        if sig is None:
            raise TransportError(f"{self.base}/{model}: manifest.json has no manifest.json.minisig")
        keys = await self._get_small("keys.json")
        keys_sig = await self._get_small("keys.json.minisig")
        return Offer(
            source=self.base,
            manifest=manifest,
            manifest_sig=sig.decode("utf-8", "replace"),
            keys=keys,
            keys_sig=None if keys_sig is None else keys_sig.decode("utf-8", "replace"),
        )

    async def fetch(self, model: str, file: str, size: int, dest: Path, limiter: RateLimiter) -> None:
        url = f"{self.base}/{model}/{file}"
        writer = CappedWriter(dest, size, file)
        # Our own rate cap must not make a download look like a trickle: judge against at most half of it.
        min_rate = min(self.min_rate_bps, limiter.rate / 2) if limiter.rate > 0 else self.min_rate_bps
        progress = lambda: f"{writer.have} of {size} bytes"  # noqa: E731
        deadline = self._deadline_s(size - writer.have, min_rate)
        try:
            last_error = await self._within(url, deadline, progress, self._attempts(url, writer, limiter, min_rate))
        except Rejected:
            writer.close()
            dest.unlink(missing_ok=True)
            raise
        except BaseException:
            writer.close()
            raise
        writer.close()
        if not writer.complete and last_error:
            raise TransportError(f"{url}: stopped at {writer.have} of {size} bytes, {ATTEMPTS} tries: {last_error}")
        writer.finish()

    async def _attempts(self, url: str, writer: CappedWriter, limiter: RateLimiter, min_rate: float) -> str:
        """Up to ATTEMPTS resumed GETs; returns the last interruption ('' when the body ended cleanly)."""
        last_error = ""
        for attempt in range(ATTEMPTS):
            if writer.complete:
                break
            if attempt:
                await asyncio.sleep(self.retry_delay_s * attempt)
            try:
                await self._fetch_once(url, writer, limiter, min_rate)
                return ""  # the server ended the body cleanly: the length check decides
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                last_error = str(err) or type(err).__name__
                log.info("ota: %s interrupted at %d/%d bytes (%s); resuming", url, writer.have, writer.size, last_error)
        return last_error

    async def _fetch_once(self, url: str, writer: CappedWriter, limiter: RateLimiter, min_rate: float) -> None:
        headers = {"Range": f"bytes={writer.have}-"} if writer.have else {}
        async with self._client().get(url, headers=headers) as resp:
            if resp.status == 404:
                raise Rejected("missing_file", f"{url}: not found (named in the manifest)", final=False)
            if resp.status == 416:
                return  # nothing left past what we have: the length check decides
            if resp.status == 200 and writer.have:
                writer.restart()
            elif resp.status == 206:
                start = _content_range_start(resp.headers.get("Content-Range", ""))
                if start != writer.have:
                    raise TransportError(f"{url}: asked for bytes from {writer.have}, got a range from {start}")
            elif resp.status != 200:
                raise TransportError(f"{url}: HTTP {resp.status}")
            declared = resp.content_length
            if declared is not None and writer.have + declared > writer.size:
                raise Rejected("oversized", f"{url}: {writer.have + declared} bytes, the manifest signed {writer.size}")
            pace = _Pace(url, min_rate, self.rate_window_s, lambda: f"{writer.have} of {writer.size} bytes")
            while True:
                chunk = await pace.read(resp.content, min(CHUNK, writer.size - writer.have + 1))
                if not chunk:
                    break
                await limiter.consume(len(chunk))
                writer.write(chunk)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _content_range_start(value: str) -> int:
    # "bytes 100-199/200"
    try:
        unit, _, rest = value.partition(" ")
        return int(rest.split("-", 1)[0]) if unit == "bytes" else -1
    except ValueError:
        return -1

"""Releases over HTTP(S): the directory layout of ``transport_dir`` served at a base URL.

Downloads resume with ``Range: bytes=N-`` after a dropped connection (a
server that answers 200 instead of 206 is read from the start), and are cut
off one byte past the signed size.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp

from edgerun.ota.errors import Rejected
from edgerun.ota.transport import MAX_METADATA, CappedWriter, Offer, RateLimiter, Transport, TransportError

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
ATTEMPTS = 5


class HttpTransport(Transport):
    KEY = "http"

    def __init__(self, base_url: str, timeout_s: float = 30.0, retry_delay_s: float = 0.5) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        self.retry_delay_s = retry_delay_s
        self._session: aiohttp.ClientSession | None = None

    def describe(self) -> str:
        return self.base

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # auto_decompress off: a gzip bomb must not expand past the cap before we count bytes.
            self._session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)
        return self._session

    async def _get_small(self, path: str) -> bytes | None:
        url = f"{self.base}/{path}"
        try:
            async with self._client().get(url) as resp:
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    raise TransportError(f"{url}: HTTP {resp.status}")
                data = await resp.content.read(MAX_METADATA + 1)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise TransportError(f"{url}: {err or type(err).__name__}") from None
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
        last_error = ""
        try:
            for attempt in range(ATTEMPTS):
                if writer.complete:
                    break
                if attempt:
                    await asyncio.sleep(self.retry_delay_s * attempt)
                try:
                    await self._fetch_once(url, writer, limiter)
                    break  # the server ended the body cleanly: the length check decides
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                    last_error = str(err) or type(err).__name__
                    log.info("ota: %s interrupted at %d/%d bytes (%s); resuming", url, writer.have, size, last_error)
        except Rejected:
            writer.close()
            dest.unlink(missing_ok=True)
            raise
        finally:
            writer.close()
        if not writer.complete and last_error:
            raise TransportError(f"{url}: stopped at {writer.have} of {size} bytes, {ATTEMPTS} tries: {last_error}")
        writer.finish()

    async def _fetch_once(self, url: str, writer: CappedWriter, limiter: RateLimiter) -> None:
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
            while True:
                chunk = await resp.content.read(min(CHUNK, writer.size - writer.have + 1))
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

"""The HTTP transport against a real aiohttp server on loopback: resume with Range, caps, rate limit."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from aiohttp import web

from edgerun.ota.errors import Rejected
from edgerun.ota.transport import RateLimiter
from edgerun.ota.transport_http import HttpTransport
from tests.conftest import free_port
from tests.unit.test_ota_release import Fleet, head_variant


class FlakyServer:
    """Serves a release directory; the first payload request is cut off halfway."""

    def __init__(self, root, extra: bytes = b"", ignore_range: bool = False) -> None:
        self.root = root
        self.extra = extra
        self.ignore_range = ignore_range
        self.ranges: list[str | None] = []
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = self.root / request.match_info["path"]
        if not path.is_file():
            raise web.HTTPNotFound()
        data = path.read_bytes()
        if not path.name.endswith(".tar"):
            return web.Response(body=data)
        data += self.extra
        self.ranges.append(request.headers.get("Range"))
        start = 0
        if request.headers.get("Range") and not self.ignore_range:
            start = int(request.headers["Range"].split("=")[1].rstrip("-"))
        resp = web.StreamResponse(status=206 if start else 200)
        resp.content_length = len(data) - start
        if start:
            resp.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await resp.prepare(request)
        if len(self.ranges) == 1:
            await resp.write(data[: len(data) // 2])
            request.transport.close()  # the link drops mid-download
            return resp
        await resp.write(data[start:])
        return resp

    async def __aenter__(self) -> FlakyServer:
        app = web.Application()
        app.router.add_get("/{path:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.fixture(scope="module")
def release(tmp_path_factory, blazeface_bundle):
    tmp = tmp_path_factory.mktemp("http")
    fleet = Fleet(tmp / "fleet")
    fleet.write_keys()
    v2 = head_variant(blazeface_bundle, tmp / "v2", 2)
    return fleet, fleet.publish(v2)


def test_download_resumes_after_a_dropped_connection(tmp_path, release):
    fleet, rel = release
    target = rel.manifest.target

    async def main():
        async with FlakyServer(fleet.release_dir) as server:
            transport = HttpTransport(f"http://127.0.0.1:{server.port}/", retry_delay_s=0.05)
            try:
                offer = await transport.poll("blazeface_short")
                assert offer.manifest == rel.manifest_bytes and offer.keys is not None
                assert await transport.poll("no_such_model") is None
                dest = tmp_path / "payload.part"
                await transport.fetch("blazeface_short", target.file, target.size, dest, RateLimiter(0))
            finally:
                await transport.close()
            return server.ranges, dest.read_bytes()

    ranges, data = asyncio.run(main())
    assert hashlib.sha256(data).hexdigest() == target.sha256
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert int(ranges[1].split("=")[1].rstrip("-")) > 0


def test_a_server_sending_more_than_signed_is_cut_off(tmp_path, release):
    fleet, rel = release
    target = rel.manifest.target

    async def main():
        async with FlakyServer(fleet.release_dir, extra=b"\0" * 100_000, ignore_range=True) as server:
            server.ranges.append("skip the cut")  # serve whole bodies
            transport = HttpTransport(f"http://127.0.0.1:{server.port}")
            try:
                await transport.fetch("blazeface_short", target.file, target.size, tmp_path / "p", RateLimiter(0))
            finally:
                await transport.close()

    with pytest.raises(Rejected) as info:
        asyncio.run(main())
    assert info.value.code == "oversized"
    assert not (tmp_path / "p").exists()


def test_rate_limit_bounds_the_download_rate():
    async def main():
        limiter = RateLimiter(200_000, burst=20_000)
        t0 = time.monotonic()
        for _ in range(20):
            await limiter.consume(10_000)
        return time.monotonic() - t0

    # 200 kB at 200 kB/s with a 20 kB burst: at least ~0.9 s, whatever the machine's speed.
    assert asyncio.run(main()) >= 0.85

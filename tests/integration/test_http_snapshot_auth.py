"""The camera behind a token, and malformed requests as one log line: HttpService on a real loopback socket."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import cv2
import numpy as np
import pytest

from edgerun.config import parse_config
from edgerun.errors import ConfigError
from edgerun.preflight import check_snapshot
from edgerun.service import http as http_module
from edgerun.service.health import Health
from edgerun.service.http import HttpService, is_loopback

HOST = "127.0.0.1"
TOKEN = "s3cret-token-for-the-camera"

pytestmark = pytest.mark.usefixtures("no_thread_left_behind")


def _jpeg() -> bytes:
    ok, buf = cv2.imencode(".jpg", np.zeros((16, 16, 3), np.uint8))
    assert ok
    return buf.tobytes()


Test = Callable[[HttpService, aiohttp.ClientSession, str], Awaitable[None]]


def serve(test: Test, token_file: str = "") -> None:
    async def main() -> None:
        health = Health(notify=asyncio.get_running_loop().call_soon_threadsafe)
        jpeg = _jpeg()
        service = HttpService(
            HOST, 0, health=health, metrics_text=lambda: "", snapshot_jpeg=lambda: jpeg,
            snapshot_token_file=token_file,
        )  # fmt: skip
        await service.start()
        try:
            async with aiohttp.ClientSession() as client:
                await test(service, client, f"http://{HOST}:{service.port}")
        finally:
            await service.stop()

    asyncio.run(main())


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "snapshot.token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_with_a_token_file_the_snapshot_needs_the_bearer_token(tmp_path: Path) -> None:
    async def test(service: HttpService, client: aiohttp.ClientSession, base: str) -> None:
        async with client.get(base + "/snapshot.jpg") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert b"\xff\xd8" not in await r.read()
        for header in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}", "Bearer", "Bearer \u00e9"):
            async with client.get(base + "/snapshot.jpg", headers={"Authorization": header}) as r:
                assert r.status == 401, header
        async with client.get(base + "/snapshot.jpg", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and r.content_type == "image/jpeg"
            assert (await r.read()).startswith(b"\xff\xd8")
        async with client.get(base + "/healthz") as r:  # probes need no token
            assert r.status == 200
        assert service.snapshot_refused == 6

    serve(test, _token_file(tmp_path))


def test_on_loopback_without_a_token_file_the_snapshot_is_served_as_before() -> None:
    async def test(service: HttpService, client: aiohttp.ClientSession, base: str) -> None:
        async with client.get(base + "/snapshot.jpg") as r:
            assert r.status == 200 and r.content_type == "image/jpeg"

    serve(test)


def test_a_bind_beyond_loopback_without_a_token_file_turns_the_snapshot_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The socket stays on 127.0.0.1 (tests never bind a real interface); the service is told it is not loopback.
    monkeypatch.setattr(http_module, "is_loopback", lambda host: False)

    async def test(service: HttpService, client: aiohttp.ClientSession, base: str) -> None:
        for _ in range(3):
            async with client.get(base + "/snapshot.jpg") as r:
                assert r.status == 403
                assert "snapshot_token_file" in await r.text()
        async with client.get(base + "/readyz") as r:
            assert r.status in (200, 503)

    with caplog.at_level(logging.WARNING, logger="edgerun.service.http"):
        serve(test)
    off = [r for r in caplog.records if "/snapshot.jpg is off" in r.getMessage()]
    assert len(off) == 1, caplog.text  # said once, at start, not per request


def test_which_binds_count_as_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    every_address = str(ipaddress.IPv4Address(0))  # what the balena config binds
    assert not any(is_loopback(h) for h in (every_address, "::", "", "192.168.1.10", "node.local"))


def test_preflight_names_a_missing_or_empty_token_file(tmp_path: Path) -> None:
    missing = parse_config({"service": {"snapshot_token_file": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"^service.snapshot_token_file: .*nope"):
        check_snapshot(missing)
    (tmp_path / "empty").write_text("\n")
    empty = parse_config({"service": {"snapshot_token_file": str(tmp_path / "empty")}})
    with pytest.raises(ConfigError, match="is empty"):
        check_snapshot(empty)
    check_snapshot(parse_config({"service": {"snapshot_token_file": _token_file(tmp_path)}}))


GARBAGE = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n\r\n",
]


def test_malformed_requests_are_one_log_line_each(caplog: pytest.LogCaptureFixture) -> None:
    async def test(service: HttpService, client: aiohttp.ClientSession, base: str) -> None:
        for data in GARBAGE:
            reader, writer = await asyncio.open_connection(HOST, service.port)
            try:
                writer.write(data)
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(100), 10)
                assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], answer
            finally:
                writer.close()
                await writer.wait_closed()
        async with client.get(base + "/healthz") as r:  # the service is still there
            assert r.status == 200

    with caplog.at_level(logging.DEBUG):
        serve(test)
    bad = [r for r in caplog.records if r.name.startswith("edgerun.service.http") and "bad request" in r.getMessage()]
    assert len(bad) == len(GARBAGE), caplog.text
    assert "Traceback" not in caplog.text
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in bad)
    assert all(r.levelno <= logging.WARNING for r in bad)
    assert "from 127.0.0.1: 400 " in bad[1].getMessage() and "Bad Header" in bad[1].getMessage()


def test_raw_socket_garbage_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    """A blocking raw socket as an attacker would use it: binary garbage."""

    async def test(service: HttpService, client: aiohttp.ClientSession, base: str) -> None:
        def poke() -> bytes:
            with socket.create_connection((HOST, service.port), timeout=10) as s:
                s.sendall(b"\x00\xff" * 64 + b"\r\n\r\n")
                return s.recv(100)

        answer = await asyncio.get_running_loop().run_in_executor(None, poke)
        assert b" 400 " in answer.split(b"\r\n")[0]

    with caplog.at_level(logging.DEBUG):
        serve(test)
    assert "Traceback" not in caplog.text

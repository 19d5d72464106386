"""HttpService on a real loopback socket, probed with a real HTTP client (aiohttp's)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable, Callable

import aiohttp
import cv2
import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.service.health import Health
from edgerun.service.http import METRICS_CONTENT_TYPE, HttpService

HOST = "127.0.0.1"
METRICS = (
    "# HELP edgerun_frames_inferred Frames that went through the model.\n"
    "# TYPE edgerun_frames_inferred counter\nedgerun_frames_inferred_total 42.0\n"
)


# Fails any test here that leaves a thread running (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_thread_left_behind")


def real_jpeg() -> bytes:
    image = np.zeros((48, 64, 3), np.uint8)
    cv2.rectangle(image, (8, 8), (40, 30), (0, 255, 0), 2)
    ok, buf = cv2.imencode(".jpg", image)
    assert ok
    return buf.tobytes()


class Snapshots:
    """Stands in for ``Node.snapshot_jpeg``, which needs a running pipeline: the test must decide when a frame
    exists (404 before) and see which thread each call ran on (encoding must stay off the loop). A real node's
    snapshot is fetched in tests/integration/test_node.py."""

    def __init__(self) -> None:
        self.jpeg: bytes | None = None
        self.threads: list[int] = []

    def __call__(self) -> bytes | None:
        self.threads.append(threading.get_ident())
        return self.jpeg


def serve(test: Callable[[HttpService, Health, Snapshots, aiohttp.ClientSession, str], Awaitable[None]]) -> None:
    async def main() -> None:
        health = Health(notify=asyncio.get_running_loop().call_soon_threadsafe)
        snapshots = Snapshots()
        service = HttpService(HOST, 0, health=health, metrics_text=lambda: METRICS, snapshot_jpeg=snapshots)
        await service.start()
        try:
            assert service.port != 0
            async with aiohttp.ClientSession() as client:
                await test(service, health, snapshots, client, f"http://{HOST}:{service.port}")
        finally:
            await service.stop()

    asyncio.run(main())


def test_healthz_and_readyz_follow_health() -> None:
    async def test(service, health, snapshots, client, base) -> None:
        async with client.get(base + "/healthz") as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            body = await resp.json()
            assert body["state"] == "starting" and body["reasons"] == {} and body["since_s"] >= 0
        async with client.get(base + "/readyz") as resp:
            assert resp.status == 503
            assert resp.content_type == "application/json"
            assert (await resp.json())["ready"] is False

        health.set_problem("source", "camera /dev/video0 gone, reopening")
        async with client.get(base + "/healthz") as resp:
            assert resp.status == 200  # alive and retrying
            assert (await resp.json())["state"] == "degraded"
        async with client.get(base + "/readyz") as resp:
            assert resp.status == 503  # but it never inferred
        health.clear_problem("source")

        health.mark_running()
        async with client.get(base + "/readyz") as resp:
            assert resp.status == 200
            assert (await resp.json())["state"] == "running"

        health.set_problem("source", "camera /dev/video0 gone, reopening")
        async with client.get(base + "/readyz") as resp:
            assert resp.status == 200  # degraded still serves
            body = await resp.json()
            assert body["state"] == "degraded"
            assert body["reasons"] == {"source": "camera /dev/video0 gone, reopening"}
        async with client.get(base + "/healthz") as resp:
            assert resp.status == 200

        health.mark_stopping()
        async with client.get(base + "/healthz") as resp:
            assert resp.status == 503
            assert (await resp.json())["state"] == "stopping"
        async with client.get(base + "/readyz") as resp:
            assert resp.status == 503

    serve(test)


def test_metrics_is_prometheus_text() -> None:
    async def test(service, health, snapshots, client, base) -> None:
        async with client.get(base + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == METRICS_CONTENT_TYPE
            assert await resp.text() == METRICS

    serve(test)


def test_snapshot_404_then_jpeg_encoded_off_the_loop() -> None:
    async def test(service, health, snapshots, client, base) -> None:
        async with client.get(base + "/snapshot.jpg") as resp:
            assert resp.status == 404
            assert resp.content_type == "text/plain"
            text = await resp.text()
            assert text.count("\n") == 1 and text.strip()

        snapshots.jpeg = real_jpeg()
        async with client.get(base + "/snapshot.jpg") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "image/jpeg"
            data = await resp.read()
        assert data[:3] == b"\xff\xd8\xff" and data[-2:] == b"\xff\xd9"
        assert data == snapshots.jpeg
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert image.shape == (48, 64, 3)
        assert threading.get_ident() not in snapshots.threads  # never encoded on the loop

    serve(test)


def test_snapshot_failure_is_a_500_logged_once(caplog) -> None:
    async def test(service, health, snapshots, client, base) -> None:
        def broken() -> bytes | None:
            raise ValueError("bad frame")

        service.snapshot_jpeg = broken
        with caplog.at_level(logging.ERROR, logger="edgerun.service.http"):
            for _ in range(3):
                async with client.get(base + "/snapshot.jpg") as resp:
                    assert resp.status == 500
                    assert "ValueError" in await resp.text()
        assert service.snapshot_errors == 3
        assert len([r for r in caplog.records if r.name == "edgerun.service.http"]) == 1

    serve(test)


def test_unknown_route_is_404_and_no_access_log(caplog) -> None:
    async def test(service, health, snapshots, client, base) -> None:
        with caplog.at_level(logging.DEBUG, logger="aiohttp"):
            async with client.get(base + "/nope") as resp:
                assert resp.status == 404
            for _ in range(3):
                async with client.get(base + "/healthz") as resp:
                    assert resp.status == 200
        assert [r for r in caplog.records if r.name.startswith("aiohttp.access")] == []

    serve(test)


def test_second_service_on_the_same_port_fails_clearly() -> None:
    async def test(service, health, snapshots, client, base) -> None:
        second = HttpService(HOST, service.port, health=health, metrics_text=str, snapshot_jpeg=lambda: None)
        with pytest.raises(EdgerunError) as excinfo:
            await second.start()
        message = str(excinfo.value)
        assert message == f"http: cannot listen on {HOST}:{service.port}: Address already in use"
        await second.stop()  # a failed start leaves nothing to stop
        async with client.get(base + "/healthz") as resp:  # the first one is unharmed
            assert resp.status == 200

    serve(test)


def test_stop_closes_the_port() -> None:
    async def main() -> None:
        service = HttpService(HOST, 0, health=Health(), metrics_text=str, snapshot_jpeg=lambda: None)
        await service.start()
        port = service.port
        await service.stop()
        await service.stop()
        async with aiohttp.ClientSession() as client:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with client.get(f"http://{HOST}:{port}/healthz"):
                    pass

    asyncio.run(main())

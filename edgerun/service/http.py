"""The node's HTTP endpoint: liveness, readiness, Prometheus metrics and a JPEG snapshot.

It runs on the node's own event loop (aiohttp), so probes see the same state
the node acts on. Nothing here touches images: the snapshot is encoded in the
default executor, and concurrent requests share one encode.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Callable

from aiohttp import web

from edgerun.errors import EdgerunError
from edgerun.service.health import Health

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpService:
    """``GET /healthz``, ``/readyz``, ``/metrics`` and ``/snapshot.jpg`` on ``host:port``.

    ``port`` 0 asks the OS for a free port; after ``start()`` the ``port``
    attribute holds the one bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        health: Health,
        metrics_text: Callable[[], str],
        snapshot_jpeg: Callable[[], bytes | None],
        health_extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.health = health
        self.health_extra = health_extra  # more of the node's state in /healthz (the swarm view)
        self.metrics_text = metrics_text
        self.snapshot_jpeg = snapshot_jpeg
        self._runner: web.AppRunner | None = None
        self._snapshot: asyncio.Future[bytes | None] | None = None
        self.snapshot_errors = 0

    async def start(self) -> None:
        """Bind and serve; raises EdgerunError naming host:port when the bind fails."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/snapshot.jpg", self._snapshot_jpg)
        # access_log=None: a probe every few seconds must not write a log line each time.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            # asyncio rewords the bind error; say it the usual way (a failed name lookup keeps its own text)
            if err.errno and not isinstance(err, socket.gaierror):
                reason = os.strerror(err.errno)
            else:
                reason = err.strerror or str(err)
            raise EdgerunError(f"http: cannot listen on {_hostport(self.host, self.port)}: {reason}") from None
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("http: serving on %s", _hostport(self.host, self.port))

    async def stop(self) -> None:
        """Close the listener and open connections; safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        body = self.health.to_json()
        if self.health_extra is not None:
            body.update(self.health_extra())
        return web.json_response(body, status=503 if body["state"] == "stopping" else 200)

    async def _readyz(self, request: web.Request) -> web.Response:
        body = self.health.to_json()
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _snapshot_jpg(self, request: web.Request) -> web.Response:
        if self._snapshot is None or self._snapshot.done():
            self._snapshot = asyncio.get_running_loop().run_in_executor(None, self.snapshot_jpeg)
        # shield: a client that hangs up must not cancel the encode other requests wait on
        try:
            jpeg = await asyncio.shield(self._snapshot)
        except Exception as err:
            # a render bug would otherwise write a traceback for every poll of the snapshot
            if self.snapshot_errors == 0:
                log.exception("http: rendering the snapshot failed; further failures are only counted")
            self.snapshot_errors += 1
            return web.Response(status=500, text=f"snapshot failed: {type(err).__name__}\n")
        if jpeg is None:
            return web.Response(status=404, text="no frame yet\n")
        return web.Response(body=jpeg, content_type="image/jpeg", headers={"Cache-Control": "no-store"})


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

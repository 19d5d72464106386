"""The node's HTTP endpoint: liveness, readiness, Prometheus metrics and a JPEG snapshot.

It runs on the node's own event loop (aiohttp), so probes see the same state
the node acts on. Nothing here touches images: the snapshot is encoded in the
default executor, and concurrent requests share one encode.

``/snapshot.jpg`` is the camera: with ``service.snapshot_token_file`` it asks
for ``Authorization: Bearer <token>`` (401 without it); without a token file it
is served only on a loopback bind (anything else answers 403 and the node logs
why once). A malformed request is logged as one line, never as a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from edgerun.errors import ConfigError, EdgerunError
from edgerun.service.health import Health

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# aiohttp's per-connection logger for this service: bad requests are rewritten to one line here.
server_log = logging.getLogger("edgerun.service.http.server")
SNAPSHOT_OFF = "snapshot off: the HTTP port is not loopback and service.snapshot_token_file is not set\n"
_REASON_MAX = 200
_TOKEN_MAX = 4096


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only reaches this machine ("" and unknown names count as not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_snapshot_token(path: str) -> bytes:
    """The bearer token in ``path`` (surrounding whitespace stripped), or a ConfigError naming the key."""
    try:
        raw = Path(path).read_bytes()[: _TOKEN_MAX + 1]
    except OSError as err:
        raise ConfigError(f"service.snapshot_token_file: {path}: {err.strerror or err}") from None
    token = raw.strip()
    if not token:
        raise ConfigError(f"service.snapshot_token_file: {path} is empty")
    if len(raw) > _TOKEN_MAX or not all(0x21 <= b < 0x7F for b in token):
        raise ConfigError(f"service.snapshot_token_file: {path}: the token must be one line of printable ASCII")
    return token


class _OneLineBadRequests(logging.Filter):
    """aiohttp logs a malformed request with its parser traceback; one line naming the client is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            try:
                remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
                lines = [line.strip() for line in str(exc.message).splitlines()]
                reason = " ".join(line for line in lines if line and set(line) != {"^"})
                if len(reason) > _REASON_MAX:
                    reason = reason[: _REASON_MAX - 3] + "..."
                record.msg, record.args = "http: bad request from %s: %d %s", (remote, exc.code, reason)
            except Exception:  # the filter must never lose the line: fall back to aiohttp's own words
                pass
            record.exc_info, record.exc_text = None, None
            if record.levelno > logging.WARNING:
                # a client's malformed bytes are not the node's error
                record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


server_log.addFilter(_OneLineBadRequests())


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
        snapshot_token_file: str = "",
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
        self.snapshot_token_file = snapshot_token_file
        self.snapshot_token: bytes | None = None
        self.snapshot_refused = 0  # requests without the right token (401) or to a snapshot that is off (403)

    async def start(self) -> None:
        """Bind and serve; raises EdgerunError naming host:port when the bind fails."""
        if self.snapshot_token_file:
            self.snapshot_token = load_snapshot_token(self.snapshot_token_file)
        elif not is_loopback(self.host):
            log.warning("http: /snapshot.jpg is off: %s", snapshot_off_reason(self.host))
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/snapshot.jpg", self._snapshot_jpg)
        # access_log=None: a probe every few seconds must not write a log line each time.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0, logger=server_log)
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

    def _snapshot_refusal(self, request: web.Request) -> web.Response | None:
        """401/403 when this request may not see the camera, else None."""
        if self.snapshot_token is None:
            if is_loopback(self.host):
                return None
            self.snapshot_refused += 1
            return web.Response(status=403, text=SNAPSHOT_OFF)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        presented = given.strip().encode(errors="replace")
        if scheme.lower() == "bearer" and hmac.compare_digest(presented, self.snapshot_token):
            return None
        self.snapshot_refused += 1
        return web.Response(
            status=401, text="snapshot needs Authorization: Bearer <token>\n", headers={"WWW-Authenticate": "Bearer"}
        )

    async def _snapshot_jpg(self, request: web.Request) -> web.Response:
        refusal = self._snapshot_refusal(request)
        if refusal is not None:
            return refusal
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


def snapshot_off_reason(host: str) -> str:
    return f"service.http_host {host or '(every address)'} is not loopback and service.snapshot_token_file is not set"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

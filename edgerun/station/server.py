"""The station's HTTP side (aiohttp): the page, one JSON snapshot, one server-sent-events stream, and actions.

    GET  /                              the page (static files shipped in the package, no CDN)
    GET  /api/snapshot                  the whole fleet as JSON (for scripts; the stream starts with it too)
    GET  /api/stream                    text/event-stream: "snapshot" first, then "delta" and "rollouts"
    GET  /api/nodes/<id>/snapshot.jpg   the node's own /snapshot.jpg when reachable, else its last boxes
    POST /api/rollouts/<model>/<action> promote (JSON {"percent": 50}) or halt; needs the header
                                        X-Edgerun-Confirm: <model> (a cross-site form cannot send it)
    GET  /ground                        the operator's ground image, if given
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from importlib import resources
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from edgerun.errors import EdgerunError
from edgerun.station.station import ActionRefused, Station, render_boxes_jpeg

log = logging.getLogger(__name__)

STATIC_FILES = {"index.html": "text/html", "station.js": "text/javascript", "station.css": "text/css"}
CLIENT_QUEUE = 64  # deltas a page may fall behind before it is cut off (and reconnects)
KEEPALIVE_S = 15.0
SNAPSHOT_TIMEOUT_S = 1.5


def _static(name: str) -> bytes:
    return resources.files("edgerun.station").joinpath("static", name).read_bytes()


class StationServer:
    def __init__(self, station: Station, host: str, port: int) -> None:
        self.station = station
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._file)
        app.router.add_get("/api/snapshot", self._snapshot)
        app.router.add_get("/api/stream", self._stream)
        app.router.add_get("/api/nodes/{node}/snapshot.jpg", self._node_snapshot)
        app.router.add_post("/api/rollouts/{model}/{action}", self._action)
        app.router.add_get("/ground", self._ground)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as err:
            await runner.cleanup()
            reason = os.strerror(err.errno) if err.errno and not isinstance(err, socket.gaierror) else str(err)
            raise EdgerunError(f"station: cannot listen on {self.host}:{self.port}: {reason}") from None
        self._runner = runner
        self.port = runner.addresses[0][1]
        self._session = ClientSession(timeout=ClientTimeout(total=SNAPSHOT_TIMEOUT_S))

    async def stop(self) -> None:
        for queue in list(self.station.clients):
            self.station.clients.discard(queue)
            try:
                queue.put_nowait("")  # wakes the stream handler, which then ends
            except asyncio.QueueFull:
                pass  # it has messages to wake it, and then sees it was removed
        if self._session is not None:
            await self._session.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(body=_static("index.html"), content_type="text/html", charset="utf-8")

    async def _file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound()
        return web.Response(body=_static(name), content_type=STATIC_FILES[name], charset="utf-8")

    async def _snapshot(self, request: web.Request) -> web.Response:
        return web.json_response(self.station.snapshot(), dumps=_dumps)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        queue: asyncio.Queue[str] = asyncio.Queue(CLIENT_QUEUE)
        self.station.clients.add(queue)
        try:
            await response.write(f"event: snapshot\ndata: {_dumps(self.station.snapshot())}\n\n".encode())
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    message = ": keep-alive\n\n"
                if not message or queue not in self.station.clients:
                    break
                await response.write(message.encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.station.clients.discard(queue)
        return response

    async def _node_snapshot(self, request: web.Request) -> web.Response:
        node = self.station.model.nodes.get(request.match_info["node"])
        if node is None:
            raise web.HTTPNotFound(text="no such node\n")
        address = self.station.node_http(node)
        headers = {"Cache-Control": "no-store"}
        if address and self._session is not None:
            try:
                async with self._session.get(f"http://{address}/snapshot.jpg") as r:
                    if r.status == 200 and r.content_type == "image/jpeg":
                        body = await r.content.read(8 << 20)
                        return web.Response(body=body, content_type="image/jpeg",
                                            headers={**headers, "X-Edgerun-Snapshot": "live"})
            except (OSError, asyncio.TimeoutError) as err:
                log.debug("station: %s snapshot from %s failed: %s", node.id, address, err)
            except Exception as err:  # aiohttp client errors: the node is simply not reachable
                log.debug("station: %s snapshot from %s failed: %s", node.id, address, err)
        body = await asyncio.get_running_loop().run_in_executor(None, render_boxes_jpeg, node)
        return web.Response(body=body, content_type="image/jpeg", headers={**headers, "X-Edgerun-Snapshot": "boxes"})

    async def _action(self, request: web.Request) -> web.Response:
        model, action = request.match_info["model"], request.match_info["action"]
        if request.headers.get("X-Edgerun-Confirm") != model:
            return web.json_response({"error": f"confirm the action: send X-Edgerun-Confirm: {model}"}, status=400)
        try:
            body: Any = await request.json() if request.can_read_body else {}
            percent = float(body.get("percent", 0.0)) if isinstance(body, dict) else 0.0
        except (ValueError, TypeError):
            return web.json_response({"error": "body: expected JSON like {\"percent\": 50}"}, status=400)
        try:
            state = await self.station.act(model, action, percent)
        except ActionRefused as err:
            return web.json_response({"error": str(err)}, status=403)
        except EdgerunError as err:
            return web.json_response({"error": str(err)}, status=502)
        return web.json_response({"ok": True, "state": state})

    async def _ground(self, request: web.Request) -> web.StreamResponse:
        path = self.station.options.ground
        if path is None:
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={"Cache-Control": "max-age=3600"})


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)

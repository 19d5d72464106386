"""The station's HTTP side (aiohttp): the page, one JSON snapshot, one server-sent-events stream, and actions.

    GET  /                              the page (static files shipped in the package, no CDN)
    GET  /login, POST /login            the operator's login form (only with --users)
    POST /logout                        ends the session (needs X-CSRF-Token)
    GET  /api/session                   who is logged in, the CSRF token for POSTs, whether the page may act
    GET  /api/snapshot                  the whole fleet as JSON (for scripts; the stream starts with it too)
    GET  /api/stream                    text/event-stream: "snapshot" first, then "delta" and "rollouts"
    GET  /api/nodes/<id>/snapshot.jpg   the node's own /snapshot.jpg when allowed and reachable, else its last boxes
    POST /api/rollouts/<model>/<action> promote (JSON {"percent": 50}) or halt; needs the header
                                        X-Edgerun-Confirm: <model> (a cross-site form cannot send it)
    GET  /ground                        the operator's ground image, if given
    (and the map's basemap tiles, vendored Leaflet and the object exports: edgerun.station.map_routes;
    acknowledging an alert: edgerun.station.alert_routes)

The doors, in the order a request meets them:

* Host: every request names this station (its bind address, the localhost names on a loopback
  bind, any IP literal on a wildcard bind, or an --allowed-host name); a DNS-rebinding page's
  requests name the attacker's domain and get 403.
* Origin: a state-changing request from a browser comes from this station's own origin (403 otherwise).
* Login (--users FILE): every page and API needs a session cookie, except the login form and the
  static files (and, with --public-view, read-only GETs); every POST needs the session's CSRF token.
* Without --users: a loopback bind is one operator's machine and works without login; any other
  bind refuses to start unless --public-view makes the page read-only.
"""

from __future__ import annotations

import asyncio
import html
import ipaddress
import json
import logging
import os
import socket
import ssl
import time
from importlib import resources
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import ClientSession, ClientTimeout, web

from edgerun.errors import ConfigError, EdgerunError
from edgerun.station.alert_routes import AlertRoutes
from edgerun.station.auth import LoginThrottle, Session, Sessions, UserFile, csrf_ok, dummy_hash, verify_password
from edgerun.station.map_routes import MapRoutes
from edgerun.station.station import ActionRefused, Station, render_boxes_jpeg
from edgerun.station.tiles import open_tiles

log = logging.getLogger(__name__)

STATIC_FILES = {
    "index.html": "text/html",
    "station.js": "text/javascript",
    "station-map.js": "text/javascript",
    "alerts.js": "text/javascript",
    "patch.js": "text/javascript",
    "station.css": "text/css",
}
CLIENT_QUEUE = 64  # deltas a page may fall behind before it is cut off (and reconnects)
KEEPALIVE_S = 15.0
SNAPSHOT_TIMEOUT_S = 1.5
SNAPSHOT_MAX_BYTES = 4 << 20  # a node's JPEG is far smaller; anything bigger is not a snapshot
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
COOKIE = "edgerun_session"
# The page loads only its own files; nobody may frame it (a framed halt button could be clicked through).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; style-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _static(name: str) -> bytes:
    return (resources.files("edgerun.station") / "static" / name).read_bytes()  # joinpath takes one part on 3.10


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_policy(host: str, users: bool, public_view: bool) -> None:
    """Without operator accounts the page may only be reached from this machine, or be read-only."""
    if users or public_view or is_loopback(host):
        return
    raise ConfigError(
        f"binding {host or '0.0.0.0'} needs --users FILE (edgerun station passwd) or --public-view for a read-only page"
    )


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as err:  # an OSError too: caught first
        raise ConfigError(
            f"--tls-cert {cert} / --tls-key {key}: not a matching PEM certificate and key ({err.reason or err})"
        ) from None
    except OSError as err:
        raise ConfigError(f"--tls-cert/--tls-key: {err.strerror or err}: {err.filename or cert}") from None
    return context


def host_name(header: str) -> str:
    """The name in a Host header, without its port, brackets or trailing dot, lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:].partition("]")[0]
    else:
        name = header.rpartition(":")[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def _error(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status, headers={"Cache-Control": "no-store"})


class StationServer:
    def __init__(self, station: Station, host: str, port: int) -> None:
        self.station = station
        self.host, self.port = host, port
        options = station.options
        check_bind_policy(host, options.users_file is not None, options.public_view)
        if (options.tls_cert is None) != (options.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        self.ssl = tls_context(options.tls_cert, options.tls_key) if options.tls_cert and options.tls_key else None
        self.users = UserFile(options.users_file) if options.users_file is not None else None
        self.public_view = options.public_view
        self.sessions = Sessions()
        self.throttle = LoginThrottle()
        self._throttle_noted: dict[str, float] = {}
        bind = host.strip("[]").lower()
        self._wildcard = bind in WILDCARDS
        self._hosts = {bind} | {host_name(h) for h in options.allowed_hosts}
        if is_loopback(bind):
            self._hosts |= LOOPBACK_NAMES
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.map = MapRoutes(station.model.objects, open_tiles(options.tiles) if options.tiles else None)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl is not None else "http"

    async def start(self) -> None:
        if self.users is not None and self.ssl is None and not is_loopback(self.host):
            log.warning(
                "station: operators' passwords and cookies cross the network in clear: give --tls-cert and --tls-key"
            )
        app = web.Application(client_max_size=64 * 1024, middlewares=[self._doors])
        app.on_response_prepare.append(self._headers)
        app.router.add_get("/", self._index)
        app.router.add_get("/login", self._login_page)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)
        app.router.add_get("/static/{name}", self._file)
        app.router.add_get("/api/session", self._session_info)
        app.router.add_get("/api/snapshot", self._snapshot)
        app.router.add_get("/api/stream", self._stream)
        app.router.add_get("/api/nodes/{node}/snapshot.jpg", self._node_snapshot)
        app.router.add_post("/api/rollouts/{model}/{action}", self._action)
        app.router.add_post("/api/nodes/{node}/retire", self._retire)
        app.router.add_get("/api/objects/{object_id}/image", self._object_image)
        app.router.add_get("/ground", self._ground)
        self.map.add_to(app)
        AlertRoutes(self.station, self.can_act).add_to(app)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port, ssl_context=self.ssl).start()
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
        if self.map.tiles is not None:
            self.map.tiles.close()

    # -- the doors --------------------------------------------------------------------------

    def host_allowed(self, name: str) -> bool:
        if name in self._hosts:
            return True
        if self._wildcard:
            try:
                ipaddress.ip_address(name)
                return True  # an IP literal cannot be rebound to another address
            except ValueError:
                return False
        return False

    def _session_of(self, request: web.Request) -> Session | None:
        if self.users is None:
            return None
        return self.sessions.get(request.cookies.get(COOKIE))

    @web.middleware
    async def _doors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        raw_host = request.headers.get("Host", "")
        name = host_name(raw_host)
        if not self.host_allowed(name):
            return _error(403, f"host {name[:80]!r} is not this station's name (start it with --allowed-host NAME)")
        if request.method not in SAFE_METHODS:
            origin = request.headers.get("Origin")
            own = f"{self.scheme}://{raw_host.strip()}".lower()
            if origin is not None and origin.lower() != own:
                return _error(403, f"origin {origin[:80]!r} is not this station ({own})")
            if origin is None and request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
                return _error(403, "a cross-site request cannot change anything")
        session = self._session_of(request)
        request["session"] = session
        if self.users is not None and not (request.path == "/login" or request.path.startswith("/static/")):
            if session is None and not (self.public_view and request.method in SAFE_METHODS):
                if request.path.startswith("/api/") or request.method not in SAFE_METHODS:
                    return _error(401, "log in first (POST /login)")
                raise web.HTTPSeeOther("/login")
            if request.method not in SAFE_METHODS and (
                session is None or not csrf_ok(session, request.headers.get("X-CSRF-Token"))
            ):
                return _error(403, "missing or wrong X-CSRF-Token (GET /api/session gives it)")
        return await handler(request)

    async def _headers(self, request: web.Request, response: web.StreamResponse) -> None:
        for key, value in SECURITY_HEADERS.items():
            response.headers.setdefault(key, value)
        if self.ssl is not None:  # a browser that saw HTTPS once never tries the name in clear again
            response.headers.setdefault("Strict-Transport-Security", "max-age=31536000")

    def can_act(self, session: Session | None) -> bool:
        if self.users is not None:
            return session is not None
        return not self.public_view

    # -- login ------------------------------------------------------------------------------

    def _login_html(self, message: str = "", status: int = 200) -> web.Response:
        text = _static("login.html").decode().replace("<!--message-->", html.escape(message))
        return web.Response(
            text=text, content_type="text/html", charset="utf-8", status=status, headers={"Cache-Control": "no-store"}
        )

    async def _login_page(self, request: web.Request) -> web.Response:
        if self.users is None or request["session"] is not None:
            raise web.HTTPSeeOther("/")
        return self._login_html()

    async def _login(self, request: web.Request) -> web.Response:
        if self.users is None:
            return _error(404, "this station has no operator accounts (start it with --users FILE)")
        client = request.remote or "?"
        if not self.throttle.allow(client):
            now = time.time()
            if now - self._throttle_noted.get(client, 0.0) > self.throttle.window_s:
                self._throttle_noted[client] = now
                self.station._event(
                    "login",
                    f"login attempts from {client} throttled (more than {self.throttle.attempts} a minute)",
                    "error",
                )
            return self._login_html("Too many attempts: wait a minute.", 429)
        form = await request.post()
        user, password = str(form.get("user", ""))[:64], str(form.get("password", ""))[:1024]
        hashed = self.users.lookup(user)
        ok = await asyncio.to_thread(verify_password, hashed or dummy_hash(), password)
        if not ok or hashed is None:
            self.station._event("login", f"failed login as {user!r} from {client}", "error")
            return self._login_html("Wrong user name or password.", 401)
        self.sessions.drop(request.cookies.get(COOKIE))  # a new token at every login: no fixation
        token, _ = self.sessions.create(user)
        self.station._event("login", f"operator {user} logged in from {client}")
        response = web.Response(status=303, headers={"Location": "/", "Cache-Control": "no-store"})
        response.set_cookie(
            COOKIE,
            token,
            path="/",
            httponly=True,
            samesite="Strict",
            secure=self.ssl is not None,
            max_age=int(self.sessions.ttl_s),
        )
        return response

    async def _logout(self, request: web.Request) -> web.Response:
        session: Session | None = request["session"]
        self.sessions.drop(request.cookies.get(COOKIE))
        if session is not None:
            self.station._event("login", f"operator {session.user} logged out")
        response = web.json_response({"ok": True}, headers={"Cache-Control": "no-store"})
        response.del_cookie(COOKIE, path="/")
        return response

    async def _session_info(self, request: web.Request) -> web.Response:
        session: Session | None = request["session"]
        return web.json_response(
            {
                "login": self.users is not None,
                "user": session.user if session else None,
                "csrf": session.csrf if session else None,
                "can_act": self.can_act(session),
            },
            headers={"Cache-Control": "no-store"},
        )

    # -- the page ---------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(
            body=_static("index.html"), content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"}
        )

    async def _file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound()
        return web.Response(body=_static(name), content_type=STATIC_FILES[name], charset="utf-8")

    async def _snapshot(self, request: web.Request) -> web.Response:
        return web.json_response(self.station.snapshot(), dumps=_dumps, headers={"Cache-Control": "no-store"})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        queue: asyncio.Queue[str] = asyncio.Queue(CLIENT_QUEUE)
        self.station.clients.add(queue)
        token = request.cookies.get(COOKIE) if request["session"] is not None else None
        try:
            await response.write(f"event: snapshot\ndata: {_dumps(self.station.snapshot())}\n\n".encode())
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    message = ": keep-alive\n\n"
                if not message or queue not in self.station.clients:
                    break
                if token is not None and self.sessions.get(token) is None:
                    break  # logged out or expired: the page finds out when it reconnects
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
            body = await self._fetch_snapshot(node.id, address)
            if body is not None:
                return web.Response(
                    body=body, content_type="image/jpeg", headers={**headers, "X-Edgerun-Snapshot": "live"}
                )
        body = await asyncio.get_running_loop().run_in_executor(None, render_boxes_jpeg, node)
        return web.Response(body=body, content_type="image/jpeg", headers={**headers, "X-Edgerun-Snapshot": "boxes"})

    async def _fetch_snapshot(self, node_id: str, address: str) -> bytes | None:
        """The node's JPEG: no redirect followed, at most SNAPSHOT_MAX_BYTES, within SNAPSHOT_TIMEOUT_S."""
        assert self._session is not None
        token = self.station.options.snapshot_token
        request_headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with self._session.get(
                f"http://{address}/snapshot.jpg", allow_redirects=False, headers=request_headers
            ) as r:
                if r.status != 200 or r.content_type != "image/jpeg":
                    log.debug("station: %s snapshot from %s: HTTP %s %s", node_id, address, r.status, r.content_type)
                    return None
                if (r.content_length or 0) > SNAPSHOT_MAX_BYTES:
                    return None
                body = bytearray()
                async for chunk in r.content.iter_chunked(64 * 1024):  # read() alone stops at what has arrived
                    body += chunk
                    if len(body) > SNAPSHOT_MAX_BYTES:
                        log.debug("station: %s snapshot from %s is over %d bytes", node_id, address, SNAPSHOT_MAX_BYTES)
                        return None
                return bytes(body)
        except (OSError, asyncio.TimeoutError) as err:
            log.debug("station: %s snapshot from %s failed: %s", node_id, address, err)
        except Exception as err:  # aiohttp client errors: the node is simply not reachable
            log.debug("station: %s snapshot from %s failed: %s", node_id, address, err)
        return None

    async def _action(self, request: web.Request) -> web.Response:
        model, action = request.match_info["model"], request.match_info["action"]
        session: Session | None = request["session"]
        if not self.can_act(session):
            return _error(
                403,
                "this page is read-only (--public-view without --users): act from a station "
                "with operator accounts, or with `edgerun fleet`",
            )
        if request.headers.get("X-Edgerun-Confirm") != model:
            return _error(400, f"confirm the action: send X-Edgerun-Confirm: {model}")
        try:
            body: Any = await request.json() if request.can_read_body else {}
            percent = float(body.get("percent", 0.0)) if isinstance(body, dict) else 0.0
        except (ValueError, TypeError):
            return _error(400, 'body: expected JSON like {"percent": 50}')
        by = f"operator:{session.user}" if session is not None else "operator"
        try:
            state = await self.station.act(model, action, percent, by=by)
        except ActionRefused as err:  # 409 for a forged, replayed or halted release (ReleaseConflict)
            return _error(err.status, str(err))
        except EdgerunError as err:
            return _error(502, str(err))
        return web.json_response({"ok": True, "state": state})

    async def _retire(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        session: Session | None = request["session"]
        if not self.can_act(session):
            return _error(
                403,
                "this page is read-only: retire from a station with operator accounts, or with `edgerun fleet retire`",
            )
        if request.headers.get("X-Edgerun-Confirm") != node_id:
            return _error(400, f"confirm the action: send X-Edgerun-Confirm: {node_id}")
        by = f"operator:{session.user}" if session is not None else "operator"
        try:
            retired = self.station.retire(node_id, by=by)
        except ActionRefused as err:
            return _error(err.status, str(err))
        return web.json_response({"ok": True, "retired": retired})

    async def _object_image(self, request: web.Request) -> web.Response:
        object_id = request.match_info["object_id"]
        store = self.station.store
        if object_id not in self.station.model.images or store is None:
            raise web.HTTPNotFound(text="no picture of that object\n")
        body = await asyncio.to_thread(store.image, object_id)
        if body is None:  # known but not written yet: hand the journal to the writer and wait for it
            self.station.persist()
            await asyncio.to_thread(store.flush, 5.0)
            body = await asyncio.to_thread(store.image, object_id)
        if body is None:
            raise web.HTTPNotFound(text="no picture of that object\n")
        return web.Response(body=body, content_type="image/jpeg", headers={"Cache-Control": "no-cache"})

    async def _ground(self, request: web.Request) -> web.StreamResponse:
        path = self.station.options.ground
        if path is None:
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={"Cache-Control": "max-age=3600"})


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


def parse_node_nets(items: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for item in items:
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(f"--node-net: expected an address range like 10.42.0.0/16, got {item!r}") from None
    return nets


def read_snapshot_token(path: str) -> str:
    """The bearer token the nodes' /snapshot.jpg wants: one line, no spaces."""
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(f"--snapshot-token-file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        token = ""
    if not token or not token.isprintable() or any(c.isspace() for c in token) or len(token) > 4096:
        raise ConfigError(f"--snapshot-token-file {path}: expected one token on one line")
    return token

"""The ground station's doors, end to end: the real ``edgerun station`` process, real mosquitto, real HTTP.

* Host and Origin: a DNS-rebinding page's requests (a foreign Host and Origin) are refused and a rollout
  does not move; the same request from the station's own origin moves it.
* Login: with --users every page and API needs a session, every POST the session's CSRF token;
  failures are events; attempts are throttled; --public-view opens reading only.
* TLS: the station serves HTTPS with a certificate made here, and its cookie is Secure.
* SSRF: a node advertising an address outside --node-net is never contacted; an allowed one is asked
  once, without following its redirect, and must answer a bounded image/jpeg; the bearer token of
  --snapshot-token-file goes with the request.
* A real browser logs in through the form and the page loads.
"""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from edgerun.ota.manifest import parse_manifest
from edgerun.ota.transport_mqtt import decode_release, release_topic
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.station.auth import set_password
from tests.conftest import free_port
from tests.integration.brokers import wait_for
from tests.integration.station_rig import CHROMEDRIVER, browser, chromium, submit_login  # noqa: F401 (fixture)
from tests.integration.test_station_browser import text_of
from tests.unit.test_ota_release import Fleet, head_variant

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")

PASSWORD = "correct horse battery"
MODEL = "blazeface_short"


class StationProc:
    """``edgerun station`` on a free loopback port; its first line says it is serving."""

    def __init__(self, tmp: Path, broker_port: int, *extra: str, name: str = "station") -> None:
        self.port = free_port()
        self.log = tmp / f"{name}.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgerun",
                "station",
                "--mqtt",
                f"127.0.0.1:{broker_port}",
                "--bind",
                f"127.0.0.1:{self.port}",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline()
        assert self.first_line.startswith("station: http"), self.log.read_text()[-2000:]
        self.host = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Reply:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    tls: ssl.SSLContext | None = None,
) -> Reply:
    """One request, redirects not followed; a Host in ``headers`` replaces the real one."""
    conn: http.client.HTTPConnection
    if tls is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=20, context=tls)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Reply(r.status, r.headers, r.read())
    finally:
        conn.close()


def own(station: StationProc, scheme: str = "http") -> dict[str, str]:
    """The headers a browser on the station's own page sends with a POST."""
    return {"Host": station.host, "Origin": f"{scheme}://{station.host}"}


def login(
    station: StationProc, user: str = "alice", password: str = PASSWORD, tls: ssl.SSLContext | None = None
) -> Reply:
    scheme = "https" if tls else "http"
    form = f"user={user}&password={password.replace(' ', '+')}".encode()
    return call(
        station.port,
        "POST",
        "/login",
        {**own(station, scheme), "Content-Type": "application/x-www-form-urlencoded"},
        form,
        tls,
    )


def cookie_of(reply: Reply) -> str:
    header = reply.headers["Set-Cookie"]
    return header.split(";", 1)[0]


def events(station: StationProc, cookie: str = "") -> list[str]:
    snap = call(station.port, "GET", "/api/snapshot", {"Cookie": cookie} if cookie else {}).json()
    return [e["text"] for e in snap["events"]]


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    path = tmp_path / "station-users"
    set_password(path, "alice", PASSWORD)
    return path


# -- Host and Origin (DNS rebinding) -------------------------------------------------------------------------


def retained_percent(broker_port: int) -> float:
    from edgerun.fleet.rollout import read_topics

    retained = read_topics("127.0.0.1", broker_port, [release_topic(MODEL)])
    offer = decode_release(retained[release_topic(MODEL)], release_topic(MODEL))
    return parse_manifest(offer.manifest).rollout.percent


@pytest.mark.timeout(240)
def test_a_rebinding_page_cannot_halt_a_rollout(tmp_path, blazeface_bundle):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    key_file = tmp_path / "release.key"
    key_file.write_text(fleet.release_keys[0].to_text())
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    with run_mosquitto() as broker:
        mqtt = f"127.0.0.1:{broker.port}"
        station = StationProc(
            tmp_path,
            broker.port,
            "--signing-key",
            str(key_file),
            "--root-key",
            fleet.root_pub_paths[0],
            "--no-auto-halt",
            "--allowed-host",
            "station.example",
        )
        try:
            published = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "edgerun",
                    "fleet",
                    "publish",
                    str(v2.root),
                    "--percent",
                    "10",
                    "--keys",
                    str(fleet.release_dir),
                    "--signing-key",
                    str(key_file),
                    "--root-key",
                    fleet.root_pub_paths[0],
                    "--mqtt",
                    mqtt,
                    "--fleet-seconds",
                    "0",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert published.returncode == 0, published.stderr
            assert wait_for(lambda: MODEL in call(station.port, "GET", "/api/snapshot").json()["rollouts"], 30)

            evil = {
                "Host": f"evil.example:{station.port}",
                "Origin": f"http://evil.example:{station.port}",
                "X-Edgerun-Confirm": MODEL,
                "Content-Type": "application/json",
            }
            refused = call(station.port, "POST", f"/api/rollouts/{MODEL}/halt", evil, b"{}")
            assert refused.status == 403, refused.body
            assert refused.body.count(b"\n") == 0 and "evil.example" in refused.json()["error"]
            assert call(station.port, "GET", "/api/snapshot", {"Host": "evil.example"}).status == 403
            assert call(station.port, "GET", "/", {"Host": f"evil.example:{station.port}"}).status == 403
            # the right Host with a foreign Origin (a cross-site page on a name the station answers to)
            cross = call(station.port, "POST", f"/api/rollouts/{MODEL}/halt", {**evil, "Host": station.host}, b"{}")
            assert cross.status == 403 and "origin" in cross.json()["error"]
            time.sleep(1.5)  # the canary watch would have seen a halt by now
            assert retained_percent(broker.port) == 10
            view = call(station.port, "GET", "/api/snapshot").json()["rollouts"][MODEL]
            assert (view["phase"], view["percent"]) == ("canary", 10)

            # a name given with --allowed-host is the station's own
            named = call(station.port, "GET", "/api/session", {"Host": f"station.example:{station.port}"})
            assert named.status == 200 and named.json()["can_act"] is True
            # the same halt from the station's own page goes through
            done = call(
                station.port,
                "POST",
                f"/api/rollouts/{MODEL}/halt",
                {**own(station), "X-Edgerun-Confirm": MODEL, "Content-Type": "application/json"},
                b"{}",
            )
            assert done.status == 200, done.body
            assert retained_percent(broker.port) == 0
        finally:
            station.stop()


# -- login, sessions, CSRF -----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_login_is_required_and_every_post_needs_the_csrf_token(tmp_path, users_file):
    with run_mosquitto() as broker:
        station = StationProc(tmp_path, broker.port, "--users", str(users_file))
        try:
            assert "operators log in" in station.first_line
            page = call(station.port, "GET", "/")
            assert page.status == 303 and page.headers["Location"] == "/login"
            assert call(station.port, "GET", "/api/snapshot").status == 401
            assert call(station.port, "GET", "/api/stream").status == 401
            assert call(station.port, "GET", "/ground").status == 303
            form = call(station.port, "GET", "/login")
            assert form.status == 200 and b'action="/login"' in form.body
            assert "frame-ancestors 'none'" in form.headers["Content-Security-Policy"]
            assert call(station.port, "GET", "/static/station.css").status == 200
            halt = {**own(station), "X-Edgerun-Confirm": "m", "Content-Type": "application/json"}
            assert call(station.port, "POST", "/api/rollouts/m/halt", halt, b"{}").status == 401

            wrong = login(station, password="wrong password")
            assert wrong.status == 401 and b"Wrong user name or password." in wrong.body
            assert "Set-Cookie" not in wrong.headers
            assert login(station, user="mallory").status == 401

            ok = login(station)
            assert ok.status == 303 and ok.headers["Location"] == "/"
            set_cookie = ok.headers["Set-Cookie"]
            assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and "Secure" not in set_cookie
            cookie = cookie_of(ok)
            assert len(cookie.split("=", 1)[1]) >= 43  # 32 random bytes
            assert call(station.port, "GET", "/", {"Cookie": cookie}).status == 200
            session = call(station.port, "GET", "/api/session", {"Cookie": cookie}).json()
            assert session["user"] == "alice" and session["can_act"] and len(session["csrf"]) >= 43

            # a valid cookie without the token, or with another one, is refused before the action is looked at
            no_token = call(station.port, "POST", "/api/rollouts/m/halt", {**halt, "Cookie": cookie}, b"{}")
            assert no_token.status == 403 and "X-CSRF-Token" in no_token.json()["error"]
            bad_token = call(
                station.port,
                "POST",
                "/api/rollouts/m/halt",
                {**halt, "Cookie": cookie, "X-CSRF-Token": "x" * 43},
                b"{}",
            )
            assert bad_token.status == 403 and "X-CSRF-Token" in bad_token.json()["error"]
            with_token = call(
                station.port,
                "POST",
                "/api/rollouts/m/halt",
                {**halt, "Cookie": cookie, "X-CSRF-Token": session["csrf"]},
                b"{}",
            )
            assert with_token.status == 403 and "read-only" in with_token.json()["error"]  # no --signing-key

            texts = events(station, cookie)
            assert any("failed login as 'alice' from 127.0.0.1" in t for t in texts), texts
            assert any("failed login as 'mallory'" in t for t in texts)
            assert any("operator alice logged in from 127.0.0.1" in t for t in texts)

            # logging out ends the session on the station, not only in the browser
            assert call(station.port, "POST", "/logout", {**own(station), "Cookie": cookie}).status == 403
            out = call(
                station.port, "POST", "/logout", {**own(station), "Cookie": cookie, "X-CSRF-Token": session["csrf"]}
            )
            assert out.status == 200
            assert call(station.port, "GET", "/api/session", {"Cookie": cookie}).status == 401

            # three attempts so far from 127.0.0.1: the fourth and fifth are answered, the sixth throttled
            for _ in range(2):
                assert login(station, password="wrong again").status == 401
            throttled = login(station)
            assert throttled.status == 429 and b"Too many attempts" in throttled.body
            assert "Set-Cookie" not in throttled.headers
        finally:
            station.stop()


@pytest.mark.timeout(180)
def test_public_view_opens_reading_only(tmp_path, users_file):
    with run_mosquitto() as broker:
        with_users = StationProc(tmp_path, broker.port, "--users", str(users_file), "--public-view", name="a")
        no_users = StationProc(tmp_path, broker.port, "--public-view", name="b")
        try:
            assert call(with_users.port, "GET", "/").status == 200
            assert call(with_users.port, "GET", "/api/snapshot").status == 200
            info = call(with_users.port, "GET", "/api/session").json()
            assert info == {"login": True, "user": None, "csrf": None, "can_act": False}
            halt = {"X-Edgerun-Confirm": "m", "Content-Type": "application/json"}
            assert (
                call(with_users.port, "POST", "/api/rollouts/m/halt", {**own(with_users), **halt}, b"{}").status == 401
            )

            assert "view only" in no_users.first_line
            assert call(no_users.port, "GET", "/api/snapshot").status == 200
            refused = call(no_users.port, "POST", "/api/rollouts/m/halt", {**own(no_users), **halt}, b"{}")
            assert refused.status == 403 and "--public-view" in refused.json()["error"]
        finally:
            with_users.stop()
            no_users.stop()


# -- TLS -----------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI is not installed")
def test_the_station_serves_https_with_a_secure_cookie(tmp_path, users_file):
    cert, key = tmp_path / "station.crt", tmp_path / "station.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls = ssl.create_default_context(cafile=str(cert))
    with run_mosquitto() as broker:
        station = StationProc(
            tmp_path, broker.port, "--users", str(users_file), "--tls-cert", str(cert), "--tls-key", str(key)
        )
        try:
            assert station.first_line.startswith(f"station: https://127.0.0.1:{station.port}/")
            ok = login(station, tls=tls)
            assert ok.status == 303, ok.body
            assert "Secure" in ok.headers["Set-Cookie"] and "HttpOnly" in ok.headers["Set-Cookie"]
            assert ok.headers["Strict-Transport-Security"] == "max-age=31536000"
            session = call(station.port, "GET", "/api/session", {"Cookie": cookie_of(ok)}, tls=tls).json()
            assert session["user"] == "alice"
            # an http:// Origin is not this station's (https) origin
            http_origin = call(station.port, "POST", "/login", {**own(station, "http")}, b"", tls=tls)
            assert http_origin.status == 403
            with pytest.raises((http.client.HTTPException, ConnectionError)):
                reply = call(station.port, "GET", "/api/session")  # plain HTTP to the TLS port
                assert reply.status >= 400  # aiohttp may answer a 400 in clear before closing
                raise ConnectionError(reply.status)
        finally:
            station.stop()


# -- SSRF ----------------------------------------------------------------------------------------------------


class FakeNode(ThreadingHTTPServer):
    """A little HTTP server that records every request and answers as ``behaviour`` says."""

    def __init__(self, host: str, behaviour: str, location: str = "") -> None:
        self.hits: list[dict[str, str | None]] = []
        self.behaviour, self.location = behaviour, location
        self.jpeg = b"\xff\xd8\xff\xe0live snapshot of " + behaviour.encode() + b"\xff\xd9"
        super().__init__((host, 0), _FakeNodeHandler)
        self.address = f"{host}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _FakeNodeHandler(BaseHTTPRequestHandler):
    server: FakeNode

    def do_GET(self) -> None:
        node = self.server
        node.hits.append({"path": self.path, "auth": self.headers.get("Authorization")})
        try:
            if node.behaviour == "redirect":
                self.send_response(302)
                self.send_header("Location", node.location)
                self.end_headers()
            elif node.behaviour == "html":
                self._send(b"<html>an internal admin page</html>", "text/html")
            elif node.behaviour == "huge":  # no Content-Length: the station has to stop reading by itself
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.end_headers()
                chunk = b"\xff" * 65536
                for _ in range(80):  # 5 MiB
                    self.wfile.write(chunk)
            else:
                self._send(node.jpeg, "image/jpeg")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def advertise(broker_port: int, nodes: dict[str, str]) -> None:
    """Each node's metrics (with the ``http`` address it advertises), as a node publishes them."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", broker_port)
    client.loop_start()
    try:
        for node, address in nodes.items():
            summary = {
                "model": MODEL,
                "model_version": 1,
                "engine": "tflite",
                "state": "running",
                "frames": 10,
                "detections": 5,
                "fps": 5.0,
                "latency_p99_ms": 30.0,
                "dropped": 0,
                "http": address,
            }
            doc = {"schema": "edgerun.metrics/1", "node": node, "ts": time.time(), "summary": summary}
            client.publish(f"edgerun/{node}/metrics", json.dumps(doc), qos=1).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.mark.timeout(180)
def test_snapshots_are_fetched_only_from_allowed_node_addresses(tmp_path):
    # Every 127/8 address is loopback on Linux: 127.0.0.2 is "the drone net", 127.0.0.1 the station's own services.
    internal = FakeNode("127.0.0.1", "jpeg")  # e.g. a metadata or admin service: never to be reached
    planted = FakeNode("127.0.0.1", "jpeg")
    servers = {
        "good": FakeNode("127.0.0.2", "jpeg"),
        "redirect": FakeNode("127.0.0.2", "redirect", f"http://{internal.address}/snapshot.jpg"),
        "html": FakeNode("127.0.0.2", "html"),
        "huge": FakeNode("127.0.0.2", "huge"),
    }
    token = tmp_path / "snapshot.token"
    token.write_text("fleet-snapshot-token\n")
    advertised = {name: server.address for name, server in servers.items()}
    advertised["planted"] = planted.address  # outside --node-net
    advertised["named"] = f"localhost:{planted.server_address[1]}"  # a name, not an IP literal
    with run_mosquitto() as broker:
        station = StationProc(tmp_path, broker.port, "--node-net", "127.0.0.2/32", "--snapshot-token-file", str(token))
        try:

            def known() -> bool:
                advertise(broker.port, advertised)
                nodes = call(station.port, "GET", "/api/snapshot").json()["nodes"]
                return set(advertised) <= set(nodes)

            assert wait_for(known, 30, 0.5), station.log.read_text()[-2000:]

            def snapshot(node: str) -> Reply:
                reply = call(station.port, "GET", f"/api/nodes/{node}/snapshot.jpg")
                assert reply.status == 200 and reply.headers["Content-Type"] == "image/jpeg"
                return reply

            good = snapshot("good")
            assert good.headers["X-Edgerun-Snapshot"] == "live" and good.body == servers["good"].jpeg
            assert servers["good"].hits == [{"path": "/snapshot.jpg", "auth": "Bearer fleet-snapshot-token"}]

            for node in ("planted", "named", "redirect", "html", "huge"):
                reply = snapshot(node)
                assert reply.headers["X-Edgerun-Snapshot"] == "boxes", node
                assert reply.body[:2] == b"\xff\xd8" and b"live snapshot" not in reply.body
            assert planted.hits == [] and internal.hits == []  # never contacted, redirect not followed
            assert len(servers["redirect"].hits) == 1 and len(servers["html"].hits) == 1
        finally:
            station.stop()
            for server in (internal, planted, *servers.values()):
                server.shutdown()
                server.server_close()


# -- a real browser logs in ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not Path(CHROMEDRIVER).exists() or not shutil.which("chromium"),
    reason="Debian's chromium and chromium-driver are not installed",
)
def test_a_browser_logs_in_through_the_form_and_out_again(tmp_path, users_file, browser):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    with run_mosquitto() as broker:
        station = StationProc(tmp_path, broker.port, "--users", str(users_file))
        try:
            url = f"http://127.0.0.1:{station.port}/"
            driver.get(url)
            assert driver.current_url.endswith("/login") and "log in" in driver.title

            # Elements are read through text_of (found and read in one script call): the form's answer is a new page.
            submit_login(driver, "alice", "not the password")
            assert wait_for(lambda: "Wrong user name or password" in (text_of(driver, "login-error") or ""), 15)
            submit_login(driver, "alice", PASSWORD)
            assert wait_for(lambda: driver.title == "edgerun ground station", 15), driver.page_source[:500]
            assert wait_for(lambda: text_of(driver, "who") == "operator alice", 15)
            assert wait_for(
                lambda: f"mqtt://127.0.0.1:{broker.port}" in (text_of(driver, "summary") or ""), 15
            )  # the stream is up: the snapshot reached the page
            assert driver.execute_script("return document.cookie") == ""  # HttpOnly: scripts cannot read it
            WebDriverWait(driver, 15).until(expected_conditions.element_to_be_clickable((By.ID, "logout"))).click()
            assert wait_for(lambda: driver.current_url.endswith("/login"), 15)
            driver.get(url)
            assert driver.current_url.endswith("/login")
        finally:
            station.stop()


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not Path(CHROMEDRIVER).exists() or not shutil.which("chromium"),
    reason="Debian's chromium and chromium-driver are not installed",
)
def test_a_browser_on_a_rebound_name_gets_no_page(tmp_path):
    """Chromium resolves evil.example to 127.0.0.1 (what a rebinding DNS server does): the station refuses it."""
    driver = chromium("--host-resolver-rules=MAP evil.example 127.0.0.1")
    with run_mosquitto() as broker:
        station = StationProc(tmp_path, broker.port)
        try:
            driver.get(f"http://evil.example:{station.port}/")
            assert "is not this station's name" in driver.execute_script("return document.body.innerText")
            assert "edgerun ground station" not in driver.title
            driver.get(f"http://127.0.0.1:{station.port}/")  # the same browser on the station's own address
            assert wait_for(lambda: driver.title == "edgerun ground station", 15)
        finally:
            station.stop()
            driver.quit()

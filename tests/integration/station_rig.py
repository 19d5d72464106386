"""What the station's integration tests share: the station as a real process, headless Chromium (Debian's) and
its login, a webhook receiver on loopback, a private PostgreSQL, and a publisher of retained fleet messages.

One place for each, so a change to how the station starts or how a page logs in is made once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from edgerun.testing.ports import free_port
from tests.integration.brokers import python_env, wait_for

CHROMEDRIVER = "/usr/bin/chromedriver"
PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None)
needs_chromium = pytest.mark.skipif(
    not Path(CHROMEDRIVER).exists() or not shutil.which("chromium"),
    reason="Debian's chromium and chromium-driver are not installed",
)
needs_postgresql = pytest.mark.skipif(
    PG_BIN is None or not (PG_BIN / "initdb").exists(), reason="Debian's postgresql is not installed"
)


class StationProcess:
    """``edgerun station`` as a process on the test's broker, on a free loopback port (or ``port``: a restart on
    the same address), ready once its API answers; its output in ``<name>.log`` under ``tmp``."""

    def __init__(
        self,
        tmp: Path,
        broker_port: int,
        *extra: str,
        db: str | Path | None = None,
        name: str = "station",
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        cmd = [
            sys.executable, "-m", "edgerun", "station", "--mqtt", f"127.0.0.1:{broker_port}",
            "--bind", f"127.0.0.1:{self.port}", "--stale-s", "4", *(("--db", str(db)) if db is not None else ()),
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log_path.open("a"), stderr=subprocess.STDOUT, env=python_env())
        if not wait_for(self._answers, timeout=60) or self.proc.poll() is not None:
            self.kill()
            raise AssertionError(f"the station never answered:\n{self.log()}")

    def _answers(self) -> bool:
        try:
            self.snapshot()
            return True
        except OSError:
            return self.proc.poll() is not None  # it exited: no point waiting (the caller sees the log)

    def snapshot(self) -> dict[str, Any]:
        """``GET /api/snapshot`` (a loopback station without --users, or with --public-view: reads need no login)."""
        with urllib.request.urlopen(self.url + "/api/snapshot", timeout=5) as r:
            return json.loads(r.read())

    def wait_connected(self, timeout: float = 30.0) -> None:
        """Until the station says it is connected to the broker (its API answers before that)."""
        connected = lambda: bool((self.snapshot().get("broker") or {}).get("connected"))  # noqa: E731
        assert wait_for(connected, timeout, 0.25), self.log()

    def states(self) -> dict[str, str]:
        return {k: n["state"] for k, n in self.snapshot()["nodes"].items()}

    def stop(self) -> None:
        """A clean stop (SIGTERM): the station flushes its store."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]


def chromium(*args: str, size: tuple[int, int] = (1400, 1000)) -> Any:
    """Debian's headless Chromium through its chromedriver; ``args`` are more command-line switches."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args):
        options.add_argument(arg)
    options.add_argument(f"--window-size={size[0]},{size[1]}")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = chromium(size=(1600, 1200))
    try:
        yield driver
    finally:
        driver.quit()


def submit_login(driver: Any, user: str, password: str) -> None:
    """Fill and send the login form, then wait until the station's answer has replaced the form's page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    form = driver.find_element(By.ID, "login")
    driver.find_element(By.ID, "user").send_keys(user)
    driver.find_element(By.ID, "password").send_keys(password)
    driver.find_element(By.ID, "login-submit").click()
    WebDriverWait(driver, 30).until(expected_conditions.staleness_of(form))  # held only to see it go


def log_in(driver: Any, url: str, user: str, password: str) -> None:
    """Open the station's login page, log in, and wait until the page says who is logged in."""
    driver.get(url + "/login")
    submit_login(driver, user, password)
    assert wait_for(
        lambda: driver.execute_script("return document.getElementById('who').textContent") == f"operator {user}", 30
    ), driver.page_source[:2000]


def post_ack(station_url: str, object_id: str) -> dict[str, Any]:
    """Acknowledge an alert as the page does (a loopback station without --users: this machine's operator may)."""
    request = urllib.request.Request(
        f"{station_url}/api/alerts/{object_id}/ack", method="POST", data=b"", headers={"X-Edgerun-Confirm": object_id}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


class HookReceiver:
    """A webhook receiver on loopback: 503 to the first ``fail_first`` POSTs (changeable while it runs), then 204;
    it keeps every body with the status it answered."""

    def __init__(self, fail_first: int = 0) -> None:
        self.posts: list[tuple[int, dict[str, Any]]] = []
        self.fail_first = fail_first
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                with receiver.lock:
                    status = 503 if len(receiver.posts) < receiver.fail_first else 204
                    receiver.posts.append((status, body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> list[dict[str, Any]]:
        """The bodies it answered 204 to, in order."""
        with self.lock:
            return [body for status, body in self.posts if status == 204]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def postgres_server() -> Iterator[str]:
    """A private PostgreSQL (Debian's) on a free loopback port, its socket and data in a temporary directory,
    run as ``nobody`` (postgres refuses root); stopped and removed afterwards. Yields a postgresql:// URL.

    The directory is made under the system's temp dir, not pytest's tmp_path: that one sits under a 0700
    directory of root's that ``nobody`` cannot enter."""
    assert PG_BIN is not None
    port = free_port()
    root = Path(tempfile.mkdtemp(prefix="edgerun-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "nobody")
        as_user = ["runuser", "-u", "nobody", "--"]
    data, log = root / "data", root / "server.log"

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120, cwd=root)

    try:
        run(str(PG_BIN / "initdb"), "-D", str(data), "-U", "edgerun", "--auth=trust", "-E", "UTF8", "--no-sync")
        run(
            str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "start",
            "-o", f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off",
        )  # fmt: skip
        try:
            run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "edgerun", "mission")
            yield f"postgresql://edgerun@127.0.0.1:{port}/mission"
        finally:
            run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def publish_until(
    port: int, messages: list[tuple[str, bytes, dict[str, str]]], done: Callable[[], bool], rounds: int = 3
) -> bool:
    """Publish (not retained) until ``done``, at most ``rounds`` times, 10 s apart: a station subscribes a moment
    after it says it is connected, and a message published in between never reaches it. For messages the
    station takes once however often they come (the same fleet object report, the same event payload)."""
    for _ in range(rounds):
        publish(port, messages, retain=False)
        if wait_for(done, 10, 0.25):
            return True
    return False


def publish(port: int, messages: list[tuple[str, bytes, dict[str, str]]], retain: bool = True) -> None:
    """QoS 1 messages (retained unless told) with MQTT 5 user properties, from one short-lived client standing in
    for the fleet's nodes."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from edgerun.mqtt_client import connect_blocking, new_client

    client = new_client(id_prefix="test-fleet-producer")
    connect_blocking(client, "127.0.0.1", port)
    try:
        for topic, payload, user in messages:
            props = Properties(PacketTypes.PUBLISH)
            if user:
                props.UserProperty = list(user.items())
            client.publish(topic, payload, qos=1, retain=retain, properties=props).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()

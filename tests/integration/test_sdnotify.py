"""The notify protocol against a real unix datagram socket, and the progress-aware Watchdog."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from edgerun.service.health import Health
from edgerun.service.sdnotify import SdNotifier, Watchdog

# Fails any test here that leaves a thread running (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_thread_left_behind")


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound unix datagram socket standing in for systemd; yields (socket, NOTIFY_SOCKET value)."""
    path = str(tmp_path / "notify.sock")
    if len(path) >= 100:  # sun_path is 108 bytes; deep pytest temp dirs can exceed it
        path = os.path.join(tempfile.mkdtemp(prefix="sdn"), "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    try:
        yield sock, path
    finally:
        sock.close()


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram waiting on the socket, without blocking."""
    got: list[bytes] = []
    sock.setblocking(False)
    try:
        while True:
            got.append(sock.recv(4096))
    except BlockingIOError:
        return got
    finally:
        sock.settimeout(2.0)


def test_messages_arrive(receiver, monkeypatch) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = SdNotifier()
    assert notifier.enabled
    try:
        assert notifier.ready()
        assert sock.recv(4096) == b"READY=1"
        assert notifier.status("running, 14.9 fps")
        assert sock.recv(4096) == b"STATUS=running, 14.9 fps"
        assert notifier.status("two\nlines")
        assert sock.recv(4096) == b"STATUS=two lines"  # a newline would start a new field
        assert notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert notifier.stopping()
        assert sock.recv(4096) == b"STOPPING=1"
        assert notifier.notify(READY=1, status="up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    finally:
        notifier.close()
    assert notifier.send_errors == 0


def test_abstract_socket() -> None:
    name = f"edgerun-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    notifier = SdNotifier(env={"NOTIFY_SOCKET": "@" + name})
    try:
        assert notifier.ready()
        assert sock.recv(4096) == b"READY=1"
        assert notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
    finally:
        notifier.close()
        sock.close()


def test_unset_is_a_no_op(monkeypatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = SdNotifier()
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.send_errors == 0


def test_send_errors_are_logged_once_then_counted(tmp_path: Path, caplog) -> None:
    notifier = SdNotifier(env={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    with caplog.at_level(logging.WARNING, logger="edgerun.service.sdnotify"):
        for _ in range(3):
            assert notifier.watchdog() is False
    notifier.close()
    assert notifier.send_errors == 3
    assert len(caplog.records) == 1
    assert "nobody-listens.sock" in caplog.records[0].getMessage()


def test_watchdog_interval() -> None:
    pid = str(os.getpid())
    assert SdNotifier(env={}).watchdog_interval() is None
    assert SdNotifier(env={"WATCHDOG_USEC": "10000000"}).watchdog_interval() == 10.0
    assert SdNotifier(env={"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": pid}).watchdog_interval() == 10.0
    assert SdNotifier(env={"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}).watchdog_interval() is None
    assert SdNotifier(env={"WATCHDOG_USEC": "ten"}).watchdog_interval() is None
    assert SdNotifier(env={"WATCHDOG_USEC": "0"}).watchdog_interval() is None


def test_watchdog_period_is_half_the_systemd_interval() -> None:
    health = Health()
    with_systemd = Watchdog(
        SdNotifier(env={"WATCHDOG_USEC": "10000000"}), last_progress=time.monotonic, stall_s=5.0, health=health
    )
    assert with_systemd.period_s == 5.0
    without = Watchdog(SdNotifier(env={}), last_progress=time.monotonic, stall_s=5.0, health=health)
    assert without.period_s == 1.0


async def wait_for(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def collect(sock: socket.socket, count: int, timeout: float = 2.0) -> list[bytes]:
    """At least ``count`` datagrams, gathered without blocking the loop the watchdog runs on."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} datagrams arrived"
        got.extend(drain(sock))
        await asyncio.sleep(0.01)
    return got


def test_watchdog_pings_only_while_frames_flow(receiver) -> None:
    sock, path = receiver

    async def main() -> None:
        # WATCHDOG_USEC of 0.1 s: a tick every 0.05 s, as systemd's half-interval rule gives.
        notifier = SdNotifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
        health = Health(notify=asyncio.get_running_loop().call_soon_threadsafe)
        health.mark_running()
        last = [time.monotonic()]
        flowing = [True]

        async def frames() -> None:
            while True:
                if flowing[0]:
                    last[0] = time.monotonic()
                await asyncio.sleep(0.01)

        watchdog = Watchdog(
            notifier,
            last_progress=lambda: last[0],
            stall_s=0.25,
            health=health,
            status_text=lambda: "running, 14.9 fps",
        )
        tasks = [asyncio.create_task(frames()), asyncio.create_task(watchdog.run())]
        try:
            got = await collect(sock, 3)
            assert all(d == b"WATCHDOG=1\nSTATUS=running, 14.9 fps" for d in got)
            assert "pipeline" not in health.reasons

            flowing[0] = False  # the pipeline hangs
            await wait_for(lambda: "pipeline" in health.reasons)
            assert health.state == "degraded"
            assert health.reasons["pipeline"].startswith("no frame inferred for ")
            drain(sock)  # up to and including the tick that found the stall
            stalled = await collect(sock, 3)
            assert all(d == b"STATUS=running, 14.9 fps" for d in stalled)  # status goes on, pings stop

            flowing[0] = True  # frames resume
            await wait_for(lambda: "pipeline" not in health.reasons)
            assert health.state == "running"
            resumed = await collect(sock, 2)
            assert resumed[-1] == b"WATCHDOG=1\nSTATUS=running, 14.9 fps"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            notifier.close()

    asyncio.run(main())


def test_excused_stall_keeps_pinging(receiver) -> None:
    sock, path = receiver
    health = Health()
    health.mark_running()
    health.set_problem("source", "camera /dev/video0 gone, reopening")
    notifier = SdNotifier(env={"NOTIFY_SOCKET": path})
    stale = time.monotonic() - 60.0
    watchdog = Watchdog(
        notifier,
        last_progress=lambda: stale,
        stall_s=5.0,
        health=health,
        stall_excused=lambda: "source" in health.reasons,
    )
    watchdog.tick()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert health.reasons["pipeline"].startswith("no frame inferred for 60")
    health.clear_problem("source")  # reopened, yet still no frames: a real hang
    watchdog.tick()
    assert drain(sock) == []
    notifier.close()


def test_stall_keeps_a_more_specific_pipeline_reason(receiver) -> None:
    sock, path = receiver
    health = Health()
    health.mark_running()
    health.set_problem("pipeline", "infer stage crashed")
    notifier = SdNotifier(env={"NOTIFY_SOCKET": path})
    stale = [time.monotonic() - 60.0]
    watchdog = Watchdog(notifier, last_progress=lambda: stale[0], stall_s=5.0, health=health)
    watchdog.tick()
    assert health.reasons == {"pipeline": "infer stage crashed"}
    assert drain(sock) == []
    stale[0] = time.monotonic()  # frames flow again: the pipeline is fine whatever the cause was
    watchdog.tick()
    assert health.reasons == {}
    assert sock.recv(4096) == b"WATCHDOG=1"
    notifier.close()


def test_watchdog_stops_pinging_when_its_check_fails(receiver, caplog) -> None:
    sock, path = receiver
    notifier = SdNotifier(env={"NOTIFY_SOCKET": path})

    def broken() -> float:
        raise RuntimeError("stats gone")

    watchdog = Watchdog(notifier, last_progress=broken, stall_s=1.0, health=Health(), period_s=0.01)
    with caplog.at_level(logging.ERROR, logger="edgerun.service.sdnotify"):
        asyncio.run(asyncio.wait_for(watchdog.run(), 2.0))  # returns instead of pinging on
    assert drain(sock) == []
    assert "no more watchdog pings" in caplog.records[0].getMessage()
    notifier.close()

"""The updater never blocks or balloons: FIFOs on the release medium, trickling HTTP sources, tar.gz bombs.

Real parts only: a real FIFO (os.mkfifo) in the watch directory, a real HTTP server on 127.0.0.1 that
trickles bytes, real tar.gz files with tens of MB of zeros, the real store and updater.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import os
import socket
import tarfile
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path

import pytest

from edgerun.config import parse_config
from edgerun.errors import ConfigError
from edgerun.ota.errors import Rejected
from edgerun.ota.payload import check_unpacked_size, pack_bundle, sha256_bytes
from edgerun.ota.store import ModelStore
from edgerun.ota.transport import RateLimiter, TransportError
from edgerun.ota.transport_dir import DirectoryTransport
from edgerun.ota.transport_http import HttpTransport
from tests.unit.test_ota_rejections import Rig, raw_release, snapshot
from tests.unit.test_ota_release import head_variant

# Every call below must be done long before this; on a blocking implementation a helper thread unblocks the
# FIFO at this point, so a regression fails the test instead of hanging it.
UNBLOCK_AFTER_S = 8.0

# ---------------------------------------------------------------- 1. a FIFO in the watch directory


@contextlib.contextmanager
def fifo_unblocker(path: Path) -> Iterator[None]:
    """After UNBLOCK_AFTER_S, open the FIFO for writing a few times so any reader stuck in open() returns."""
    stop = threading.Event()

    def run() -> None:
        if stop.wait(UNBLOCK_AFTER_S):
            return
        for _ in range(20):
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            if stop.wait(0.2):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


async def _with_ticker(coro: Awaitable[object]) -> tuple[object, int, float]:
    """Run ``coro`` beside a 10 ms ticker; returns (result or exception, ticks, seconds)."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    t0 = time.monotonic()
    try:
        result: object = await coro
    except Exception as err:  # the test inspects it
        result = err
    await asyncio.sleep(0.05)  # the ticker must still run after the call, too
    ticker.cancel()
    return result, ticks, time.monotonic() - t0


def test_fifo_manifest_is_refused_without_blocking(tmp_path):
    model = tmp_path / "watch" / "m"
    model.mkdir(parents=True)
    os.mkfifo(model / "manifest.json")
    transport = DirectoryTransport(tmp_path / "watch")
    with fifo_unblocker(model / "manifest.json"):
        result, ticks, seconds = asyncio.run(_with_ticker(transport.poll("m")))
    assert isinstance(result, TransportError), result
    assert str(result) == f"{model / 'manifest.json'}: is a FIFO; only regular files are read"
    assert seconds < UNBLOCK_AFTER_S and ticks >= 3


def test_fifo_payload_is_refused_without_blocking_the_loop(tmp_path):
    model = tmp_path / "watch" / "m"
    model.mkdir(parents=True)
    os.mkfifo(model / "payload.tar")
    transport = DirectoryTransport(tmp_path / "watch")
    dest = tmp_path / "staging.part"
    with fifo_unblocker(model / "payload.tar"):
        result, ticks, seconds = asyncio.run(
            _with_ticker(transport.fetch("m", "payload.tar", 1000, dest, RateLimiter(0)))
        )
    assert isinstance(result, TransportError), result
    assert "payload.tar: is a FIFO; only regular files are read" in str(result)
    assert "\n" not in str(result)
    assert seconds < UNBLOCK_AFTER_S and ticks >= 3


def test_symlinked_manifest_is_refused(tmp_path):
    model = tmp_path / "watch" / "m"
    model.mkdir(parents=True)
    (tmp_path / "elsewhere.json").write_text("{}")
    (model / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(TransportError, match="manifest.json: is a symbolic link; only regular files are read"):
        asyncio.run(DirectoryTransport(tmp_path / "watch").poll("m"))


def test_regular_files_still_fetch_and_resume(tmp_path):
    model = tmp_path / "watch" / "m"
    model.mkdir(parents=True)
    data = os.urandom(600_000)
    (model / "payload.tar").write_bytes(data)
    dest = tmp_path / "staging.part"
    dest.write_bytes(data[:1000])  # a partial download from an earlier attempt
    asyncio.run(DirectoryTransport(tmp_path / "watch").fetch("m", "payload.tar", len(data), dest, RateLimiter(0)))
    assert dest.read_bytes() == data


# ---------------------------------------------------------------- 2. a trickling HTTP source


class TrickleServer:
    """HTTP/1.1 on 127.0.0.1 (a free port) that answers every GET with a big Content-Length and 1 byte per tick."""

    def __init__(self, length: int = 1_000_000, tick_s: float = 0.2) -> None:
        self.length, self.tick_s = length, tick_s
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.requests += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request head
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    + f"Content-Length: {self.length}\r\n\r\n".encode()
                )
                while not self.stop.wait(self.tick_s):
                    conn.sendall(b"x")

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for thread in self.threads:
            thread.join(5)


@pytest.fixture
def trickle() -> Iterator[TrickleServer]:
    server = TrickleServer()
    yield server
    server.close()


async def _fetch(transport: HttpTransport, dest: Path, size: int) -> object:
    try:
        return await transport.fetch("m", "payload.tar", size, dest, RateLimiter(0))
    finally:
        await transport.close()


def test_http_trickle_below_the_minimum_rate_is_cut_off(tmp_path, trickle):
    transport = HttpTransport(trickle.url, min_rate_bps=100, rate_window_s=1.0, deadline_slack_s=60.0)
    result, ticks, seconds = asyncio.run(_with_ticker(_fetch(transport, tmp_path / "p.part", trickle.length)))
    assert isinstance(result, TransportError), result
    message = str(result)
    assert message.startswith(f"{trickle.url}/m/payload.tar: ") and "\n" not in message
    assert "B/s over the last" in message and "below the minimum 100 B/s" in message, message
    assert f"of {trickle.length} bytes" in message
    assert seconds < 30 and ticks >= 3
    assert trickle.requests == 1  # a trickle is not retried: it would only hold the updater longer


def test_http_download_past_its_deadline_is_cut_off(tmp_path, trickle):
    # No minimum rate: only the overall deadline (slack + size / min rate, here slack alone) stops it.
    transport = HttpTransport(trickle.url, min_rate_bps=0, rate_window_s=1.0, deadline_slack_s=1.5)
    result, _ticks, seconds = asyncio.run(_with_ticker(_fetch(transport, tmp_path / "p.part", trickle.length)))
    assert isinstance(result, TransportError), result
    assert "not done after the 2 s deadline" in str(result) and f"of {trickle.length} bytes" in str(result)
    assert seconds < 30
    assert (tmp_path / "p.part").exists()  # what arrived stays in staging for the next attempt to resume


def test_http_trickling_metadata_is_cut_off(trickle):
    transport = HttpTransport(trickle.url, min_rate_bps=100, rate_window_s=1.0)

    async def poll() -> object:
        try:
            return await transport.poll("m")
        finally:
            await transport.close()

    result, _ticks, seconds = asyncio.run(_with_ticker(poll()))
    assert isinstance(result, TransportError), result
    assert "manifest.json: " in str(result) and "below the minimum 100 B/s" in str(result)
    assert seconds < 30


# ---------------------------------------------------------------- 3. a tar.gz bomb


def bomb(bundle_dir: Path, zeros: int) -> bytes:
    """A valid bundle plus one member of ``zeros`` zero bytes, gzipped (a few KB per 10 MB of zeros)."""
    plain = io.BytesIO(pack_bundle(bundle_dir))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        with tarfile.open(fileobj=plain) as src:
            for member in src.getmembers():
                tar.addfile(member, src.extractfile(member))
        member = tarfile.TarInfo("padding.bin")
        member.size = zeros

        class Zeros(io.RawIOBase):
            left = zeros

            def readable(self) -> bool:
                return True

            def readinto(self, b: memoryview) -> int:  # type: ignore[override]  # narrower than the buffer protocol
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(member, io.BufferedReader(Zeros()))
    return out.getvalue()


@pytest.fixture(scope="module")
def v2(tmp_path_factory, blazeface_bundle):
    return head_variant(blazeface_bundle, tmp_path_factory.mktemp("bomb") / "v2", 2)


def test_tar_gz_bomb_is_rejected_before_staging_or_the_slot(tmp_path, blazeface_bundle, v2):
    payload = bomb(v2.root, 64 << 20)
    assert len(payload) < 400_000  # 64 MiB of zeros in a few hundred KB: the signed size bounds only this
    rig = Rig(tmp_path, blazeface_bundle, max_unpacked_bytes=16 << 20)
    rig.trust_keys()
    raw_release(rig, "blazeface_short", 2, payload)
    before = snapshot(rig.state)
    assert rig.poll() == "rejected:oversized"
    reason = rig.last["reason"]
    assert reason == f"payload: its files declare more than {16 << 20} bytes (ota.max_unpacked_bytes = {16 << 20})"
    assert rig.last["final"] is True
    assert snapshot(rig.state) == before  # nothing in the slots
    assert not any(rig.updater.store.staging.iterdir())  # nor left in staging
    assert rig.updater.store.installed().version == 1


def test_store_refuses_a_bomb_and_leaves_no_partial_slot(tmp_path, blazeface_bundle, v2):
    store = ModelStore(tmp_path / "state", max_unpacked_bytes=16 << 20)
    store.provision(blazeface_bundle, pack_bundle(blazeface_bundle.root))
    payload = bomb(v2.root, 64 << 20)
    with pytest.raises(Rejected) as err:
        store.write_slot("b", payload, sha256_bytes(payload))
    assert err.value.code == "oversized" and "ota.max_unpacked_bytes" in str(err.value)
    assert sorted(p.name for p in store.slots.iterdir()) == ["a"]
    # Under the cap the same kind of tar.gz installs: the cap, not the compression, decides.
    ok = bomb(v2.root, 1 << 20)
    store.write_slot("b", ok, sha256_bytes(ok))
    assert (store.slot_dir("b") / "payload.tar").read_bytes() == ok


def test_members_adding_up_past_the_cap_are_refused():
    # Each member is under the cap; the running total stops the scan at the fourth.
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for i in range(4):
            member = tarfile.TarInfo(f"part{i}.bin")
            member.size = 3 << 20
            tar.addfile(member, io.BytesIO(bytes(member.size)))
    with pytest.raises(Rejected, match=r"declare more than 10485760 bytes \(ota.max_unpacked_bytes = 10485760\)"):
        check_unpacked_size(data.getvalue(), 10 << 20)
    check_unpacked_size(data.getvalue(), 12 << 20)


def test_huge_extended_header_is_refused_before_it_is_read():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        member = tarfile.TarInfo("model.toml")
        member.pax_headers = {"comment": "x" * (8 << 20)}
        tar.addfile(member, io.BytesIO(b""))
    with pytest.raises(Rejected, match="an extended tar header of .* bytes"):
        check_unpacked_size(out.getvalue(), 1 << 30)


def test_junk_payload_is_one_clear_line():
    for junk in (b"not a tar at all" * 100, gzip.compress(b"not a tar" * 100)):
        with pytest.raises(Rejected) as err:
            check_unpacked_size(junk, 1 << 30)
        assert err.value.code == "bad_bundle" and "\n" not in str(err.value), str(err.value)


def test_max_unpacked_bytes_is_validated_by_key():
    assert parse_config({}).ota.max_unpacked_bytes == 1 << 30
    with pytest.raises(ConfigError, match="ota.max_unpacked_bytes"):
        parse_config({"ota": {"max_unpacked_bytes": 0}})

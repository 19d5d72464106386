"""Unauthenticated TCP peers share one small buffer budget: they cannot grow a swarm member's memory.

Real sockets on 127.0.0.1 (ports picked free at run time): raw connections that declare large frames and
trickle bytes, against a SwarmTransport in this process (its own accounting) and a ``python -m swarm.agent``
process (its RSS), while an authenticated peer keeps getting answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from swarm.keyring import Keyring, generate_key
from swarm.transport import CONNECTION_COST, UNAUTH_BUDGET_BYTES, SwarmTransport

REPO = Path(__file__).resolve().parents[2]
ATTACKERS = 25

pytestmark = pytest.mark.timeout(120)


def _run(main: Callable[[], Coroutine[Any, Any, None]], loop: str) -> None:
    """Run on asyncio's loop or on uvloop (what a node runs on when it is installed)."""
    if loop == "uvloop":
        pytest.importorskip("uvloop").run(main())
    else:
        asyncio.run(main())


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def _attacker(addr: tuple[str, int], declared: int, stop: asyncio.Event, closed: list[int]) -> None:
    """Declare a ``declared``-byte frame, then trickle a byte every 50 ms until stopped or closed."""
    reader, writer = await asyncio.open_connection(*addr)
    try:
        writer.write(declared.to_bytes(4, "big"))
        await writer.drain()
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(reader.read(1), 0.05) == b"":
                    closed.append(1)  # the member closed us: over budget
                    return
            writer.write(b"x")
            await writer.drain()
    except (ConnectionError, OSError):
        closed.append(1)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@LOOPS
def test_trickling_unauthenticated_peers_share_one_budget_and_a_member_still_answers(loop):
    async def main() -> None:
        key = generate_key()
        a = SwarmTransport("a", Keyring([key]))
        b = SwarmTransport("b", Keyring([key]), tcp_timeout_s=30.0)
        b.on_stream = lambda sender, body, addr: b"state of b for " + body
        await a.start(("127.0.0.1", 0))
        addr = await b.start(("127.0.0.1", 0))
        stop, closed = asyncio.Event(), []
        declared = 150 * 1024  # each fits the budget alone; six of them together nearly fill it
        attackers = [asyncio.create_task(_attacker(addr, declared, stop, closed)) for _ in range(ATTACKERS)]
        try:
            admitted = UNAUTH_BUDGET_BYTES // (declared + CONNECTION_COST)
            refused = ATTACKERS - admitted
            await _until(lambda: b.dropped["unauth_budget"] == refused and len(closed) == refused)
            assert b.unauth.buffered == admitted * (declared + CONNECTION_COST) <= UNAUTH_BUDGET_BYTES
            # While the admitted ones still hold their share, an authenticated peer is answered.
            assert await a.request(addr, b"push-pull", timeout_s=5.0) == b"state of b for push-pull"
            assert b.counters["streams_in"] == 1
            assert b.unauth.peak <= UNAUTH_BUDGET_BYTES
        finally:
            stop.set()
            await asyncio.gather(*attackers)
        await _until(lambda: b.unauth.buffered == 0)  # the attackers left: their share is back
        assert b.counters["stream_failures"] == admitted  # they left in the middle of their frames
        await a.close()
        await b.close()

    _run(main, loop)


@LOOPS
def test_a_declared_length_over_the_budget_is_closed_before_its_body_is_read(loop):
    async def main() -> None:
        b = SwarmTransport("b", Keyring([generate_key()]))
        addr = await b.start(("127.0.0.1", 0))
        stop, closed = asyncio.Event(), []
        big = b.max_stream_bytes - 1  # allowed for an authenticated frame, above what strangers may hold
        attackers = [asyncio.create_task(_attacker(addr, big, stop, closed)) for _ in range(ATTACKERS)]
        await _until(lambda: len(closed) == ATTACKERS)
        stop.set()
        await asyncio.gather(*attackers)
        assert b.dropped["unauth_budget"] == ATTACKERS
        assert b.unauth.peak <= ATTACKERS * CONNECTION_COST
        await _until(lambda: b.unauth.buffered == 0)
        await b.close()

    _run(main, loop)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _flood(addr: tuple[str, int], size: int) -> None:
    """Declare ``size`` bytes and send them as fast as the member takes them; keep the socket open a while."""
    try:
        reader, writer = await asyncio.open_connection(*addr)
    except OSError:
        return
    try:
        writer.write(size.to_bytes(4, "big"))
        for _ in range(size // 65536):
            writer.write(bytes(65536))
            await asyncio.wait_for(writer.drain(), 5)
        await asyncio.wait_for(reader.read(1), 2)
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_agent_process_memory_stays_flat_under_unauthenticated_floods(tmp_path):
    async def main() -> None:
        key_file = tmp_path / "swarm.key"
        Keyring([generate_key()]).save(key_file)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "swarm.agent",
            "--name",
            "n0",
            "--bind",
            "127.0.0.1:0",
            "--key",
            str(key_file),
            "--timing",
            json.dumps({"tcp_timeout_s": 10.0}),
            stdout=asyncio.subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        assert proc.stdout is not None
        try:
            ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
            addr = (ready["addr"][0], ready["addr"][1])
            await asyncio.sleep(0.5)
            before = _rss_kib(proc.pid)
            # The reported attack: 25 parallel strangers, each declaring and sending ~4 MiB.
            await asyncio.gather(*(_flood(addr, 4 * 1024 * 1024 - 1) for _ in range(ATTACKERS)))
            after = _rss_kib(proc.pid)
            proc.send_signal(signal.SIGUSR1)
            stats = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
            print(
                f"agent RSS {before} KiB -> {after} KiB; stats dropped={stats['dropped']}"
                f" unauth_buffered_peak={stats['unauth_buffered_peak']}"
            )
            assert stats["dropped"].get("unauth_budget") == ATTACKERS
            assert stats["unauth_buffered_peak"] <= UNAUTH_BUDGET_BYTES
            assert after - before < 20 * 1024, (before, after)  # was ~+116 MiB when each stranger got 4 MiB
        finally:
            proc.terminate()
            await proc.wait()

    asyncio.run(main())

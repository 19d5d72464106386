"""Five real ``python -m swarm.agent`` processes over UDP/TCP on loopback, with shrunk protocol timers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.agent import SwarmAgent
from swarm.config import SwarmTiming
from swarm.keyring import Keyring, generate_key
from swarm.membership import MemberEvent, MemberState, UserBroadcast

REPO = Path(__file__).resolve().parents[2]
# memberlist's LAN timing scaled down about 5x so the test runs in seconds.
FAST = {
    "probe_interval_s": 0.2,
    "probe_timeout_s": 0.1,
    "gossip_interval_s": 0.05,
    "suspicion_mult": 3,
    "push_pull_interval_s": 2.0,
    "join_retry_s": 0.3,
    "tcp_timeout_s": 1.0,
    "gossip_to_the_dead_s": 5.0,
}

pytestmark = pytest.mark.timeout(180)


class Agent:
    """One member process; its JSON lines are read as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: asyncio.subprocess.Process | None = None
        self.address: tuple[str, int] | None = None
        self.records: list[dict] = []
        self.reader: asyncio.Task | None = None

    async def start(self, key_file: Path, seeds: list[tuple[str, int]], port: int = 0) -> None:
        argv = [
            sys.executable,
            "-m",
            "swarm.agent",
            "--name",
            self.name,
            "--bind",
            f"127.0.0.1:{port}",
            "--key",
            str(key_file),
            "--timing",
            json.dumps(FAST),
        ]
        for host, seed_port in seeds:
            argv += ["--seed", f"{host}:{seed_port}"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.records = []
        self.proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, env=env, cwd=REPO)
        self.reader = asyncio.get_running_loop().create_task(self._read())
        await until(lambda: any(r["ev"] == "ready" for r in self.records), 20)
        ready = next(r for r in self.records if r["ev"] == "ready")
        self.address = (ready["addr"][0], ready["addr"][1])

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.records.append(json.loads(line))

    def view(self) -> dict[str, tuple[str, int]]:
        """member -> (last event kind, incarnation) as this agent saw it."""
        seen: dict[str, tuple[str, int]] = {}
        for r in self.records:
            if r["ev"] == "member" and r["member"] != self.name:
                seen[r["member"]] = (r["kind"], r["incarnation"])
        return seen

    def alive(self) -> set[str]:
        return {name for name, (kind, _) in self.view().items() if kind not in ("dead", "leave")}

    def dead(self) -> set[str]:
        return {r["member"] for r in self.records if r["ev"] == "member" and r["kind"] == "dead"}

    async def stats(self) -> dict:
        assert self.proc is not None
        count = sum(r["ev"] == "stats" for r in self.records)
        self.proc.send_signal(signal.SIGUSR1)
        await until(lambda: sum(r["ev"] == "stats" for r in self.records) > count, 10)
        return [r for r in self.records if r["ev"] == "stats"][-1]

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)


async def until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_five_agents_converge_detect_a_kill_and_take_back_a_restart(tmp_path):
    key_file = tmp_path / "swarm.key"
    Keyring([generate_key()]).save(key_file)

    async def scenario() -> None:
        agents = [Agent(f"n{i}") for i in range(5)]
        try:
            await agents[0].start(key_file, [])
            for agent in agents[1:]:
                await agent.start(key_file, [agents[0].address])
            names = {a.name for a in agents}
            await until(lambda: all(a.alive() == names - {a.name} for a in agents), 30)

            victim, observers = agents[4], agents[:4]
            incarnation_before = max(o.view()[victim.name][1] for o in observers)
            port = victim.address[1]
            await victim.kill()
            await until(lambda: all(victim.name in o.dead() for o in observers), 30)
            assert all(o.dead() == {victim.name} for o in observers)  # nobody else was declared dead

            await victim.start(key_file, [agents[0].address], port=port)
            await until(lambda: all(victim.name in o.alive() for o in observers), 30)
            for observer in observers:
                kind, incarnation = observer.view()[victim.name]
                assert incarnation > incarnation_before, (observer.name, kind, incarnation, incarnation_before)
            await until(lambda: victim.alive() == names - {victim.name}, 30)
        finally:
            for agent in agents:
                await agent.kill()

    asyncio.run(scenario())


def test_replayed_and_forged_packets_to_a_running_agent_are_dropped_and_counted(tmp_path):
    key_file = tmp_path / "swarm.key"
    Keyring([generate_key()]).save(key_file)

    async def scenario() -> None:
        agent = Agent("n0")
        try:
            await agent.start(key_file, [])
            before = (await agent.stats())["dropped"]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                # Sealed under the swarm key (opens fine), then sent a second time: the copy is a replay.
                recorded = Keyring.load(key_file).seal("intruder", b"\x00not a message", time.time())
                sock.sendto(recorded, agent.address)
                sock.sendto(recorded, agent.address)
                sock.sendto(Keyring([generate_key()]).seal("intruder", b"x", time.time()), agent.address)
                sock.sendto(b"\x01\x01", agent.address)

            def counted(stats: dict) -> bool:
                dropped = stats["dropped"]
                return all(dropped.get(r, 0) > before.get(r, 0) for r in ("replay", "forged", "short"))

            deadline = time.monotonic() + 10
            stats = await agent.stats()
            while not counted(stats) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                stats = await agent.stats()
            assert counted(stats), stats
            assert agent.proc is not None and agent.proc.returncode is None  # nothing raised into its loop
        finally:
            await agent.kill()

    asyncio.run(scenario())


def test_in_process_agents_broadcast_meta_rotate_keys_and_leave(no_thread_left_behind):
    """SwarmAgent on the test's own loop (no thread): app gossip, metadata, live key rotation, graceful leave."""
    timing = SwarmTiming(**FAST)

    async def scenario() -> None:
        old, new = generate_key(), generate_key()
        first = SwarmAgent("a0", ("127.0.0.1", 0), timing, Keyring([old]), meta=b"m0")
        seed = await first.start()
        agents = [first] + [SwarmAgent(f"a{i}", ("127.0.0.1", 0), timing, Keyring([old]), seeds=[seed]) for i in (1, 2)]
        events: dict[str, list] = {a.name: [] for a in agents}
        for agent in agents:
            agent.on_event(events[agent.name].append)
        stranger = SwarmAgent("x", ("127.0.0.1", 0), timing, Keyring([old]), seeds=[seed])
        try:
            for agent in agents[1:]:
                await agent.start()

            def alive(agent: SwarmAgent) -> set[str]:
                return {m.name for m in agent.members() if m.state is MemberState.ALIVE}

            await until(lambda: all(alive(a) == {"a0", "a1", "a2"} for a in agents), 20)
            # round trips over real loopback sockets, from answered direct probes
            await until(lambda: all(agents[0].rtt_ms(n) is not None for n in ("a1", "a2")), 20)
            assert all(0.0 < agents[0].rtt_ms(n) < 1000.0 for n in ("a1", "a2"))
            assert agents[0].rtt_ms("a0") is None and agents[0].stats["rtt_samples"] >= 2

            agents[1].queue_broadcast(b"claim", b"payload-1")

            def delivered(name: str, payload: bytes) -> bool:
                return any(
                    isinstance(e, UserBroadcast) and e.payload == payload and e.sender == "a1" for e in events[name]
                )

            await until(lambda: delivered("a0", b"payload-1") and delivered("a2", b"payload-1"), 20)

            agents[2].set_meta(b"m1")
            await until(lambda: any(m.name == "a2" and m.meta == b"m1" for m in agents[0].members()), 20)

            # Rotation without a flag day: install everywhere, switch primary everywhere, remove the old key.
            for step in ("install", "use", "remove"):
                for agent in agents:
                    getattr(agent.keyring, step)(new if step != "remove" else old)
                await asyncio.sleep(3 * timing.probe_interval_s)
            agents[1].queue_broadcast(b"claim", b"payload-2")
            await until(lambda: delivered("a0", b"payload-2") and delivered("a2", b"payload-2"), 20)
            assert all(a.stats["dropped"].get("forged", 0) == 0 for a in agents)
            assert all(alive(a) == {"a0", "a1", "a2"} for a in agents)

            # A member still on the removed key is shut out: its packets are forged to everyone.
            await stranger.start()
            await until(lambda: agents[0].stats["dropped"].get("forged", 0) > 0, 20)
            assert "x" not in {m.name for m in agents[0].members()}

            await agents[2].stop(leave=True)
            await until(
                lambda: any(
                    isinstance(e, MemberEvent) and e.kind == "leave" and e.member.name == "a2" for e in events["a0"]
                ),
                20,
            )
            assert agents[0].rtt_ms("a2") is None  # forgotten with the member that left
            stats = agents[0].stats
            assert stats["bytes_out"] > 0 and stats["bytes_in"] > 0
        finally:
            for agent in [*agents, stranger]:
                await agent.stop(leave=False)

    asyncio.run(scenario())


def test_agent_with_a_bad_key_file_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "swarm.key"
    bad.write_text("not-a-key\n")
    for key_file, message in ((tmp_path / "missing.key", "not found"), (bad, ":1: not a base64 key")):
        proc = subprocess.run(
            [sys.executable, "-m", "swarm.agent", "--name", "n0", "--bind", "127.0.0.1:0", "--key", str(key_file)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=30,
        )
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"swarm.agent: {key_file}") and message in lines[0]

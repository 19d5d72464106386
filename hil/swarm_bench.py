"""swarm-bench: N real member processes over UDP, one network namespace each, measured from outside; then the same
scenario with Debian's serf agents (HashiCorp memberlist, the anchor) in the same run, printed side by side.

Full membership is timed twice, on the bench's clock: ``full_membership_s`` from the moment the last member said
it is up (the protocol alone), ``full_membership_from_spawn_s`` from the first spawn (start-up included; the
members' own start-up is ``agents_up_s``, first spawn to last member up).

Scenario, the same for both: every node is impaired with ``loss`` (nftables ``numgen random`` drop on input inside
its namespace, or netem where the kernel has it); node 0 starts first and every other node joins through it. Once
all N report they are up, the bench waits for full membership (every node sees every other alive), watches a
steady phase of ``seconds`` (bytes on each node's veth and CPU of each process), SIGKILLs the last node and waits
until every other node has declared it dead. Events are read from each process's stdout as they arrive and stamped
with the bench's own monotonic clock: ``python -m swarm.agent`` prints JSON lines, serf logs ``EventMember*`` lines.

Where namespaces cannot be made (not root, no iproute2), members run on loopback with the transport's own
receive-loss injection instead; serf then runs on loopback without loss, and the output says so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgerun.testing.ports import free_tcp_udp_port
from hil import netlab
from hil.netlab import LabNode, NetLab

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SWARM_PORT = 7946
METRICS = (
    "agents_up_s",
    "full_membership_from_spawn_s",
    "full_membership_s",
    "detect_p50_s",
    "detect_max_s",
    "suspicions",
    "refutations",
    "false_deaths",
    "bytes_per_node_s",
    "cpu_percent_per_node",
)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_SERF_EVENT = re.compile(r"EventMember(Join|Failed|Leave|Update|Reap): (\S+)")
_SERF_SUSPECT = re.compile(r"memberlist: Suspect (\S+) has failed")
_SERF_REFUTE = re.compile(r"memberlist: Refuting a (suspect|dead) message")


@dataclass
class Member:
    """One member process as the bench sees it."""

    name: str
    address: tuple[str, int]
    lab_node: LabNode | None
    process: asyncio.subprocess.Process | None = None
    ready_at: float | None = None
    alive: set[str] = field(default_factory=set)
    dead_at: dict[str, float] = field(default_factory=dict)
    suspicions: int = 0
    refutations: int = 0
    final_stats: dict[str, Any] | None = None
    last_stats: dict[str, Any] | None = None
    stats_lines: int = 0
    reader: asyncio.Task[None] | None = None


@dataclass
class RunResult:
    implementation: str
    metrics: dict[str, float | int | None]
    notes: list[str]


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


class Scenario:
    """One implementation's run over a set of members; the subclass knows how to start and read them."""

    implementation = ""

    def __init__(
        self, lab: NetLab | None, nodes: list[LabNode | None], loss: float, workdir: Path, *, starve: float = 0.0
    ) -> None:
        self.lab = lab
        self.loss = loss
        self.starve = starve
        self.workdir = workdir
        self.members: list[Member] = []
        for index, lab_node in enumerate(nodes):
            address = (lab_node.ip, SWARM_PORT) if lab_node is not None else ("127.0.0.1", free_tcp_udp_port())
            self.members.append(Member(f"n{index:02d}", address, lab_node))
        self.names = {member.name for member in self.members}

    # -- subclass hooks ----------------------------------------------------------------------------------------

    def argv(self, member: Member, seed: Member | None) -> list[str]:
        raise NotImplementedError

    def on_line(self, member: Member, line: str, now: float) -> None:
        raise NotImplementedError

    async def bytes_sent(self) -> list[int | None]:
        """What each member has sent so far: its veth's kernel count in namespaces, else nothing."""
        if self.lab is None:
            return [None] * len(self.members)
        return [self.lab.link_bytes(m.lab_node)[1] if m.lab_node is not None else None for m in self.members]

    # -- running -----------------------------------------------------------------------------------------------

    async def _spawn(self, member: Member, seed: Member | None) -> None:
        argv = self.argv(member, seed)
        if self.lab is not None and member.lab_node is not None:
            argv = self.lab.command(member.lab_node, argv)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        member.process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            stdin=asyncio.subprocess.DEVNULL,
        )
        if self.lab is not None:
            self.lab.adopt(member.process.pid)
        member.reader = asyncio.get_running_loop().create_task(self._read(member))

    async def _read(self, member: Member) -> None:
        assert member.process is not None and member.process.stdout is not None
        loop = asyncio.get_running_loop()
        while True:
            raw = await member.process.stdout.readline()
            if not raw:
                return
            self.on_line(member, raw.decode("utf-8", "replace").rstrip("\n"), loop.time())

    async def _until(self, predicate: Any, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _fully_joined(self, members: list[Member]) -> bool:
        return all(member.alive >= (self.names - {member.name}) for member in members)

    async def run(self, seconds: float, join_timeout_s: float, detect_timeout_s: float) -> RunResult:
        loop = asyncio.get_running_loop()
        notes: list[str] = []
        seed = self.members[0]
        starver: asyncio.Task[None] | None = None
        try:
            first_spawn = loop.time()
            await self._spawn(seed, None)
            await self._until(lambda: seed.ready_at is not None, 20)
            for member in self.members[1:]:
                await self._spawn(member, seed)
            if not await self._until(lambda: all(m.ready_at is not None for m in self.members), 60):
                raise RuntimeError(f"{self.implementation}: not every member started")
            all_up = max(m.ready_at for m in self.members if m.ready_at is not None)
            joined = await self._until(lambda: self._fully_joined(self.members), join_timeout_s)
            # Two clocks for one moment: from the last member's "up" line (the protocol alone) and from the first
            # spawn (what an operator waits for: process start-up included, Python's and Go's alike).
            full_membership = loop.time() - all_up if joined else None
            full_from_spawn = loop.time() - first_spawn if joined else None
            if not joined:
                notes.append(f"{self.implementation}: no full membership within {join_timeout_s:.0f} s")

            if self.starve > 0:
                starved = self.members[1]
                starver = loop.create_task(self._starve(starved, self.starve))
                notes.append(
                    f"{self.implementation}: {starved.name} SIGSTOPped {self.starve * 1000:.0f} ms of "
                    "every second after full membership (CPU starvation)"
                )

            # Steady phase: link bytes and CPU of every process over the same window.
            sent0 = await self.bytes_sent()
            cpu0 = [_cpu_seconds(m.process.pid) if m.process else None for m in self.members]
            t0 = loop.time()
            await asyncio.sleep(seconds)
            elapsed = loop.time() - t0
            sent1 = await self.bytes_sent()
            cpu1 = [_cpu_seconds(m.process.pid) if m.process else None for m in self.members]
            rates = [(b - a) / elapsed for a, b in zip(sent0, sent1) if a is not None and b is not None]
            cpus = [100 * (b - a) / elapsed for a, b in zip(cpu0, cpu1) if a is not None and b is not None]
            bytes_per_node_s = statistics.fmean(rates) if rates else None

            # Failure detection: SIGKILL the last member, every other one must declare it dead.
            victim = self.members[-1]
            observers = self.members[:-1]
            assert victim.process is not None
            killed_at = loop.time()
            victim.process.send_signal(signal.SIGKILL)
            detected = await self._until(lambda: all(victim.name in o.dead_at for o in observers), detect_timeout_s)
            if not detected:
                missing = sum(victim.name not in o.dead_at for o in observers)
                notes.append(
                    f"{self.implementation}: {missing} observers did not declare {victim.name} dead "
                    f"within {detect_timeout_s:.0f} s"
                )
            delays = sorted(o.dead_at[victim.name] - killed_at for o in observers if victim.name in o.dead_at)
            # Counted before stopping: serf agents do not leave on SIGTERM, so their peers may see them fail.
            false_deaths = sum(1 for m in self.members for name in m.dead_at if name != victim.name)
            if starver is not None:
                starver.cancel()
                await asyncio.gather(starver, return_exceptions=True)
            await self._stop(observers)
            suspicions, refutations = self.protocol_counts()
            return RunResult(
                self.implementation,
                {
                    "agents_up_s": _round(all_up - first_spawn),
                    "full_membership_from_spawn_s": _round(full_from_spawn),
                    "full_membership_s": _round(full_membership),
                    "detect_p50_s": _round(statistics.median(delays)) if delays else None,
                    "detect_max_s": _round(delays[-1]) if delays and detected else None,
                    "suspicions": suspicions,
                    "refutations": refutations,
                    "false_deaths": false_deaths,
                    "bytes_per_node_s": _round(bytes_per_node_s, 1),
                    "cpu_percent_per_node": _round(statistics.fmean(cpus), 3) if cpus else None,
                },
                notes,
            )
        finally:
            if starver is not None:
                starver.cancel()
                await asyncio.gather(starver, return_exceptions=True)
            await self._kill_all()

    async def _starve(self, member: Member, share: float) -> None:
        """Stops the process ``share`` of every second: its timers fire late and its replies come late."""
        assert member.process is not None
        pid = member.process.pid
        try:
            while member.process.returncode is None:
                await asyncio.sleep(1.0 - share)
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(share)
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def protocol_counts(self) -> tuple[int, int]:
        return sum(m.suspicions for m in self.members), sum(m.refutations for m in self.members)

    async def _stop(self, members: list[Member]) -> None:
        for member in members:
            if member.process is not None and member.process.returncode is None:
                member.process.send_signal(signal.SIGTERM)
        for member in members:
            if member.process is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(member.process.wait(), 10)
            if member.reader is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(member.reader, 2)

    async def _kill_all(self) -> None:
        for member in self.members:
            if member.process is not None and member.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    member.process.kill()
                await member.process.wait()
            if member.reader is not None:
                member.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await member.reader


class EdgerunScenario(Scenario):
    implementation = "edgerun"

    def __init__(self, *args: Any, timing: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timing = timing or {}
        from swarm.keyring import Keyring, generate_key

        self.key_file = self.workdir / "swarm.key"
        Keyring([generate_key()]).save(self.key_file)

    def argv(self, member: Member, seed: Member | None) -> list[str]:
        host, port = member.address
        argv = [
            sys.executable,
            "-m",
            "swarm.agent",
            "--name",
            member.name,
            "--bind",
            f"{host}:{port}",
            "--key",
            str(self.key_file),
            "--timing",
            json.dumps(self.timing),
            "--stats-interval",
            "1",
        ]
        if seed is not None:
            argv += ["--seed", f"{seed.address[0]}:{seed.address[1]}"]
        if member.lab_node is None and self.loss > 0:
            argv += ["--loss", str(self.loss)]  # loopback: the transport's own receive loss stands in for nftables
        return argv

    async def bytes_sent(self) -> list[int | None]:
        if self.lab is not None:
            return await super().bytes_sent()
        # Loopback: no veth per member, so ask each agent for its own count of sealed bytes sent (SIGUSR1).
        before = [m.stats_lines for m in self.members]
        running = [m for m in self.members if m.process is not None and m.process.returncode is None]
        for member in running:
            assert member.process is not None  # running holds members with a live process
            member.process.send_signal(signal.SIGUSR1)
        await self._until(lambda: all(m.stats_lines > b for m, b in zip(self.members, before) if m in running), 10)
        return [int(m.last_stats["bytes_out"]) if m.last_stats and m in running else None for m in self.members]

    def on_line(self, member: Member, line: str, now: float) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            log.debug("%s: %s", member.name, line)
            return
        if not isinstance(record, dict):
            return
        ev = record.get("ev")
        if ev == "ready":
            member.ready_at = now
        elif ev == "member":
            name, kind = record.get("member"), record.get("kind")
            if not isinstance(name, str):
                return  # not an agent's member line
            if name == member.name:
                if kind == "refute":
                    member.refutations += 1
                return
            if kind in ("join", "alive", "update", "refute"):
                member.alive.add(name)
            elif kind == "suspect":
                member.suspicions += 1
            elif kind in ("dead", "leave"):
                member.alive.discard(name)
                if kind == "dead":
                    member.dead_at.setdefault(name, now)
        elif ev == "stats":
            member.last_stats = record
            member.stats_lines += 1
        elif ev == "stopped":
            member.final_stats = record

    def protocol_counts(self) -> tuple[int, int]:
        # memberlist logs "Suspect X has failed" on each failed probe: the twin is our probe_failures counter.
        stats = [m.final_stats or m.last_stats for m in self.members]
        if all(s is not None and "probe_failures" in s for s in stats):
            return (
                sum(int(s.get("probe_failures", 0)) for s in stats if s),
                sum(int(s.get("refutations", 0)) for s in stats if s),
            )
        return super().protocol_counts()


class SerfScenario(Scenario):
    implementation = "serf"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key = base64.b64encode(os.urandom(32)).decode()
        self.rpc_ports = {m.name: (7373 if m.lab_node is not None else free_tcp_udp_port()) for m in self.members}

    def argv(self, member: Member, seed: Member | None) -> list[str]:
        host, port = member.address
        argv = [
            "serf",
            "agent",
            "-node",
            member.name,
            "-bind",
            f"{host}:{port}",
            "-rpc-addr",
            f"127.0.0.1:{self.rpc_ports[member.name]}",
            "-encrypt",
            self.key,
            "-log-level",
            "info",
        ]
        if seed is not None:
            argv += ["-retry-join", f"{seed.address[0]}:{seed.address[1]}", "-retry-interval", "1s"]
        return argv

    def on_line(self, member: Member, line: str, now: float) -> None:
        if "Serf agent running" in line:
            member.ready_at = now
            return
        event = _SERF_EVENT.search(line)
        if event is not None:
            kind, name = event.groups()
            if name == member.name:
                return
            if kind in ("Join", "Update"):
                member.alive.add(name)
            elif kind in ("Failed", "Leave", "Reap"):
                member.alive.discard(name)
                if kind == "Failed":
                    member.dead_at.setdefault(name, now)
            return
        if _SERF_SUSPECT.search(line):
            member.suspicions += 1
        elif _SERF_REFUTE.search(line):
            member.refutations += 1


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def ratios(ours: dict[str, Any], anchor: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in METRICS:
        a, b = ours.get(key), anchor.get(key)
        out[key] = round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
    return out


def format_table(result: dict[str, Any]) -> str:
    edgerun = result.get("edgerun") or {}
    serf = result.get("serf") or {}
    ratio = result.get("ratios") or {}
    lines = [
        f"swarm-bench: {result['nodes']} nodes, {result['loss'] * 100:.0f} % loss, mode {result['mode']}"
        f" ({result.get('impairment') or 'no impairment'}), steady phase {result['seconds']:.0f} s",
        f"{'metric':<30}{'edgerun':>12}{'serf':>12}{'edgerun/serf':>14}",
    ]
    for key in METRICS:

        def cell(value: Any) -> str:
            return "-" if value is None else f"{value:g}"

        lines.append(f"{key:<30}{cell(edgerun.get(key)):>12}{cell(serf.get(key)):>12}{cell(ratio.get(key)):>14}")
    lines += [f"note: {note}" for note in result.get("notes", [])]
    return "\n".join(lines)


async def _bench(
    nodes: int,
    loss: float,
    seconds: float,
    timing: dict[str, Any],
    with_edgerun: bool,
    with_serf: bool,
    force_loopback: bool,
    join_timeout_s: float,
    detect_timeout_s: float,
    starve: float,
) -> dict[str, Any]:
    notes: list[str] = []
    reason = "loopback requested" if force_loopback else netlab.unavailable_reason()
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as tmp, contextlib.ExitStack() as stack:
        lab: NetLab | None = None
        impairment = None
        if reason is None:
            lab = stack.enter_context(NetLab())
            lab_nodes: list[LabNode | None] = [lab.add_node(f"n{i:02d}") for i in range(nodes)]
            for node in lab_nodes:
                assert node is not None
                impairment = lab.impair(node, loss_percent=loss * 100)
            mode = "netns"
        else:
            lab_nodes = [None] * nodes
            mode = "loopback"
            impairment = "transport receive loss" if loss > 0 else None
            notes.append(
                f"namespaces unavailable ({reason}): members ran on loopback with the transport's own "
                "loss injection; serf ran on loopback WITHOUT loss; bytes are the agents' own counts"
            )
        result: dict[str, Any] = {
            "mode": mode,
            "impairment": impairment,
            "nodes": nodes,
            "loss": loss,
            "seconds": seconds,
            "starve": starve,
            "timing": timing,
        }
        if with_edgerun:
            ours = EdgerunScenario(lab, lab_nodes, loss, Path(tmp), timing=timing, starve=starve)
            edgerun_result = await ours.run(seconds, join_timeout_s, detect_timeout_s)
            result["edgerun"] = edgerun_result.metrics
            notes += edgerun_result.notes
        if with_serf and shutil.which("serf") is None:
            notes.append("serf is not installed: no side-by-side anchor")
        elif with_serf:
            serf_result = await SerfScenario(lab, lab_nodes, loss, Path(tmp), starve=starve).run(
                seconds, join_timeout_s, detect_timeout_s
            )
            result["serf"] = serf_result.metrics
            if with_edgerun:
                result["ratios"] = ratios(result["edgerun"], serf_result.metrics)
            notes += serf_result.notes
        notes.append(
            "bytes_per_node_s: bytes each node's veth sent (kernel count, with IP/UDP/Ethernet headers), "
            "mean over nodes in the steady phase"
            if mode == "netns"
            else "bytes_per_node_s: the agents' own sealed-packet byte counts"
        )
        notes.append(
            "suspicions: failed probes that raised or confirmed a suspicion, summed over members (serf: "
            "memberlist's 'Suspect X has failed' log lines; edgerun: probe_failures); refutations: "
            "members refuting a suspect/dead claim about themselves; both include the kill phase"
        )
        result["notes"] = notes
        return result


def run_swarm_bench(
    nodes: int = 20,
    loss: float = 0.1,
    seconds: float = 60.0,
    *,
    timing: dict[str, Any] | None = None,
    with_edgerun: bool = True,
    with_serf: bool = True,
    force_loopback: bool = False,
    join_timeout_s: float = 60.0,
    detect_timeout_s: float = 60.0,
    starve: float = 0.0,
) -> dict[str, Any]:
    if nodes < 3:
        raise ValueError("swarm-bench needs at least 3 nodes (a seed, a victim and an observer)")
    if not 0 <= loss < 1:
        raise ValueError(f"loss must be within [0, 1), got {loss}")
    if not 0 <= starve < 1:
        raise ValueError(f"starve must be within [0, 1), got {starve}")
    return asyncio.run(
        _bench(
            nodes,
            loss,
            seconds,
            timing or {},
            with_edgerun,
            with_serf,
            force_loopback,
            join_timeout_s,
            detect_timeout_s,
            starve,
        )
    )

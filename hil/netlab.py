"""A network of Linux network namespaces: one per node, each joined by a veth pair to a bridge in its own namespace.

    lab = NetLab()                      # unique prefix per run: parallel runs never collide
    with lab:                           # torn down on exit, on exceptions, on Ctrl-C and on SIGTERM
        a, b = lab.add_node("a"), lab.add_node("b")
        lab.impair(a, loss_percent=10)  # netem where the kernel has it, else an nftables numgen drop rule
        lab.partition([a], [b]); lab.heal()
        proc = lab.spawn(a, ["python", "-m", "swarm.agent", ...])

Nothing touches the host's own namespace: veth pairs are created inside the node namespace with their peer end
placed straight into the bridge namespace, and impairments are rules inside the node's namespace, so deleting the
namespaces removes everything. Namespace names carry the creating pid (``el<pid>x<hex>-...``), so ``sweep()``
can remove what a run that was SIGKILLed left behind. Needs root and iproute2 (and nft for impairments).
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

_NFT_TABLE = "edgerun_netlab"
_PREFIX_RE = re.compile(r"^el(\d+)x[0-9a-f]{4}-")


class NetLabError(RuntimeError):
    """The rig could not be built (not root, iproute2 missing, a command failed); the message says which."""


@dataclass(frozen=True)
class LabNode:
    name: str
    netns: str
    ip: str
    interface: str = "eth0"


def _run(argv: Sequence[str], *, check: bool = True, input_text: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, input=input_text, timeout=30)
    if check and result.returncode != 0:
        raise NetLabError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"el{os.getpid()}x{secrets.token_hex(2)}-probe"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        return f"ip netns add failed: {result.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def list_namespaces() -> list[str]:
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def sweep() -> list[str]:
    """Deletes namespaces left by netlab runs whose process is gone; returns their names."""
    removed = []
    for name in list_namespaces():
        match = _PREFIX_RE.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


class NetLab:
    """Namespaces on one bridge, with loss and partitions; ``close()`` (or leaving ``with``) removes all of it."""

    def __init__(self, subnet: str = "10.99.0.0/16", *, prefix: str | None = None) -> None:
        self.prefix = prefix or f"el{os.getpid()}x{secrets.token_hex(2)}"
        self._subnet = ipaddress.IPv4Network(subnet)
        self.bridge_netns = f"{self.prefix}-br"
        self.nodes: list[LabNode] = []
        self._namespaces: list[str] = []
        self._pids: list[int] = []
        self._closed = False
        self._bridge_up = False
        self._previous_sigterm: Any = None
        self._netem: bool | None = None
        self.impairment_backend: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def __enter__(self) -> NetLab:
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: atexit and __exit__ still clean up
            self._previous_sigterm = None
        atexit.register(self.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through __exit__/finally, which tears the lab down

    def close(self) -> None:
        """Kills the processes spawned in the lab and deletes its namespaces (with their veths and rules)."""
        if self._closed:
            return
        self._closed = True
        for pid in self._pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self._pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        for netns in reversed(self._namespaces):
            _run(["ip", "netns", "del", netns], check=False)
        self._namespaces.clear()
        atexit.unregister(self.close)
        if self._previous_sigterm is not None:
            try:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            except ValueError:
                pass
        log.info("netlab %s torn down", self.prefix)

    # -- building ----------------------------------------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _ensure_bridge(self) -> None:
        if self._bridge_up:
            return
        self._add_netns(self.bridge_netns)
        _run(["ip", "-n", self.bridge_netns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_netns, "link", "set", "br0", "up"])
        self._bridge_up = True

    def add_node(self, name: str) -> LabNode:
        """A namespace with eth0 on the bridge and the next address of the subnet."""
        if self._closed:
            raise NetLabError("the lab is closed")
        self._ensure_bridge()
        index = len(self.nodes)
        netns = f"{self.prefix}-{index}"
        ip = str(self._subnet[index + 1])
        peer = f"v{index}"
        self._add_netns(netns)
        _run(
            ["ip", "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", self.bridge_netns]
        )
        _run(["ip", "-n", self.bridge_netns, "link", "set", peer, "master", "br0", "up"])
        _run(["ip", "-n", netns, "addr", "add", f"{ip}/{self._subnet.prefixlen}", "dev", "eth0"])
        _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
        node = LabNode(name=name, netns=netns, ip=ip)
        self.nodes.append(node)
        return node

    # -- running things inside ---------------------------------------------------------------------------------

    def command(self, node: LabNode, argv: Sequence[str]) -> list[str]:
        """argv to run inside the node's namespace (``ip netns exec`` execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", node.netns, *argv]

    def run(self, node: LabNode, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
        return _run(self.command(node, argv), check=check)

    def spawn(self, node: LabNode, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(node, argv), **popen)
        self._pids.append(proc.pid)
        return proc

    def adopt(self, pid: int) -> None:
        """Kills this process at teardown too (one started elsewhere, e.g. by asyncio)."""
        self._pids.append(pid)

    def link_bytes(self, node: LabNode) -> tuple[int, int]:
        """(received, sent) bytes on the node's eth0, as the kernel counts them."""
        base = f"/sys/class/net/{node.interface}/statistics"
        out = self.run(node, ["cat", f"{base}/rx_bytes", f"{base}/tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])

    # -- impairments -------------------------------------------------------------------------------------------

    def netem_available(self) -> bool:
        if self._netem is None:
            if not self.nodes:
                return False
            probe = self.nodes[0]
            result = self.run(probe, ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "0%"], check=False)
            self._netem = result.returncode == 0
            if self._netem:
                self.run(probe, ["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        return self._netem

    def _nft(self, node: LabNode, script: str) -> None:
        _run(["ip", "netns", "exec", node.netns, "nft", "-f", "-"], input_text=script)

    def _ensure_table(self, node: LabNode) -> None:
        self._nft(
            node,
            (
                f"table inet {_NFT_TABLE} {{\n"
                "  chain loss { type filter hook input priority 0; policy accept; }\n"
                "  chain partition { type filter hook input priority -10; policy accept; }\n"
                "}\n"
            ),
        )

    def impair(self, node: LabNode, *, loss_percent: float, backend: str = "auto") -> str:
        """Drops that share of the packets the node receives; returns the backend used ("netem" or "nftables")."""
        if not 0 <= loss_percent <= 100:
            raise NetLabError(f"loss_percent must be within 0..100, got {loss_percent}")
        use_netem = backend == "netem" or (backend == "auto" and self.netem_available())
        if use_netem:
            # netem shapes egress; the bridge-side peer's egress is this node's ingress.
            peer = f"v{self.nodes.index(node)}"
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.bridge_netns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    peer,
                    "root",
                    "netem",
                    "loss",
                    f"{loss_percent}%",
                ]
            )
            self.impairment_backend = "netem"
            return "netem"
        self._ensure_table(node)
        percent = int(round(loss_percent))
        script = f"flush chain inet {_NFT_TABLE} loss\n"
        if percent >= 100:
            script += f'add rule inet {_NFT_TABLE} loss iifname != "lo" drop\n'
        elif percent > 0:
            script += f'add rule inet {_NFT_TABLE} loss iifname != "lo" numgen random mod 100 < {percent} drop\n'
        self._nft(node, script)
        self.impairment_backend = "nftables"
        return "nftables"

    def partition(self, side_a: Sequence[LabNode], side_b: Sequence[LabNode]) -> None:
        """No packet passes between the two sides (each side still talks within itself)."""
        for here, there in ((side_a, side_b), (side_b, side_a)):
            addresses = ", ".join(node.ip for node in there)
            for node in here:
                self._ensure_table(node)
                self._nft(node, f"add rule inet {_NFT_TABLE} partition ip saddr {{ {addresses} }} drop\n")

    def heal(self) -> None:
        """Removes every partition rule (loss rules stay)."""
        for node in self.nodes:
            self._ensure_table(node)
            self._nft(node, f"flush chain inet {_NFT_TABLE} partition\n")

    def reachable(self, source: LabNode, target: LabNode, *, timeout_s: float = 2.0, port: int = 9) -> bool:
        """Whether a UDP datagram from source reaches target and its echo comes back (no ping binary needed)."""
        server = self.spawn(target, [sys.executable, "-c", _ECHO_SERVER, str(port), str(timeout_s + 1)])
        try:
            client = self.run(
                source, [sys.executable, "-c", _ECHO_CLIENT, target.ip, str(port), str(timeout_s)], check=False
            )
            return client.returncode == 0
        finally:
            server.kill()
            server.wait()


_ECHO_SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("", int(sys.argv[1])))  # every address of the namespace it runs in
s.settimeout(float(sys.argv[2]))
while True:
    data, addr = s.recvfrom(64)
    s.sendto(data, addr)
"""

_ECHO_CLIENT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.1)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    s.sendto(b"netlab", (sys.argv[1], int(sys.argv[2])))
    try:
        if s.recvfrom(64)[0] == b"netlab":
            sys.exit(0)
    except OSError:
        pass
sys.exit(1)
"""

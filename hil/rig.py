"""The processes of a HIL run: a private mosquitto, one ``edgerun run`` per simulated node, the observer.

Where network namespaces can be made (root, iproute2, nft), each simulated node runs in its own namespace
on one bridge (``hil.netlab``), the broker and the observer in another; elsewhere everything runs on
loopback and the faults that need namespaces (partitions, per-link loss) are reported as not injectable.
Every process the rig starts is stopped, and every namespace removed, on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import tomli_w

from edgerun.config import parse_config

# The rig flies the demo's scene (its spacing, side steps and truth label) so a HIL run is scored like the demo.
from edgerun.demo_swarm import SIDE_STEP_M, SPACING_M, TRUTH_LABEL, Drone, write_swarm_key
from edgerun.errors import EdgerunError
from edgerun.hostport import parse_hostport
from edgerun.sinks.mosquitto import Mosquitto
from edgerun.testing.control import DEFAULT_SOCKET, SLOW_CPU_DELAY_ENV, register_test_engines
from edgerun.testing.ports import free_port, free_tcp_udp_port
from hil import netlab
from hil.fleet_release import FleetRelease
from hil.scenario import NodeSpec, OffloadSpec, Scenario

GOSSIP_PORT = 7946
HTTP_PORT = 8089
BROKER_PORT = 1883
CONTROL_TIMEOUT_S = 3.0


class RigError(RuntimeError):
    """The rig could not be built (no mosquitto, a process that would not start); the message says which."""


@dataclass
class SimNode:
    """One simulated node: its config, run directory, process and the record of its starts and exits."""

    spec: NodeSpec
    drone: Drone
    ip: str
    lab_node: netlab.LabNode | None
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)  # wall times
    exits: list[dict[str, Any]] = field(default_factory=list)  # {"t", "code", "expected", "why"}
    expect_exit: str = ""  # why the next exit is planned ("" : it would be unexpected)
    ignore_control: bool = False  # started without --test-control; a stand-in socket answers and does nothing
    replays: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (start wall time, [source.replay])
    _decoy: socket.socket | None = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def dir(self) -> Path:
        return self.drone.out_dir

    @property
    def control_path(self) -> Path:
        return self.dir / DEFAULT_SOCKET

    @property
    def http_url(self) -> str:
        return f"http://{self.ip}:{self.drone.config['service']['http_port']}"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def offload_section(spec: OffloadSpec) -> dict[str, Any]:
    """A scenario node's offload as its node config's [offload]; what the scenario leaves out, the node's default."""
    return {key: value for key, value in msgspec.structs.asdict(spec).items() if value is not None}


class Rig:
    """Builds and tears down the run's processes; ``with Rig(...) as rig:``."""

    def __init__(
        self,
        scenario: Scenario,
        out: Path,
        release: FleetRelease,
        *,
        force_loopback: bool = False,
        ignore_control: frozenset[str] = frozenset(),
    ) -> None:
        self.scenario = scenario
        self.out = out
        self.release = release
        self.ignore_control = ignore_control
        reason = "forced by --loopback" if force_loopback else netlab.unavailable_reason()
        if scenario.broker.address:
            reason = reason or "an external broker (real boards) is reached from the host's network"
        self.mode = "loopback" if reason else "netns"
        self.mode_reason = reason or ""
        self.lab: netlab.NetLab | None = None
        self.broker_node: netlab.LabNode | None = None
        self.broker: Mosquitto | None = None
        self.broker_host = "127.0.0.1"
        self.broker_port = BROKER_PORT
        self.observer: subprocess.Popen[bytes] | None = None
        self.nodes: dict[str, SimNode] = {}
        self.impairment_backend = ""
        self._closed = False
        self._lock = threading.Lock()

    # -- building ----------------------------------------------------------------------------------------

    def __enter__(self) -> Rig:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        scenario = self.scenario
        if self.mode == "netns":
            self.lab = netlab.NetLab()
            self.lab.__enter__()
            self.broker_node = self.lab.add_node("broker")
            self.broker_host = self.broker_node.ip
        elif scenario.broker.address:
            self.broker_host, self.broker_port = parse_hostport(scenario.broker.address, "broker.address")
        else:
            self.broker_port = free_port()
        if not scenario.broker.address:
            self.start_broker()
        key_file = self.out / "swarm.key"
        write_swarm_key(key_file)
        sims = scenario.simulated
        lab_nodes = [self.lab.add_node(spec.id) if self.lab else None for spec in sims]
        ips = [n.ip if n else "127.0.0.1" for n in lab_nodes]
        gossip = [GOSSIP_PORT if self.lab else free_tcp_udp_port() for _ in sims]
        for k, spec in enumerate(sims):
            seeds = [f"{ips[j]}:{gossip[j]}" for j in range(len(sims)) if j != k]
            drone = self._drone(k, spec, ips[k], gossip[k], seeds, key_file)
            node = SimNode(spec, drone, ips[k], lab_nodes[k], ignore_control=spec.id in self.ignore_control)
            self.nodes[spec.id] = node
            loss = spec.loss_percent if spec.loss_percent is not None else scenario.network.loss_percent
            if loss and self.lab is not None and node.lab_node is not None:
                self.impairment_backend = self.lab.impair(node.lab_node, loss_percent=loss)
        self.start_observer()
        for node in self.nodes.values():
            self.start_node(node)

    def _drone(self, k: int, spec: NodeSpec, ip: str, port: int, seeds: list[str], key_file: Path) -> Drone:
        scenario, node_dir = self.scenario, self.out / "nodes" / spec.id
        node_dir.mkdir(parents=True, exist_ok=True)
        path_offset = -SPACING_M * k if spec.path_offset_m is None else spec.path_offset_m
        east_offset = SIDE_STEP_M[k % len(SIDE_STEP_M)] if spec.east_offset_m is None else spec.east_offset_m
        cfg: dict[str, Any] = {
            "node": {"id": spec.id, "log_level": "info"},
            "source": {
                "kind": "replay",
                "fps": scenario.scene.fps,
                "reopen_backoff_s": 0.5,
                "reopen_backoff_max_s": 2.0,
                "replay": {
                    "seed": scenario.scene.seed,
                    "width": scenario.scene.width,
                    "speed_mps": scenario.scene.speed_mps,
                    "height": scenario.scene.height,
                    "path_offset_m": path_offset,
                    "east_offset_m": east_offset,
                    "origin": list(scenario.scene.origin),
                    "ground_alt_m": scenario.scene.ground_alt_m,
                },
            },
            "model": {"bundle": spec.model or str(self.release.v1.root)},
            "engine": {
                "order": list(spec.engines),
                "hang_deadline_ms": spec.hang_deadline_ms,
                "state_dir": str(node_dir / "state"),
                "reprobe_min_s": 1.0,
                "reprobe_max_s": 4.0,
                "num_threads": 1,
                "replicas": 1,
            },
            "sinks": {
                "jsonl": {"path": str(node_dir / "detections.jsonl")},
                # QoS 1 and no expiry: a batch is delivered or counted as dropped by the node, never lost quietly.
                "mqtt": {
                    "enabled": True,
                    "host": self.broker_host,
                    "port": self.broker_port,
                    "qos_detections": 1,
                    "message_expiry_s": 0,
                    "reconnect_max_s": 1.0,
                    "metrics_interval_s": 0.0,
                    "outbox": 5000,
                },
            },
            "service": {"http_host": ip, "http_port": HTTP_PORT if self.lab else free_port(), "stall_s": 30.0},
            "ota": {
                "enabled": True,
                "state_dir": str(node_dir / "state"),
                "root_keys": [str(self.release.root_pub)],
                "mqtt": True,
                "poll_interval_s": 10.0,
                "health_window_s": 8.0,
                "latency_factor": 50.0,
            },
            "swarm": {
                "enabled": True,
                "bind": f"{ip}:{port}",
                "seeds": seeds,
                "key_file": str(key_file),
                "radius_m": scenario.swarm.radius_m,
                "labels": [TRUTH_LABEL],
                "timing": dict(scenario.swarm.timing),
            },
        }
        for key in ("hold_s", "window_s"):  # left out: the node's own default
            if getattr(scenario.swarm, key) is not None:
                cfg["swarm"][key] = getattr(scenario.swarm, key)
        if spec.offload.used:
            cfg["offload"] = offload_section(spec.offload)
        register_test_engines()  # the nodes run in test mode: hilaccel is an engine key there
        parse_config(cfg)  # a bad node config fails here, before any process starts
        (node_dir / "node.toml").write_text(tomli_w.dumps(cfg))
        return Drone(k, spec.id, node_dir, cfg)

    def _spawn(self, lab_node: netlab.LabNode | None, argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
        popen.setdefault("start_new_session", True)  # Ctrl-C is the runner's to handle, not the children's
        if self.lab is not None and lab_node is not None:
            return self.lab.spawn(lab_node, argv, **popen)
        return subprocess.Popen(argv, **popen)

    def start_broker(self) -> None:
        workdir = self.out / "broker"
        workdir.mkdir(parents=True, exist_ok=True)
        # Persistence, no queue limit: the observer's session and its queued messages survive a broker restart fault.
        self.broker = self.broker or Mosquitto(
            port=self.broker_port,
            workdir=workdir,
            host=self.broker_host,
            persistence=True,
            extra=["max_queued_messages 0"],
        )
        try:
            command = self.broker.prepare()
        except EdgerunError as err:
            raise RigError(str(err)) from None
        with self.broker.log_path.open("ab") as log:
            # Spawned here, not by Mosquitto.start: in netns mode the broker runs inside its namespace.
            self.broker.process = self._spawn(
                self.broker_node, command, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        if not self._wait_port(self.broker_node, self.broker_host, self.broker_port, 10.0):
            raise RigError(f"mosquitto did not listen on {self.broker_host}:{self.broker_port}; see {workdir}")

    def stop_broker(self) -> None:
        if self.broker is not None:
            self.broker.stop(timeout=10.0)  # SIGTERM first: it saves its persistence file

    def _wait_port(self, lab_node: netlab.LabNode | None, host: str, port: int, timeout: float) -> bool:
        probe = (
            "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), 0.5).close()\n"
            "except OSError:\n sys.exit(1)\n"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.lab is not None and lab_node is not None:
                ok = self.lab.run(lab_node, [sys.executable, "-c", probe, host, str(port)], check=False).returncode == 0
            else:
                try:
                    socket.create_connection((host, port), 0.5).close()
                    ok = True
                except OSError:
                    ok = False
            if ok:
                return True
            time.sleep(0.1)
        return False

    def start_observer(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "hil.observer",
            "--broker",
            f"{self.broker_host}:{self.broker_port}",
            "--out",
            str(self.observations_path),
        ]
        for node in self.nodes.values():
            argv += ["--node", f"{node.id}={node.http_url}"]
        for spec in self.scenario.nodes:
            if spec.real:
                argv += ["--node", f"{spec.id}={spec.address.rstrip('/')}"]
        with (self.out / "observer.log").open("ab") as log:
            self.observer = self._spawn(self.broker_node, argv, stdout=log, stderr=log, cwd=_repo_root())

    @property
    def observations_path(self) -> Path:
        return self.out / "observations.jsonl"

    def start_node(self, node: SimNode) -> None:
        replay = node.drone.config["source"]["replay"]
        if node.starts:
            # A drone that reboots in the air is further along its path, not back at its start.
            flown = self.scenario.scene.speed_mps * (time.time() - node.starts[0])
            replay["path_offset_m"] = round(node.replays[0][1]["path_offset_m"] + flown, 2)
            (node.dir / "node.toml").write_text(tomli_w.dumps(node.drone.config))
        node.replays.append((time.time(), dict(replay)))
        argv = [sys.executable, "-m", "edgerun", "run", "-c", str(node.dir / "node.toml")]
        if node.ignore_control:
            node._decoy = node._decoy or _decoy_control_socket(node.control_path)
        else:
            argv.append("--test-control")
        env = {**os.environ, "PYTHONPATH": str(_repo_root())}
        if node.spec.cpu_delay_ms:
            env[SLOW_CPU_DELAY_ENV] = f"{node.spec.cpu_delay_ms:g}"  # its hilcpu engine: a weaker board's CPU
        with (node.dir / "node.log").open("ab") as log:
            node.proc = self._spawn(node.lab_node, argv, stdout=subprocess.DEVNULL, stderr=log, cwd=node.dir, env=env)
        node.starts.append(time.time())
        node.expect_exit = ""

    def poll_exits(self) -> list[SimNode]:
        """Nodes whose process ended since the last call (their exit is recorded)."""
        ended = []
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is not None:
                code = node.proc.returncode
                node.exits.append(
                    {
                        "t": time.time(),
                        "code": code,
                        "expected": bool(node.expect_exit),
                        "why": node.expect_exit or "unexpected",
                    }
                )
                node.proc = None
                ended.append(node)
        return ended

    def kill_node(self, node: SimNode, why: str) -> None:
        if node.running:
            assert node.proc is not None
            node.expect_exit = why
            node.proc.kill()
            node.proc.wait(10)

    def control(self, node: SimNode, request: dict[str, Any]) -> dict[str, Any]:
        """One command on the node's test-control socket; raises OSError/ValueError when it does not answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CONTROL_TIMEOUT_S)
            sock.connect(str(node.control_path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        reply = json.loads(data)
        if not reply.get("ok"):
            raise ValueError(reply.get("error") or "refused")
        return reply

    def publish_release(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "hil.fleet_release",
            "publish",
            str(self.release.release_dir),
            self.release.model,
            f"{self.broker_host}:{self.broker_port}",
        ]
        if self.lab is not None and self.broker_node is not None:
            result = self.lab.run(self.broker_node, argv, check=False)
        else:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=_repo_root())
        if result.returncode != 0:
            raise RigError(f"publishing the release failed: {result.stderr.strip()[-300:]}")

    # -- teardown ----------------------------------------------------------------------------------------

    def stop_nodes(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every node (a clean stop: exit 0 expected), SIGKILL what lingers; exits are recorded."""
        for node in self.nodes.values():
            if node.running:
                assert node.proc is not None
                node.expect_exit = "stopped at the end of the run"
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes.values():
            if node.proc is None:
                continue
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.expect_exit = ""
                node.proc.kill()
                node.proc.wait(10)
        self.poll_exits()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for node in self.nodes.values():
            if node.running:
                assert node.proc is not None
                node.proc.kill()
                node.proc.wait(10)
            if node._decoy is not None:
                node._decoy.close()
        if self.observer is not None and self.observer.poll() is None:
            self.observer.send_signal(signal.SIGTERM)
            try:
                self.observer.wait(10)
            except subprocess.TimeoutExpired:
                self.observer.kill()
                self.observer.wait(5)
        self.stop_broker()
        if self.lab is not None:
            self.lab.close()


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def _decoy_control_socket(path: Path) -> socket.socket:
    """A control socket that answers every command with ok and does nothing: a node that ignores the rig."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(b'{"ok": true}\n')

    threading.Thread(target=serve, name="hil-decoy-control", daemon=True).start()
    return server

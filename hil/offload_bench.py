"""offload-bench (#25): a weak node borrows a strong neighbour's engine, in network namespaces, measured from outside.

Every node is a real ``edgerun run`` process running the pose detector on a replay source, in a namespace of its
own (``hil.netlab``), pinned to one core with ``taskset``. The weak node is also held to a share of its core by a
CPU quota (cgroup v2 ``cpu.max`` where the cpu controller is mounted there, else cgroup v1 ``cpu.cfs_quota_us``):
on a 2-core machine one whole core runs the pose detector faster than the replay, so one core alone is not weak.
The strong neighbour has the other core and serves the same model (``offload.serve``).

Cases, run one after the other in the same lab, each from fresh processes:

* ``loss{0,10}/local``: the weak node alone (``offload.mode = "never"``; the helper runs, unused);
* ``loss{0,10}/auto-jpeg``, ``/always-jpeg``, ``/always-zstd``: the weak node offloads;
  loss is nftables ``numgen random`` drop on input inside both namespaces (so both directions lose packets);
* ``kill``: ``always`` at 0 % loss, the helper SIGKILLed half-way: the frames the weak node lost
  (``infer/offload_lost`` + ``infer/offload_late``) against one deadline's worth (source fps x deadline),
  and the frames it published from its own engine afterwards;
* ``steal/never``, ``steal/auto``: two busy weak nodes (the same core, the same quota each) and one idle node
  serving (a slow source of its own): the busy nodes' drop rate without and with offloading.

Figures per case come from the weak node's own end-of-run summary (``fps``, ``latency_p50_ms`` /
``latency_p99_ms`` capture to publish, ``dropped``; the run includes the seconds before a helper is chosen) and
from the kernel's byte counters of its veth (``link_bytes``, sent and received over the weak node's run; gossip
included) divided by the frames a helper served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from edgerun.demo_swarm import drone_configs
from hil import netlab
from hil.netlab import LabNode, NetLab

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
GOSSIP_PORT = 7946
# Fast SWIM timing: round trips (the chooser needs one) are measured within the first second.
FAST_TIMING = {"probe_interval_s": 0.3, "probe_timeout_s": 0.15, "gossip_interval_s": 0.1, "suspicion_mult": 3}
OFFLOAD_CASES = (("auto", "jpeg"), ("always", "jpeg"), ("always", "zstd"))
IDLE_FPS = 2.0  # the idle node's own source in the work-stealing case: it has frames, and time to spare


class OffloadBenchError(RuntimeError):
    """The bench could not run (no namespaces, no CPU quota, a node did not start); the message says why."""


# -- the CPU quota -------------------------------------------------------------------------------------------


class CpuQuota:
    """A cgroup holding processes to ``share`` of one CPU; v2 ``cpu.max`` where available, else v1 CFS quota."""

    PERIOD_US = 100_000

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise OffloadBenchError(f"weak node's CPU share must be within (0, 1], got {share}")
        self.share = share
        name = f"edgerun-offload-bench-{os.getpid()}"
        quota = int(self.PERIOD_US * share)
        v2 = Path("/sys/fs/cgroup")
        v2_controllers = v2 / "cgroup.controllers"
        if v2_controllers.exists() and "cpu" in v2_controllers.read_text().split():
            self.path = v2 / name
            self.method = f"cgroup v2 cpu.max {quota} {self.PERIOD_US}"
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}\n")
        elif (Path("/sys/fs/cgroup/cpu") / "cpu.cfs_quota_us").exists():
            self.path = Path("/sys/fs/cgroup/cpu") / name
            self.method = f"cgroup v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {self.PERIOD_US}"
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(f"{self.PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        else:
            raise OffloadBenchError("no cgroup cpu controller (neither v2 cpu.max nor v1 cpu.cfs_quota_us)")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def close(self) -> None:
        """Removes the group (its processes are gone by then; a straggler is moved back to the root first)."""
        with contextlib.suppress(OSError):
            procs = (self.path / "cgroup.procs").read_text().split()
            for pid in procs:
                with contextlib.suppress(OSError):
                    (self.path.parent / "cgroup.procs").write_text(f"{pid}\n")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        log.warning("could not remove %s", self.path)


# -- one node ------------------------------------------------------------------------------------------------


@dataclass
class BenchNode:
    name: str
    lab_node: LabNode
    cpu: int
    weak: bool
    fps: float
    offload: dict[str, Any]
    out_dir: Path = field(default_factory=Path)
    config: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_file: Any = None

    @property
    def log_path(self) -> Path:
        return self.out_dir / "node.log"

    @property
    def detections_path(self) -> Path:
        return self.out_dir / "detections.jsonl"


def summary(log_path: Path) -> dict[str, Any] | None:
    """The node's end-of-run summary (its last ``stopped: {...}`` log line), or None when it wrote none."""
    if not log_path.exists():
        return None
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        if "stopped: " in line:
            with contextlib.suppress(ValueError):
                return dict(json.loads(line.split("stopped: ", 1)[1]))
    return None


def batches(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and row.get("schema") == "edgerun.detections/1":
                    rows.append(row)
    return rows


class Case:
    """One case: its nodes' configs written, processes started in their namespaces, stopped and read."""

    def __init__(self, lab: NetLab, quota: CpuQuota, workdir: Path, nodes: list[BenchNode], model: str) -> None:
        self.lab, self.quota, self.nodes = lab, quota, nodes
        drones = drone_configs(workdir, len(nodes), model=model)
        for node, drone in zip(nodes, drones):
            cfg = drone.config
            cfg["node"]["id"] = node.name
            cfg["node"]["log_level"] = "info"
            cfg["source"]["fps"] = node.fps
            cfg["engine"].update({"num_threads": 1, "replicas": 1})
            cfg["swarm"].update(
                {
                    "bind": f"{node.lab_node.ip}:{GOSSIP_PORT}",
                    "seeds": sorted({f"{o.lab_node.ip}:{GOSSIP_PORT}" for o in nodes if o.lab_node != node.lab_node}),
                    "timing": dict(FAST_TIMING),
                }
            )
            cfg["offload"] = dict(node.offload)
            node.out_dir, node.config = drone.out_dir, cfg
            (drone.out_dir / "node.toml").write_text(tomli_w.dumps(cfg))

    def start(self, node: BenchNode, seconds: float) -> None:
        argv = [
            "taskset", "-c", str(node.cpu),
            sys.executable, "-m", "edgerun", "run", "-c", str(node.out_dir / "node.toml"), "--seconds", f"{seconds:g}",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        node.log_file = node.log_path.open("wb")
        node.proc = self.lab.spawn(
            node.lab_node, argv, stdout=subprocess.DEVNULL, stderr=node.log_file, stdin=subprocess.DEVNULL, env=env
        )

    def _wait_log(self, node: BenchNode, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.log_path.exists() and text in node.log_path.read_text(errors="replace"):
                return
            if node.proc is not None and node.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = node.log_path.read_text(errors="replace")[-2000:] if node.log_path.exists() else ""
        raise OffloadBenchError(f"{node.name}: no {text!r} in its log within {timeout_s:g} s:\n{tail}")

    def throttle(self, node: BenchNode, timeout_s: float = 90.0) -> None:
        """Holds a weak node to the quota once it runs. Its start-up (imports, the replay scene, the model) runs
        on the whole core: under the quota it takes many seconds and measures nothing the bench compares."""
        assert node.proc is not None
        self._wait_log(node, "health: running", timeout_s)
        self.quota.add(node.proc.pid)  # `ip netns exec` execs taskset, which execs python: one pid, every thread

    def wait_serving(self, node: BenchNode, timeout_s: float = 90.0) -> None:
        """Until the node says it serves neighbours (its scene built, its model loaded, its listener up)."""
        self._wait_log(node, "offload: serving", timeout_s)

    def wait(self, node: BenchNode, timeout_s: float) -> None:
        assert node.proc is not None
        try:
            node.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(15)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def stop(self, node: BenchNode) -> None:
        if node.proc is not None and node.proc.returncode is None:
            node.proc.send_signal(signal.SIGTERM)
        self.wait(node, 15)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
            if node.log_file is not None:
                node.log_file.close()
                node.log_file = None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def weak_figures(node: BenchNode, sent: int, received: int) -> dict[str, Any]:
    """What one weak node's run measured: its summary's figures and its link's bytes per frame offloaded."""
    result = summary(node.log_path)
    if result is None:
        tail = node.log_path.read_text(errors="replace")[-2000:] if node.log_path.exists() else ""
        raise OffloadBenchError(f"{node.name} wrote no summary (exit {node.proc and node.proc.returncode}):\n{tail}")
    offload = result.get("offload") or {}
    frames = offload.get("frames") or {}
    client = offload.get("client") or {}
    offloaded = int(offload.get("offloaded", 0))
    sent_frames = int(client.get("requests", 0))  # frames that went on the link, served, late or lost
    captured = int(result.get("captured", 0))
    dropped = int(result.get("dropped", 0))
    by_reason = result.get("dropped_by_reason") or {}

    def per(total: int, count: int) -> int | None:
        return round(total / count) if count else None

    return {
        "fps": result.get("fps"),
        "latency_p50_ms": result.get("latency_p50_ms"),
        "latency_p99_ms": result.get("latency_p99_ms"),
        "captured": captured,
        "published": int(result.get("frames", 0)),
        "inferred_locally": int(result.get("inferred", 0)) - offloaded,
        "dropped": dropped,
        "drop_rate": round(dropped / captured, 3) if captured else None,
        "dropped_by_reason": by_reason,
        "sent_to_helper": sent_frames,
        "offloaded": offloaded,
        "offload_lost": int(by_reason.get("infer/offload_lost", 0)),
        "offload_late": int(by_reason.get("infer/offload_late", 0)),
        "offload_frames": frames,
        "helper_dropped": int(frames.get("helper_dropped", 0)),
        "link_sent_bytes": sent,
        "link_received_bytes": received,
        "link_bytes_per_offloaded_frame": per(sent + received, offloaded),
        "link_bytes_per_sent_frame": per(sent + received, sent_frames),
        "payload_bytes_per_sent_frame": per(int(offload.get("bytes_out", 0)), sent_frames),
    }


class OffloadBench:
    def __init__(
        self,
        lab: NetLab,
        quota: CpuQuota,
        workdir: Path,
        *,
        model: str,
        fps: float,
        seconds: float,
        deadline_ms: float,
        window: int,
    ) -> None:
        self.lab, self.quota, self.workdir = lab, quota, workdir
        self.model, self.fps, self.seconds = model, fps, seconds
        self.deadline_ms, self.window = deadline_ms, window
        self.weak = lab.add_node("weak")
        self.strong = lab.add_node("strong")
        self.busy2 = lab.add_node("busy2")
        self._cases = 0

    def _offload(self, mode: str, codec: str = "jpeg", *, serve: bool = False) -> dict[str, Any]:
        return {"mode": mode, "serve": serve, "codec": codec, "window": self.window, "deadline_ms": self.deadline_ms}

    def _case(self, nodes: list[BenchNode]) -> Case:
        self._cases += 1
        workdir = self.workdir / f"case{self._cases:02d}"
        workdir.mkdir()
        return Case(self.lab, self.quota, workdir, nodes, self.model)

    def set_loss(self, loss: float) -> None:
        for node in (self.weak, self.strong, self.busy2):
            self.lab.impair(node, loss_percent=loss * 100, backend="nftables")

    def pairs(self, prefix: str, cases: list[tuple[str, str]], *, kill: bool = False) -> dict[str, Any]:
        """The weak node beside the strong one, once per (mode, codec), one after the other beside one helper
        process; ``kill``: then one more, ``always`` with jpeg, during which the helper is SIGKILLed."""
        helper = BenchNode("strong", self.strong, 1, False, self.fps, self._offload("never", serve=True))
        runs = [(f"{prefix}/{'local' if mode == 'never' else f'{mode}-{codec}'}", mode, codec) for mode, codec in cases]
        if kill:
            runs.append(("kill", "always", "jpeg"))
        weaks = [
            BenchNode(f"weak-{name.replace('/', '-')}", self.weak, 0, True, self.fps, self._offload(mode, codec))
            for name, mode, codec in runs
        ]
        case = self._case([helper, *weaks])
        out: dict[str, Any] = {}
        try:
            case.start(helper, (self.seconds + 60) * len(weaks) + 60)
            case.wait_serving(helper)
            for weak, (name, _, _) in zip(weaks, runs):
                sent0, received0 = self._link_bytes(self.weak)
                case.start(weak, self.seconds)
                case.throttle(weak)
                killed_seq = self._kill_mid_run(helper, weak) if name == "kill" else None
                case.wait(weak, self.seconds + 60)
                sent1, received1 = self._link_bytes(self.weak)
                figures = weak_figures(weak, sent1 - sent0, received1 - received0)
                if killed_seq is not None:
                    figures.update(self._after_kill(weak, figures, killed_seq))
                out[name] = figures
            case.stop(helper)
        finally:
            case.close()
        return out

    def _kill_mid_run(self, helper: BenchNode, weak: BenchNode) -> int:
        """SIGKILLs the helper half-way through the weak node's run once it has published frames the helper
        served (waiting up to 3/4 of the run for them); the last ``seq`` the weak node had published by then."""
        started = time.monotonic()
        while time.monotonic() - started < self.seconds * 0.75:
            served = sum(_remote(b) for b in batches(weak.detections_path))
            if time.monotonic() - started >= self.seconds / 2 and served >= 2 * self.window:
                break
            time.sleep(0.1)
        killed_seq = max((b["seq"] for b in batches(weak.detections_path)), default=-1)
        assert helper.proc is not None
        helper.proc.send_signal(signal.SIGKILL)
        helper.proc.wait()
        return killed_seq

    def _after_kill(self, weak: BenchNode, figures: dict[str, Any], killed_seq: int) -> dict[str, Any]:
        after = [b for b in batches(weak.detections_path) if b["seq"] > killed_seq]
        lost = figures["offload_lost"] + figures["offload_late"]
        one_deadline = self.fps * self.deadline_ms / 1000.0
        return {
            "frames_lost": lost,
            "one_deadline_frames": round(one_deadline, 1),
            "within_one_deadline": lost <= max(one_deadline, self.window),
            "published_after_kill": len(after),
            "published_locally_after_kill": sum(1 for b in after if not _remote(b)),
            "published_remotely_after_kill": sum(1 for b in after if _remote(b)),
        }

    def steal(self, mode: str) -> dict[str, Any]:
        """Two busy weak nodes on one core (each under the quota) and an idle node serving on the other."""
        busy = [
            BenchNode("busy1", self.weak, 0, True, self.fps, self._offload(mode)),
            BenchNode("busy2", self.busy2, 0, True, self.fps, self._offload(mode)),
        ]
        idle = BenchNode("idle", self.strong, 1, False, IDLE_FPS, self._offload("never", serve=True))
        case = self._case([*busy, idle])
        try:
            case.start(idle, self.seconds + 90)
            case.wait_serving(idle)
            links0 = [self._link_bytes(node.lab_node) for node in busy]
            for node in busy:
                case.start(node, self.seconds)
            for node in busy:
                case.throttle(node)
            for node in busy:
                case.wait(node, self.seconds + 30)
            links1 = [self.lab.link_bytes(node.lab_node) for node in busy]
            case.stop(idle)
        finally:
            case.close()
        per_node = {
            node.name: weak_figures(node, s1 - s0, r1 - r0) for node, (s0, r0), (r1, s1) in zip(busy, links0, links1)
        }
        captured = sum(f["captured"] for f in per_node.values())
        dropped = sum(f["dropped"] for f in per_node.values())
        idle_summary = summary(idle.log_path) or {}
        return {
            "drop_rate": round(dropped / captured, 3) if captured else None,
            "captured": captured,
            "dropped": dropped,
            "published": sum(f["published"] for f in per_node.values()),
            "offloaded": sum(f["offloaded"] for f in per_node.values()),
            # The server's counters leave out what is still 0.
            "idle_served": int(idle_summary["offload_served"].get("served", 0))
            if "offload_served" in idle_summary
            else None,
            "nodes": per_node,
        }

    def _link_bytes(self, node: LabNode) -> tuple[int, int]:
        """(sent, received): the order the bench keeps, not netlab's (received, sent)."""
        received, sent = self.lab.link_bytes(node)
        return sent, received


def _remote(batch: dict[str, Any]) -> bool:
    return str((batch.get("model") or {}).get("engine", "")).startswith("remote:")


@contextlib.contextmanager
def _lab_and_quota(weak_share: float) -> Iterator[tuple[NetLab, CpuQuota]]:
    reason = netlab.unavailable_reason()
    if reason is not None:
        raise OffloadBenchError(f"offload-bench needs network namespaces: {reason}")
    if shutil.which("taskset") is None:
        raise OffloadBenchError("offload-bench needs taskset (util-linux)")
    quota = CpuQuota(weak_share)
    try:
        with NetLab() as lab:
            yield lab, quota
    finally:
        quota.close()


def run_offload_bench(
    *,
    model: str | None = None,
    fps: float = 10.0,
    seconds: float = 20.0,
    weak_share: float = 0.15,
    losses: tuple[float, ...] = (0.0, 0.1),
    deadline_ms: float = 500.0,
    window: int = 4,
    kill: bool = True,
    steal: bool = True,
    keep: Path | None = None,
    offload_cases: tuple[tuple[str, str], ...] = OFFLOAD_CASES,
) -> dict[str, Any]:
    """Every case in one run; the JSON the bench writes (see the module docstring). ``keep``: write the nodes'
    configs, logs and detections there (kept) instead of a temporary directory."""
    if os.cpu_count() is not None and (os.cpu_count() or 0) < 2:
        raise OffloadBenchError("offload-bench needs two cores (one weak, one strong)")
    for mode, codec in offload_cases:
        if mode not in ("auto", "always") or codec not in ("jpeg", "zstd"):
            raise OffloadBenchError(f"an offload case is auto|always with jpeg|zstd, got {mode}-{codec}")
    for loss in losses:
        if not 0 <= loss < 1:
            raise OffloadBenchError(f"loss must be within [0, 1), got {loss}")
    bundle = model or str(REPO / ".cache" / "models" / "pose_detector")
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=False)
            workdir = keep
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="offload-bench-")))
        lab, quota = stack.enter_context(_lab_and_quota(weak_share))
        bench = OffloadBench(
            lab,
            quota,
            workdir,
            model=bundle,
            fps=fps,
            seconds=seconds,
            deadline_ms=deadline_ms,
            window=window,
        )
        cases: dict[str, Any] = {}
        for loss in losses:
            bench.set_loss(loss)
            prefix = f"loss{round(loss * 100)}"
            # The kill case runs at the first loss level (0 % by default), beside the same helper.
            cases.update(bench.pairs(prefix, [("never", "jpeg"), *offload_cases], kill=kill and loss == losses[0]))
        bench.set_loss(0.0)
        result: dict[str, Any] = {
            "bench": "offload",
            "mode": "netns",
            "impairment": "nftables numgen random drop on input in the weak and the strong namespace",
            "model": Path(bundle).name,
            "source_fps": fps,
            "seconds": seconds,
            "deadline_ms": deadline_ms,
            "window": window,
            "cpu": {
                "weak": f"taskset -c 0 + {quota.method} ({weak_share:g} of a core)",
                "strong": "taskset -c 1, no quota",
                "cores": os.cpu_count(),
                "nice": os.nice(0),
            },
            "cases": cases,
        }
        if "kill" in cases:
            result["kill"] = cases.pop("kill")
            result["kill"]["loss"] = losses[0]
        if steal:
            result["steal"] = {"never": bench.steal("never"), "auto": bench.steal("auto")}
    result["wall_s"] = round(time.monotonic() - started, 1)
    # The machine's 1-minute load average before and after: how much the neighbours took from both cores.
    result["cpu"]["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["notes"] = [
        "fps, latency_p50_ms/p99 (capture to publish), dropped: the weak node's own end-of-run summary; the run "
        "includes the seconds before a helper is chosen (auto needs two engine measurements first)",
        "link bytes: the weak node's veth (kernel counts, both directions, headers and gossip included) over the "
        "weak node's run, per frame a helper served (link_bytes_per_offloaded_frame) and per frame sent to it "
        "(late and lost included: link_bytes_per_sent_frame); payload_bytes_per_sent_frame: the encoded frames "
        "alone",
        "the cases of one loss level run one after the other beside one helper process (its own source running)",
        "kill: frames_lost = infer/offload_lost + infer/offload_late; the target is one deadline's worth "
        "(source fps x deadline, at least the window)",
        "steal: two busy nodes share core 0 under the quota each; the idle node serves on core 1 with a "
        f"{IDLE_FPS:g} fps source of its own",
        "the machine is shared: absolute figures move with the neighbours' load, compare within one run",
    ]
    return result


def format_table(result: dict[str, Any]) -> str:
    """The cases side by side, as the docs show them."""

    def cell(value: Any) -> str:
        return "-" if value is None else (f"{value:g}" if isinstance(value, (int, float)) else str(value))

    head = ["case", "fps", "p50 ms", "p99 ms", "dropped", "sent", "offloaded", "link B/offloaded", "payload B/sent"]
    lines = [
        f"offload-bench: {result['model']} at {result['source_fps']:g} fps, {result['seconds']:g} s per case; "
        f"weak: {result['cpu']['weak']}",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, f in result["cases"].items():
        row = [
            name,
            f["fps"],
            f["latency_p50_ms"],
            f["latency_p99_ms"],
            f["dropped"],
            f["sent_to_helper"],
            f["offloaded"],
            f["link_bytes_per_offloaded_frame"],
            f["payload_bytes_per_sent_frame"],
        ]
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    kill = result.get("kill")
    if kill:
        lines.append(
            f"kill: lost {kill['frames_lost']} (one deadline = {kill['one_deadline_frames']:g} frames), then "
            f"{kill['published_locally_after_kill']} published locally"
        )
    steal = result.get("steal")
    if steal:
        lines.append(
            f"steal: busy nodes' drop rate never {cell(steal['never']['drop_rate'])}, "
            f"auto {cell(steal['auto']['drop_rate'])} (idle served {cell(steal['auto']['idle_served'])})"
        )
    return "\n".join(lines)

"""OTA on a real node process: hot swap under load, automatic rollback, and a SIGKILL at every journal step."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgerun.ota.store import ModelStore
from tests.conftest import free_port
from tests.integration.jsonl import read_records
from tests.unit.test_ota_release import Fleet, head_variant

CRASH_STEPS = ["begin", "staged", "warmed", "trial", "commit", "done"]


class OtaNode:
    def __init__(
        self, tmp: Path, fleet: Fleet, state: Path, name: str, extra: str = "", control: Path | None = None, **ota
    ):
        self.jsonl = tmp / f"{name}.jsonl"
        self.stderr_path = tmp / f"{name}.log"
        settings = {
            "enabled": True,
            "state_dir": str(state),
            "root_keys": fleet.root_pub_paths,
            "watch_dir": str(fleet.release_dir),
            "poll_interval_s": 0.2,
            "health_window_s": 1.0,
            "latency_factor": 50.0,  # generous: a shared 2-core CI box is noisy
            **ota,
        }
        ota_toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
        cfg = tmp / f"{name}.toml"
        cfg.write_text(
            f"""[node]
id = "ota-node"
[source]
kind = "replay"
fps = 30
[pipeline]
policy = "block"
[sinks.jsonl]
path = "{self.jsonl}"
[service]
http_port = {free_port()}
[ota]
{ota_toml}
{extra}
"""
        )
        # control: the node's test-control socket (edgerun run --test-control), for injected faults
        self.control_path = control
        test_control = ["--test-control", str(control)] if control else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), *test_control],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr_path.open("w"),
        )

    def control(self, request: dict) -> dict:
        """One command on the test-control socket, once the node listens there."""
        assert self.control_path is not None
        self.wait_for("the test-control socket", self.control_path.exists)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10.0)
            sock.connect(str(self.control_path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            return json.loads(sock.makefile("rb").readline())

    def records(self) -> list[dict]:
        return read_records(self.jsonl)

    def batches(self) -> list[dict]:
        return [r for r in self.records() if r.get("schema") == "edgerun.detections/1"]

    def ota_events(self) -> list[dict]:
        return [r for r in self.records() if r.get("kind") == "ota"]

    def wait_for(self, what: str, predicate, timeout: float = 45.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited ({self.proc.returncode}) waiting for {what}: {self.log()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}: {self.log()[-3000:]}")

    def wait_step(self, step: str, timeout: float = 45.0) -> dict:
        self.wait_for(f"ota step {step}", lambda: any(e["step"] == step for e in self.ota_events()), timeout)
        return next(e for e in self.ota_events() if e["step"] == step)

    def log(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture
def nodes():
    started: list[OtaNode] = []

    def start(*args, **kwargs) -> OtaNode:
        node = OtaNode(*args, **kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(10)


@pytest.fixture(scope="module")
def v2_bundle(tmp_path_factory, blazeface_bundle):
    return head_variant(blazeface_bundle, tmp_path_factory.mktemp("v2") / "v2", 2)


def test_hot_swap_keeps_detecting_and_loses_no_frame(tmp_path, nodes, blazeface_bundle, v2_bundle):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    node = nodes(tmp_path, fleet, tmp_path / "state", "node")
    node.wait_for("20 batches on v1", lambda: len(node.batches()) >= 20)
    fleet.publish(v2_bundle, base=blazeface_bundle)
    node.wait_step("committed")
    seen = len(node.batches())
    node.wait_for("30 batches on v2", lambda: len(node.batches()) >= seen + 30)
    assert node.stop() == 0

    steps = [e["step"] for e in node.ota_events()]
    for step in ("accepted", "fetch", "patched", "verified", "begin", "staged", "warmed", "swapped", "committed"):
        assert step in steps, steps
    batches = node.batches()
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a frame was lost across the swap"
    versions = [b["model"]["version"] for b in batches]
    switch = versions.index(2)
    assert set(versions[:switch]) == {1} and set(versions[switch:]) == {2}
    assert any(b["detections"] for b in batches[switch:]), "no detections from the new model"
    summary = json.loads(node.log().split("stopped: ", 1)[1].splitlines()[0])
    assert summary["model_version"] == 2
    assert summary["dropped"] == 0 and summary["captured"] == summary["frames"]
    status = subprocess.run(
        [sys.executable, "-m", "edgerun", "ota", "status", "--state-dir", str(tmp_path / "state"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith("blazeface_short v2 in slot b (anti-rollback counter 2)")


def test_a_model_that_fails_its_health_window_is_rolled_back(tmp_path, nodes, v2_bundle):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    # Any new model is "too slow" against a factor this small: the rollback path, deterministically.
    node = nodes(tmp_path, fleet, tmp_path / "state", "node", latency_factor=0.001)
    node.wait_for("batches on v1", lambda: len(node.batches()) >= 10)
    fleet.publish(v2_bundle)
    event = node.wait_step("rolled_back")
    assert "inference p99" in event["reason"]
    seen = len(node.batches())
    node.wait_for("batches after the rollback", lambda: len(node.batches()) >= seen + 20)
    time.sleep(1.0)  # several polls: the version is not tried again
    assert node.stop() == 0
    versions = [b["model"]["version"] for b in node.batches()]
    assert 2 in versions and versions[-1] == 1
    assert [e["step"] for e in node.ota_events()].count("swapped") == 1
    store = ModelStore(tmp_path / "state")
    inst = store.installed()
    assert (inst.version, inst.rejected, inst.counter) == (1, [2], 1)
    assert store.check() == []


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_sigkill_at_every_journal_step_leaves_a_working_model(step, tmp_path, nodes, v2_bundle):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    state = tmp_path / "state"
    first = nodes(tmp_path, fleet, state, "first", control=tmp_path / "first.sock", health_window_s=0.5)
    assert first.control({"cmd": "ota_crash_at", "step": step})["ota_crash_at"] == step
    fleet.publish(v2_bundle)  # after the power cut is armed, so the first update meets it
    assert first.proc.wait(60) == -signal.SIGKILL, first.log()[-3000:]
    journal = ModelStore(state).journal_records()
    assert journal[-1]["step"] == step

    second = nodes(tmp_path, fleet, state, "second", health_window_s=0.5)
    second.wait_for("a batch after the restart", lambda: len(second.batches()) >= 1)
    version = second.batches()[0]["model"]["version"]
    expected = {"trial": 1, "commit": 2, "done": 2}.get(step, 1)
    assert version == expected, f"after a crash at {step!r} the node ran v{version}"
    assert second.stop() == 0
    store = ModelStore(state)
    assert store.check() == []
    inst = store.installed()
    if step == "trial":
        assert inst.rejected == [2] and inst.version == 1  # died while trying it: never again
    elif step in ("commit", "done"):
        assert inst.version == 2 and inst.previous.version == 1
    else:
        assert inst.version in (1, 2) and inst.rejected == []  # abandoned, then tried again after the restart


def test_update_over_mqtt(tmp_path, nodes, blazeface_bundle, v2_bundle):
    mosquitto = pytest.importorskip("edgerun.sinks.mosquitto")
    if mosquitto.find_mosquitto() is None:
        pytest.skip("mosquitto not installed (make system-deps)")
    from edgerun.ota.transport_mqtt import publish_release

    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    with mosquitto.run_mosquitto() as broker:
        mqtt = f'[sinks.mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'  # the broker; the sink stays off
        node = nodes(tmp_path, fleet, tmp_path / "state", "node", watch_dir="", mqtt=True, extra=mqtt)
        node.wait_for("batches on v1", lambda: len(node.batches()) >= 10)
        fleet.publish(v2_bundle, base=blazeface_bundle)
        publish_release(fleet.release_dir, "blazeface_short", broker.host, broker.port)
        node.wait_step("committed")
        assert "patched" in [e["step"] for e in node.ota_events()]
        assert node.stop() == 0
    assert ModelStore(tmp_path / "state").installed().version == 2

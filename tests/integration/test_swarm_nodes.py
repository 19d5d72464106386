"""Three real node processes as a swarm: gossip over UDP on loopback, fleet objects on a real mosquitto.

The drones fly one replayed scene (``edgerun.demo_swarm``'s layout: the same path a few metres
apart, so their views overlap) with protocol timers shrunk so the test is quick. What is checked
is what an operator relies on: every node sees the others with their metadata, a face seen by
several drones reaches the fleet topic once, and a drone that dies is declared dead by the rest
and comes back with a higher incarnation when it restarts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import tomli_w

from edgerun.demo_swarm import drone_configs, reports_per_truth, scene_frame, start_drones, stop_drones
from edgerun.sources.replay import ReplaySource
from tests.conftest import free_port
from tests.integration.brokers import collecting, run_mosquitto, wait_for

SCHEMA = Path(__file__).resolve().parents[2] / "edgerun" / "schema" / "object-v2.json"
FAST_TIMING = {
    "probe_interval_s": 0.3,
    "probe_timeout_s": 0.15,
    "gossip_interval_s": 0.1,
    "suspicion_mult": 3,
}


def healthz(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return {}


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        return resp.read().decode()


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def states(view: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {m["name"]: (m["state"], m["incarnation"]) for m in view.get("swarm", {}).get("members", [])}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swarm")
    with run_mosquitto() as broker:
        crew = drone_configs(tmp, 3, mqtt=f"127.0.0.1:{broker.port}")
        ports = {}
        for drone in crew:
            ports[drone.node_id] = free_port()
            drone.config["service"]["http_port"] = ports[drone.node_id]
            drone.config["swarm"]["timing"] = dict(FAST_TIMING)
            (drone.out_dir / "node.toml").write_text(tomli_w.dumps(drone.config))
        topics = ["edgerun/fleet/objects", "edgerun/+/events", "edgerun/+/swarm"]
        with collecting(broker.port, topics) as collector:
            start_drones(crew, seconds=120)
            try:
                yield crew, ports, collector
            finally:
                for drone in crew:
                    if drone.proc is not None and drone.proc.poll() is None:
                        drone.proc.send_signal(signal.SIGTERM)
                stop_drones(crew)


def test_members_converge_with_their_metadata(swarm):
    crew, ports, collector = swarm
    names = {d.node_id for d in crew}

    def converged() -> bool:
        for port in ports.values():
            members = healthz(port).get("swarm", {}).get("members", [])
            alive = {m["name"] for m in members if m["state"] == "alive"}
            with_pose = {m["name"] for m in members if (m.get("meta") or {}).get("east") is not None}
            if alive != names or with_pose != names:
                return False
        return True

    assert wait_for(converged, timeout=60), {n: states(healthz(p)) for n, p in ports.items()}
    member = healthz(ports["drone-1"])["swarm"]["members"][0]
    assert member["meta"]["model"] == "blazeface_short" and member["meta"]["engine"] == "tflite"
    text = metrics(ports["drone-2"])
    assert metric_value(text, 'edgerun_swarm_members{state="alive"}') == 3.0
    assert metric_value(text, 'edgerun_swarm_bytes_total{direction="out"}') > 0
    # The operator's command prints the same view from the node's config.
    out = subprocess.run(
        [sys.executable, "-m", "edgerun", "swarm", "members", "--config", str(crew[0].out_dir / "node.toml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert {r[0] for r in rows} == names and all(r[1] == "alive" for r in rows)
    # Joins were announced as swarm events, and each node keeps its view retained on the broker.
    joins = [e for e in collector.json_on("edgerun/drone-1/events") if e.get("kind") == "swarm"]
    assert {e["member"] for e in joins if e["change"] == "join"} >= names - {"drone-1"}
    assert wait_for(lambda: collector.on("edgerun/drone-3/swarm"), timeout=10)


def test_a_face_seen_by_several_drones_is_reported_once(swarm):
    crew, ports, collector = swarm
    source = ReplaySource(crew[0].replay)
    source.open()
    truth = source.scene.ground_points
    radius = crew[0].config["swarm"]["radius_m"]

    def seen_by_all_three() -> list[int]:
        """Scene faces that every drone has detected (from their JSONL detections and poses)."""
        from swarm.geo import CameraPose, project_boxes

        per_drone = []
        for drone in crew:
            near: set[int] = set()
            for line in drone.detections_path.read_text().splitlines()[-400:]:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("schema") != "edgerun.detections/1" or not row["detections"]:
                    continue
                p = row["pose"]
                cam = CameraPose(
                    p["east_m"], p["north_m"], p["up_m"], p["yaw_deg"], p["pitch_deg"], p["roll_deg"], p["hfov_deg"]
                )
                fixes = project_boxes(np.array([d["box"] for d in row["detections"]]), cam, 640, 480)
                for east, north, _ in fixes:
                    dist = np.hypot(truth[:, 0] - east, truth[:, 1] - north)
                    if dist.min() <= radius:
                        near.add(int(dist.argmin()))
            per_drone.append(near)
        return sorted(set.intersection(*per_drone))

    assert wait_for(lambda: len(seen_by_all_three()) >= 2, timeout=60, interval=1.0), seen_by_all_three()
    time.sleep(2.0)  # a few gossip intervals for any late report
    objects = collector.json_on("edgerun/fleet/objects")
    schema = json.loads(SCHEMA.read_text())
    for obj in objects:
        jsonschema.validate(obj, schema)
    by_id = {o["id"]: o for o in objects}
    per_truth = reports_per_truth(by_id, truth, radius, scene_frame(crew[0].replay))
    shared = seen_by_all_three()
    assert all(per_truth.get(i, 0) == 1 for i in shared), (shared, per_truth, by_id)
    assert all(n == 1 for n in per_truth.values()), per_truth
    # Every report was made by its owner alone: the owners' counters add up to the distinct objects.
    published = sum(metric_value(metrics(p), "edgerun_fleet_objects_total") or 0 for p in ports.values())
    assert published >= len(by_id)
    suppressed = sum(metric_value(metrics(p), "edgerun_dedup_suppressed_total") or 0 for p in ports.values())
    assert suppressed >= len(shared)  # the drones behind left every shared face to its owner


def test_a_killed_drone_is_declared_dead_and_rejoins_with_a_higher_incarnation(swarm):
    crew, ports, collector = swarm
    victim = crew[2]
    before = states(healthz(ports["drone-1"]))["drone-3"][1]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    survivors = [ports["drone-1"], ports["drone-2"]]
    assert wait_for(
        lambda: all(states(healthz(p)).get("drone-3", ("", 0))[0] == "dead" for p in survivors), timeout=60
    ), [states(healthz(p)) for p in survivors]
    deaths = [e for e in collector.json_on("edgerun/drone-1/events") if e.get("kind") == "swarm"]
    assert any(e["member"] == "drone-3" and e["change"] == "dead" for e in deaths)
    # Restart it with the same config: it rejoins and refutes its death with a higher incarnation.
    victim.log_file = (victim.out_dir / "node2.log").open("wb")
    victim.proc = subprocess.Popen(
        [sys.executable, "-m", "edgerun", "run", "-c", str(victim.out_dir / "node.toml"), "--seconds", "60"],
        stdout=subprocess.DEVNULL,
        stderr=victim.log_file,
        env=dict(os.environ),
    )

    def rejoined() -> bool:
        return all(
            states(healthz(p)).get("drone-3", ("", 0))[0] == "alive" and states(healthz(p))["drone-3"][1] > before
            for p in survivors
        )

    assert wait_for(rejoined, timeout=60), [states(healthz(p)) for p in survivors]


def test_a_bad_swarm_key_file_is_one_line_and_exit_2(tmp_path):
    for content, expect in ((None, "not found"), (b"c2hvcnQ=\n", "32"), (b"\xff\xfe garbage", "")):
        key = tmp_path / "swarm.key"
        if content is None:
            key.unlink(missing_ok=True)
        else:
            key.write_bytes(content)
        cfg = tmp_path / "node.toml"
        cfg.write_text(f'[swarm]\nenabled = true\nkey_file = "{key}"\n[sinks.jsonl]\npath = "{tmp_path}/d.jsonl"\n')
        proc = subprocess.run(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), "--seconds", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and lines[0].startswith("edgerun: error: swarm.key_file:"), proc.stderr
        assert expect in lines[0]


def test_swarm_timing_the_protocol_cannot_run_with_is_a_config_error(tmp_path):
    key = tmp_path / "swarm.key"
    subprocess.run([sys.executable, "-m", "edgerun", "swarm", "keygen", str(key)], check=True, capture_output=True)
    cfg = tmp_path / "node.toml"
    # 0.2 s is below the default ack timeout (0.25 s): a probe could never be answered in time
    cfg.write_text(f'[swarm]\nenabled = true\nkey_file = "{key}"\n[swarm.timing]\nprobe_interval_s = 0.2\n')
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "edgerun: error: swarm.timing: swarm timing probe_timeout_s: must not exceed probe_interval_s"
    )


def test_a_taken_swarm_port_is_one_line_and_exit_1(tmp_path):
    import socket

    key = tmp_path / "swarm.key"
    subprocess.run([sys.executable, "-m", "edgerun", "swarm", "keygen", str(key)], check=True, capture_output=True)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        cfg = tmp_path / "node.toml"
        cfg.write_text(
            f'[swarm]\nenabled = true\nbind = "127.0.0.1:{port}"\nkey_file = "{key}"\n'
            f'[sinks.jsonl]\npath = "{tmp_path}/d.jsonl"\n[service]\nhttp_port = 0\n'
        )
        proc = subprocess.run(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), "--seconds", "5"],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"edgerun: error: swarm.bind: cannot listen on 127.0.0.1:{port}: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_keygen_writes_a_key_only_the_group_can_read(tmp_path):
    from swarm.keyring import Keyring

    path = tmp_path / "swarm.key"
    proc = subprocess.run([sys.executable, "-m", "edgerun", "swarm", "keygen", str(path)], capture_output=True)
    assert proc.returncode == 0
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    assert len(Keyring.load(path).primary) == 32
    again = subprocess.run(
        [sys.executable, "-m", "edgerun", "swarm", "keygen", str(path)], capture_output=True, text=True
    )
    assert again.returncode == 2 and "exists" in again.stderr

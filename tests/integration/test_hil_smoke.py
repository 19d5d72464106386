"""``python -m hil run`` end to end: real mosquitto, real ``edgerun run --test-control`` nodes (in network
namespaces where they can be made), the observer, scoring and the report.

* ``smoke`` (2 nodes, 30 s, no faults) passes and leaves no namespace or process behind;
* a fault the scenario declares but that does not happen (the node ignores its control socket: a stand-in
  socket answers "ok" and does nothing) fails the run, and the last line says which fault and why.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tomli_w

from edgerun.sinks.mosquitto import find_mosquitto
from hil import netlab
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed (make system-deps)")


def hil_run(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hil", "run", *args, "--quiet"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_smoke_scenario_passes_and_cleans_up(tmp_path, blazeface_bundle):
    before = set(netlab.list_namespaces()) if netlab.unavailable_reason() is None else set()
    result = hil_run("smoke", "--out", str(tmp_path))
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert lines[-2] == f"report: {tmp_path / 'report.html'}"
    assert lines[-1].startswith("PASS smoke: all ")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == ("netns" if netlab.unavailable_reason() is None else "loopback")
    assert set(report["per_node"]) == {"drone-1", "drone-2"}
    for node in report["per_node"].values():
        assert node["batches"] >= 50 and node["unexpected_exits"] == 0
        assert node["loss"]["local"] >= node["batches"] and node["loss"]["unaccounted"] == 0
    # Both nodes saw each other alive through the swarm, as scraped from their /healthz.
    assert all(max(n for _, n in points) == 2 for points in report["series"]["alive_members"].values())
    assert report["fleet"]["fleet_objects"] > 0 and report["fleet"]["duplicate_reports"] == 0
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()
    if netlab.unavailable_reason() is None:
        assert set(netlab.list_namespaces()) <= before  # torn down
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps  # no node, broker or observer of this run left


def test_a_declared_fault_that_does_not_happen_fails_the_run(tmp_path, blazeface_bundle):
    scenario = {
        "name": "ignored",
        "duration_s": 14,
        "scene": {"fps": 5},
        "nodes": [{"id": "drone-1"}],
        "faults": [{"at_s": 3, "kind": "camera_loss", "node": "drone-1", "duration_s": 8}],
        "criteria": {"max_unexpected_exits": 0},
    }
    path = tmp_path / "ignored.toml"
    path.write_text(tomli_w.dumps(scenario))
    result = hil_run(str(path), "--out", str(tmp_path / "run"), "--ignore-control", "drone-1")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL ignored: 1 of ")
    assert (
        "fault 0 camera_loss drone-1 happened: no (drone-1 kept publishing batches after its camera was taken "
        "away (ignored the command))"
    ) in last
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["faults"][0]["happened"] is False


def test_a_real_board_is_observed_over_mqtt_and_http_only(tmp_path, blazeface_bundle):
    """A "board" given by address (here a local ``edgerun run`` the rig did not start, on a broker it does not own):
    observed through the broker and its /metrics; the faults it cannot take are listed, not failed."""
    from tests.conftest import free_port
    from tests.integration.brokers import run_mosquitto

    with run_mosquitto() as broker:
        http = free_port()
        board_cfg = tmp_path / "board.toml"
        board_cfg.write_text(
            tomli_w.dumps(
                {
                    "node": {"id": "board-1", "log_level": "warning"},
                    "source": {"kind": "replay", "fps": 5},
                    "sinks": {
                        "jsonl": {"path": str(tmp_path / "board.jsonl")},
                        "mqtt": {"enabled": True, "host": "127.0.0.1", "port": broker.port},
                    },
                    "service": {"http_port": http},
                }
            )
        )
        board = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(board_cfg)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            path = tmp_path / "bench.toml"
            path.write_text(
                tomli_w.dumps(
                    {
                        "name": "bench",
                        "duration_s": 10,
                        "broker": {"address": f"127.0.0.1:{broker.port}"},
                        "nodes": [{"id": "board-1", "address": f"http://127.0.0.1:{http}"}],
                        "faults": [
                            {"at_s": 2, "kind": "kill", "node": "board-1", "duration_s": 2},
                            {"at_s": 3, "kind": "broker_restart", "duration_s": 2},
                        ],
                        "criteria": {"min_batches_per_node": 10},
                    }
                )
            )
            result = hil_run(str(path), "--out", str(tmp_path / "run"))
        finally:
            board.terminate()
            board.wait(20)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["mode"] == "loopback"
    assert report["per_node"]["board-1"]["batches"] >= 10
    assert [line.split(":")[0] for line in report["not_injectable"]] == [
        "kill at 2 s on board-1",
        "broker_restart at 3 s on the fleet",
    ]
    rows = [json.loads(line) for line in (tmp_path / "run" / "observations.jsonl").read_text().splitlines()]
    assert any(r.get("scrape") == "board-1" and r.get("ok") and r["metrics"] for r in rows)  # /metrics, over HTTP

"""swarm-bench in a short form: 4 real members (namespaces where root allows, else loopback), and serf beside them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hil import netlab
from hil.swarm_bench import METRICS, format_table, ratios, run_swarm_bench
from swarm.suspicion import suspicion_timeout

REPO = Path(__file__).resolve().parents[2]
FAST = {
    "probe_interval_s": 0.2,
    "probe_timeout_s": 0.1,
    "gossip_interval_s": 0.05,
    "suspicion_mult": 3,
    "push_pull_interval_s": 2.0,
    "join_retry_s": 0.3,
    "tcp_timeout_s": 1.0,
}

pytestmark = pytest.mark.timeout(240)


def test_short_bench_measures_both_sides_and_tears_down():
    result = run_swarm_bench(
        4, 0.0, 1.0, timing=FAST, with_serf=shutil.which("serf") is not None, join_timeout_s=30, detect_timeout_s=30
    )
    ours = result["edgerun"]
    assert set(ours) == set(METRICS)
    assert ours["full_membership_s"] is not None and ours["detect_max_s"] is not None
    # full membership from the first spawn = the members' start-up + full membership from the last one up
    assert ours["agents_up_s"] > 0
    assert ours["full_membership_from_spawn_s"] == pytest.approx(
        ours["agents_up_s"] + ours["full_membership_s"], abs=0.002
    )
    # Nobody may declare the killed member dead before a suspicion of it could have timed out (no skipped suspicion).
    assert ours["detect_p50_s"] >= suspicion_timeout(FAST["suspicion_mult"], 4, FAST["probe_interval_s"])
    assert ours["false_deaths"] == 0
    assert ours["bytes_per_node_s"] > 0 and ours["cpu_percent_per_node"] is not None
    if result["mode"] == "loopback":
        assert any("loopback" in note for note in result["notes"])
    if "serf" in result:
        assert result["serf"]["detect_max_s"] is not None and result["serf"]["bytes_per_node_s"] is not None
        assert set(result["ratios"]) == set(METRICS)
    assert "edgerun/serf" in format_table(result)
    # Nothing left behind: the lab's namespaces are named after this process (others may run their own labs).
    assert [name for name in netlab.list_namespaces() if name.startswith(f"el{os.getpid()}x")] == []


def test_ratios_skip_missing_and_zero_anchors():
    got = ratios(
        {"full_membership_s": 1.0, "false_deaths": 0, "suspicions": 3},
        {"full_membership_s": 2.0, "false_deaths": 0, "suspicions": None},
    )
    assert got["full_membership_s"] == 0.5 and got["false_deaths"] is None and got["suspicions"] is None


def test_cli_rejects_bad_arguments_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hil", "swarm-bench", "--nodes", "2", "--json", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("hil swarm-bench: swarm-bench needs at least 3 nodes")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "hil", "swarm-bench", "--timing", "[1]"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2 and "--timing must be a JSON object" in proc.stderr
    proc = subprocess.run(  # --json is the stdout switch: it takes no FILE, and the check still runs
        [sys.executable, "-m", "hil", "swarm-bench", "--nodes", "2", "--json"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2 and "swarm-bench needs at least 3 nodes" in proc.stderr


def test_cli_writes_json_with_out_and_prints_it_with_the_json_switch(tmp_path):
    """``-o/--out FILE`` writes the result and ``--json`` prints it on stdout instead of the table, as for
    ``edgerun bench`` (docs/cli.md: one spelling per idea); the old ``--json FILE`` still writes FILE and stays
    out of ``--help``. A short real run: 3 members on loopback, edgerun's side only."""
    short = ["swarm-bench", "--nodes", "3", "--seconds", "1", "--only", "edgerun", "--loopback"]
    short += ["--join-timeout", "30", "--detect-timeout", "30", "--timing", json.dumps(FAST)]

    def hil(*argv: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "hil", *argv], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    new = tmp_path / "results" / "new.json"
    proc = hil(*short, "-o", str(new), "--json")
    written = json.loads(new.read_text())
    assert json.loads(proc.stdout) == written and f"wrote {new}" in proc.stderr
    assert written["nodes"] == 3 and written["edgerun"]["full_membership_s"] is not None
    old = tmp_path / "old.json"
    proc = hil(*short, "--json", str(old))
    assert json.loads(old.read_text())["nodes"] == 3
    assert "edgerun/serf" in proc.stdout and not proc.stdout.lstrip().startswith("{")  # the table, not the JSON
    usage = hil("swarm-bench", "--help").stdout
    assert "-o FILE, --out FILE" in usage and "--json FILE" not in usage and "[--json]" in usage


def test_loopback_fallback_uses_transport_loss_and_says_so():
    result = run_swarm_bench(
        3, 0.1, 1.0, timing=FAST, with_serf=False, force_loopback=True, join_timeout_s=30, detect_timeout_s=30
    )
    assert result["mode"] == "loopback" and result["impairment"] == "transport receive loss"
    assert any("loopback with the transport's own loss injection" in note for note in result["notes"])
    ours = result["edgerun"]
    assert ours["detect_max_s"] is not None and ours["bytes_per_node_s"] > 0

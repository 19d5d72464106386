"""The gossip cost of offload capabilities, in a short form: members carry edgerun's metadata in the swarm
simulator (swarm.memnet), published by the node's rule; the bench compares the variants in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgerun.bench.capabilities_gossip import QUIET, RULES, VARIANTS, MetadataSim, main, run_bench
from edgerun.fleet.member_meta import decode_meta
from swarm.sim import SimConfig


def test_members_see_each_others_capabilities_through_the_gossip() -> None:
    cfg = SimConfig(nodes=6, loss=0.1, seconds=40.0, seed=2, kill_at=None, meta_tick_s=1.0, drones=False)
    sim = MetadataSim(cfg, capabilities=True, rule=RULES["caps_5s_20pct"], meta_interval_s=2.0)
    sim.run()
    for host in sim.hosts:
        others = [m for m in host.membership.members() if m.name != host.membership.local_name]
        assert len(others) == 5
        for member in others:
            meta = decode_meta(member.meta)
            assert meta is not None and meta.serve_port == 7950 and meta.spare_fps > 0
    # capacity wanders +-50 % every second: each member publishes at start, then at most every 5 s (the rule)
    # and no later than the first 2 s check after that (6 s)
    assert 6 * (1 + 40 // 6 - 1) <= sim.meta_updates <= 6 * (1 + 40 // 5)


def test_under_the_nodes_rule_now_only_the_first_update_is_gossiped_and_the_quiet_ones_reach_everyone() -> None:
    cfg = SimConfig(nodes=6, loss=0.1, seconds=240.0, seed=2, kill_at=None, meta_tick_s=1.0, drones=False)
    sim = MetadataSim(cfg, capabilities=True, rule=None, meta_interval_s=2.0)
    sim.run()
    # each member's first metadata is urgent; then fps and capacity change within 30 s, so quiet every 30 s
    assert sim.meta_updates - sim.quiet_updates == 6
    assert 6 * (240 // 32 - 1) <= sim.quiet_updates <= 6 * (240 // 30)
    quiet = sim.spread(broadcast=False, settle_s=5 * cfg.timing.push_pull_interval_s)
    assert quiet["updates"] > 0 and quiet["unreached"] == 0
    # what gossip would do in well under a second takes push-pull rounds: proof nobody gossiped it
    assert quiet["median_s"] > 2.0 and quiet["max_s"] <= 5 * cfg.timing.push_pull_interval_s
    for host in sim.hosts:
        for member in host.membership.members():
            meta = decode_meta(member.meta)
            assert meta is not None and meta.serve_port == 7950 and meta.spare_fps in (5.0, 8.0, 12.0, 20.0, 30.0, 50.0)


def test_the_bench_compares_the_variants_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench(nodes=6, seconds=40.0, losses=(0.0,), scenarios=("static",))
    (run,) = result["runs"]
    cost = run["bytes_per_node_s"]
    assert set(cost) == set(VARIANTS)
    # metadata costs bytes, capacity every 5 s more than capacity that only rides along
    assert cost["none"] < cost["meta"] < cost["caps_ride_along"] < cost["caps_5s_20pct"]
    assert cost["none"] < cost[QUIET] < cost["meta"]  # the rule now: capabilities included, less than before
    updates = run["meta_updates_per_node_min"]
    assert updates["caps_ride_along"] == updates["meta"] < updates["caps_15s_50pct"] < updates["caps_5s_20pct"]
    assert run["meta_bytes_mean"]["caps_5s_20pct"] > run["meta_bytes_mean"]["meta"]
    assert set(result["within_budget"]) == set(VARIANTS)

    out = tmp_path / "caps.json"
    assert main(["--nodes", "4", "--seconds", "10", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == written
    assert [(r["scenario"], r["loss"]) for r in written["runs"]] == [
        ("drones", 0.0),
        ("drones", 0.1),
        ("static", 0.0),
        ("static", 0.1),
    ]

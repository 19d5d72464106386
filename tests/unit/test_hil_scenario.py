"""HIL scenario files: the shipped ones load; bad ones are one line naming the key path, and the command exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomli_w

from hil.scenario import ScenarioError, load_scenario, parse_scenario
from tests.conftest import REPO


def base(**extra):
    data = {
        "name": "t",
        "duration_s": 30,
        "nodes": [{"id": "a", "engines": ["hilaccel", "tflite"]}, {"id": "b"}],
        "faults": [],
    }
    data.update(extra)
    return data


def error_of(data) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data, source="s.toml")
    assert info.value.exit_code == 2
    text = str(info.value)
    assert "\n" not in text
    return text


def test_shipped_scenarios_load():
    smoke, sar = load_scenario("smoke"), load_scenario("sar-5")
    assert [n.id for n in smoke.nodes] == ["drone-1", "drone-2"] and smoke.faults == []
    assert len(sar.nodes) == 5 and sar.scene.targets == 15 and sar.duration_s == 180
    kinds = {f.kind for f in sar.faults}
    assert {"accelerator_hang", "partition", "broker_restart", "ota_release", "ota_power_cut", "kill"} <= kinds
    assert sar.criteria.min_object_recall == 0.95 and sar.criteria.max_duplicate_ratio == 0.05
    assert sar.criteria.max_dedup_losses == 0  # at least once: a face detected is a face reported
    borrow = load_scenario("offload-borrow")
    weak, *helpers = borrow.nodes
    assert weak.engines == ["hilaccel", "hilcpu"] and weak.cpu_delay_ms > 0 and weak.offload.mode == "auto"
    assert all(h.offload.serve and h.offload.mode == "never" for h in helpers)
    assert [f.kind for f in borrow.faults] == ["accelerator_exception"] and borrow.faults[0].node == weak.id
    assert borrow.criteria.min_offloaded_after_failover


def test_a_node_offload_section_reaches_its_config():
    """What a scenario says under a node's offload becomes its node config's [offload], which the node accepts."""
    from edgerun.config import parse_config
    from hil.rig import offload_section

    nodes = [{"id": "a", "offload": {"mode": "always", "codec": "zstd"}}, {"id": "b", "offload": {"serve": True}}]
    spec = parse_scenario(base(nodes=nodes))
    weak, helper = spec.nodes
    assert weak.offload.used and helper.offload.used and not parse_scenario(base()).nodes[1].offload.used
    assert offload_section(weak.offload) == {"mode": "always", "serve": False, "codec": "zstd"}
    swarm = {"enabled": True, "bind": "127.0.0.1:7946"}
    cfg = parse_config({"swarm": swarm, "offload": offload_section(weak.offload)})
    assert (cfg.offload.mode, cfg.offload.codec, cfg.offload.window) == ("always", "zstd", 4)  # window: the default
    assert "nodes[0].offload.mode: expected one of 'never', 'auto', 'always'" in error_of(
        base(nodes=[{"id": "a", "offload": {"mode": "sometimes"}}])
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"colour": 1}, "s.toml: colour: unknown key"),
        ({"faults": [{"at_s": 1, "kind": "meteor"}]}, "s.toml: faults[0].kind: expected one of"),
        (
            {"faults": [{"at_s": 1, "kind": "kill", "node": "a", "duration_s": 2, "when": 3}]},
            "s.toml: faults[0].when: unknown key",
        ),
        ({"duration_s": -1}, "s.toml: duration_s: expected float > 0.0, got -1"),
        ({"scene": {"origin": [95.0, 8.0]}}, "s.toml: scene.origin: expected [latitude, longitude] in degrees"),
        ({"nodes": [{"id": "a"}, {"id": "a"}]}, "s.toml: nodes[1].id: 'a' is used twice"),
        (
            {"faults": [{"at_s": 1, "kind": "kill", "node": "zz", "duration_s": 2}]},
            "s.toml: faults[0].node: expected one of 'a', 'b', got 'zz'",
        ),
        (
            {"faults": [{"at_s": 1, "kind": "accelerator_hang", "node": "b", "duration_s": 2}]},
            "s.toml: faults[0].node: 'b' has no 'hilaccel' in its engines to fault",
        ),
        (
            {"faults": [{"at_s": 40, "kind": "broker_restart", "duration_s": 2}]},
            "s.toml: faults[0].at_s: 40 is not within the scenario's 30 s",
        ),
        (
            {"faults": [{"at_s": 1, "kind": "kill", "node": "a"}]},
            "s.toml: faults[0].duration_s: a kill fault needs a duration > 0",
        ),
        (
            {"faults": [{"at_s": 1, "kind": "partition", "groups": [["a"]], "duration_s": 3}]},
            "s.toml: faults[0].groups: expected two or more non-empty groups",
        ),
        (
            {"faults": [{"at_s": 1, "kind": "partition", "groups": [["a"], ["a", "b"]], "duration_s": 3}]},
            "s.toml: faults[0].groups: a node is in two groups",
        ),
        (
            {
                "faults": [
                    {"at_s": 5, "kind": "ota_power_cut", "node": "a", "step": "staged"},
                    {"at_s": 2, "kind": "ota_release"},
                ]
            },
            "s.toml: faults[0].at_s: a power cut at an OTA step must be armed before an ota_release fault",
        ),
        (
            {
                "faults": [
                    {"at_s": 1, "kind": "ota_power_cut", "node": "a", "step": "lunch"},
                    {"at_s": 2, "kind": "ota_release"},
                ]
            },
            "s.toml: faults[0].step: expected one of 'begin'",
        ),
        (
            {"nodes": [{"id": "a", "address": "http://10.0.0.9:8089"}]},
            "s.toml: broker.address: real boards need the broker they publish to",
        ),
        ({"network": {"loss_percent": 140}}, "s.toml: network.loss_percent: expected float <= 100.0, got 140"),
    ],
)
def test_bad_scenarios_name_the_key(change, expected):
    assert error_of(base(**change)).startswith(expected)


def test_a_bad_scenario_file_exits_2_in_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(base(faults=[{"at_s": 1, "kind": "kill", "node": "q", "duration_s": 1}])))
    result = subprocess.run(
        [sys.executable, "-m", "hil", "run", str(path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hil run: error: {path}: faults[0].node: expected one of 'a', 'b', got 'q'"
    ]
    assert not (tmp_path / "out").exists()  # nothing started

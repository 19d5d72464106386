"""deploy/observability: Prometheus config and alert rules through promtool (with a unit test per alert), and
the Grafana dashboard's and the alerts' queries against the metrics a really running node exports."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ruamel.yaml import YAML

from edgerun.config import Config
from edgerun.service import metrics as metrics_module
from tests.conftest import free_port
from tests.deploy.conftest import DEPLOY, wait_http

OBS = DEPLOY / "observability"
RULES = OBS / "edgerun-alerts.yml"
RULE_TESTS = OBS / "tests/edgerun-alerts.test.yml"
DASHBOARD = OBS / "grafana-dashboard.json"

# Exported once [swarm] is wired into the node (the lead adds them with it); checked only from then on.
SWARM_METRICS = [
    "edgerun_swarm_members",
    "edgerun_swarm_members_missing",
    "edgerun_swarm_packets_dropped_total",
    "edgerun_swarm_bytes_total",
    "edgerun_fleet_objects_total",
    "edgerun_dedup_suppressed_total",
]
# Wired = the config has a [swarm] section and the metrics collector knows swarm metrics. The section alone
# arrives before the metrics do. When this turns true, the node below must export every name above: enable
# [swarm] in NODE_TOML if the collector only shows them for a node in a swarm.
SWARM_WIRED = "swarm" in {f.name for f in msgspec.structs.fields(Config)} and "edgerun_swarm_" in (
    Path(metrics_module.__file__).read_text()
)
# Series Prometheus makes itself, not the node.
PROMETHEUS_SERIES = {"up"}

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus)")


def promtool(*args: str, cwd: Path = OBS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def yaml_load(path: Path):
    return YAML(typ="safe").load(path.read_text())


def alert_names() -> set[str]:
    return {rule["alert"] for group in yaml_load(RULES)["groups"] for rule in group["rules"]}


@needs_promtool
def test_rules_and_scrape_config_pass_promtool_check():
    proc = promtool("check", "rules", RULES.name)
    assert proc.returncode == 0 and "SUCCESS: 7 rules found" in proc.stdout, proc.stdout + proc.stderr
    proc = promtool("check", "config", "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_issue_alerts_are_there():
    assert alert_names() == {
        "EdgerunNodeDown",
        "EdgerunDegraded",
        "EdgerunOnFallbackTooLong",
        "EdgerunFpsBelowExpected",
        "EdgerunOtaRollback",
        "EdgerunSwarmMembersMissing",
        "EdgerunBrokerUnreachable",
    }


@needs_promtool
def test_every_alert_has_a_passing_unit_test():
    tests = yaml_load(RULE_TESTS)["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert tested == alert_names()
    proc = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


@needs_promtool
def test_the_unit_tests_catch_a_broken_rule(tmp_path):
    """The promtool tests can fail: the same tests against a rule with a wrong threshold do."""
    shutil.copytree(OBS, tmp_path / "obs")
    rules = tmp_path / "obs/edgerun-alerts.yml"
    rules.write_text(rules.read_text().replace("edgerun_fps < 10", "edgerun_fps < 3"))
    proc = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path / "obs/tests")
    assert proc.returncode != 0 and "EdgerunFpsBelowExpected" in proc.stdout + proc.stderr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (edgerun_* and the few Prometheus series)."""
    names = set(re.findall(r"\b(edgerun_[a-z0-9_]+)\b", expr))
    names |= {name for name in PROMETHEUS_SERIES if re.search(rf"\b{name}\{{", expr)}
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [var["query"]["query"] for var in dashboard["templating"]["list"] if var["type"] == "query"]
    return exprs


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "edgerun-fleet"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
    assert {name for expr in dashboard_exprs() for name in metric_names(expr)} >= set(SWARM_METRICS)


NODE_TOML = """
[node]
id = "metrics-node"
[source]
kind = "replay"
fps = 30
[sinks.jsonl]
path = "{jsonl}"
[sinks.mqtt]
enabled = true
port = {mqtt_port}
reconnect_max_s = 1.0
[service]
http_port = {port}
[ota]
enabled = true
state_dir = "{state}"
root_keys = ["{root_key}"]
watch_dir = "{releases}"
"""


@pytest.fixture(scope="module")
def node_metrics(tmp_path_factory, blazeface_bundle) -> set[str]:
    """Sample names on a real node's /metrics: replay source, JSONL + MQTT sinks (no broker), OTA on."""
    from edgerun.ota.minisign import SecretKey

    tmp = tmp_path_factory.mktemp("metrics-node")
    (tmp / "releases").mkdir()
    root_key = tmp / "root.pub"
    root_key.write_text(SecretKey.generate().public_key.to_text())
    port = free_port()
    config = tmp / "node.toml"
    text = NODE_TOML.format(
        jsonl=tmp / "d.jsonl", mqtt_port=free_port(), port=port, state=tmp / "state", root_key=root_key,
        releases=tmp / "releases",
    )  # fmt: skip
    if SWARM_WIRED:  # a one-member swarm on loopback, so the swarm metrics exist
        from swarm.keyring import encode_key, generate_key

        (tmp / "swarm.key").write_text(encode_key(generate_key()) + "\n")
        text += f'[swarm]\nenabled = true\nbind = "127.0.0.1:0"\nkey_file = "{tmp / "swarm.key"}"\n'
    config.write_text(text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgerun", "run", "-c", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "stderr", "w"),
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", 90, proc)
        deadline = time.monotonic() + 30
        while True:  # until frames have flowed through every stage (histograms and counters all present)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            families = list(text_string_to_metric_families(text))
            samples = {s.name: s.value for f in families for s in f.samples}
            if samples.get("edgerun_frames_inferred_total", 0) > 0 and "edgerun_ota_rolled_back_versions" in samples:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # A labelled family with no series yet (no frame dropped so far) is declared by its TYPE line: it counts.
    declared = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    return set(samples) | declared


def check_names(exprs: list[str], exported: set[str]) -> list[str]:
    missing = []
    for expr in exprs:
        for name in metric_names(expr) - PROMETHEUS_SERIES:
            if name in SWARM_METRICS and not SWARM_WIRED:
                continue
            if name not in exported:
                missing.append(f"{name} (in {expr!r})")
    return missing


def test_dashboard_queries_name_metrics_the_node_exports(node_metrics):
    assert not check_names(dashboard_exprs(), node_metrics)


def test_alert_rules_name_metrics_the_node_exports(node_metrics):
    exprs = [rule["expr"] for group in yaml_load(RULES)["groups"] for rule in group["rules"]]
    assert not check_names(exprs, node_metrics)


def test_the_check_catches_a_metric_the_node_does_not_export(node_metrics):
    assert check_names(["rate(edgerun_frames_inferred_total[1m])"], node_metrics) == []
    assert check_names(["rate(edgerun_frames_infered_total[1m])"], node_metrics) == [
        "edgerun_frames_infered_total (in 'rate(edgerun_frames_infered_total[1m])')"
    ]

"""Every alert in deploy/observability/edgerun-alerts.yml, through ``promtool test rules``, on what a real node's
/metrics said during real faults.

One run: a "watcher" node (replay camera at 15 fps, the ``hilaccel`` stand-in accelerator before the CPU engine,
MQTT to a real mosquitto, OTA from a release directory, gossip with a second real node, ``--test-control``), and
faults one after another: a model update that fails its health window, the peer node SIGKILLed, the accelerator
wedged, the broker killed, the camera unplugged, the watcher SIGKILLed. The test scrapes /metrics once a second
as Prometheus would (``up`` is 0 when a scrape fails), and writes the samples as promtool ``input_series`` at
their one-second spacing. The scrapes of a fault last seconds and an alert waits minutes (``for: 30m``), so each
phase ends with its last scraped state held for 40 minutes: gauges repeat their last value, counters go on at the
rate scraped over the phase's last seconds. That hold is the only written part; it is a steady state the node was
seen in, not a guess. Each alert must be silent at the end of the hold before its fault and firing after it.

The faults are injected the way the HIL rig injects them (edgerun/testing/control.py: the accelerator's FaultPlan
and the camera switch); the update, the peer, the broker and the watcher are real and really fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from ruamel.yaml import YAML

from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.testing.ports import free_port, free_tcp_udp_port
from tests.deploy.conftest import DEPLOY, wait_http

pytest.importorskip("nacl", reason="PyNaCl (the swarm's crypto) not installed")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus)"),
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
]

RULES = DEPLOY / "observability/edgerun-alerts.yml"
SCRAPE_S = 1  # one scrape a second; also the promtool series' interval
EVAL_S = 15  # Prometheus' usual rule evaluation interval
HOLD_S = 40 * 60  # longer than any rule's `for` plus its range window (30m + 5m)
SETTLE_SCRAPES = 3  # scrapes taken after a phase's state is reached; the last is the one held
PHASE_TIMEOUT_S = 90.0

# The phase whose fault each alert answers (the phases run in this order).
ALERT_PHASE = {
    "EdgerunOtaRollback": "update rolled back",
    "EdgerunSwarmMembersMissing": "peer killed",
    "EdgerunDegraded": "accelerator wedged",
    "EdgerunOnFallbackTooLong": "accelerator wedged",
    "EdgerunBrokerUnreachable": "broker killed",
    "EdgerunFpsBelowExpected": "camera unplugged",
    "EdgerunNodeDown": "watcher killed",
}


@dataclass
class Phase:
    name: str
    scrapes: list[dict[str, float] | None] = field(default_factory=list)  # None: the scrape failed


def scrape(port: int) -> dict[str, float] | None:
    """The node's samples keyed as PromQL series selectors, or None when it does not answer (``up`` = 0)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.8) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ", ".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def value(samples: dict[str, float] | None, selector: str) -> float | None:
    return None if samples is None else samples.get(selector)


class Watcher:
    """The node under watch, its peer, the broker, and the scrapes taken so far."""

    def __init__(self, tmp: Path, broker, release) -> None:
        from swarm.keyring import encode_key, generate_key

        self.tmp, self.broker, self.release = tmp, broker, release
        self.port = free_port()
        self.control_path = tmp / "control.sock"
        self.watch_dir = tmp / "watch"  # the release appears here (renamed in whole) as the update fault
        key = tmp / "swarm.key"
        key.write_text(encode_key(generate_key()) + "\n")
        swarm_a, swarm_b = f"127.0.0.1:{free_tcp_udp_port()}", f"127.0.0.1:{free_tcp_udp_port()}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.start("peer", f"""[node]
id = "peer"
[source]
kind = "replay"
fps = 2
[model]
bundle = "{release.v1.root}"
[sinks.jsonl]
path = "{tmp / "peer.jsonl"}"
[service]
http_port = {free_port()}
[swarm]
enabled = true
bind = "{swarm_b}"
seeds = ["{swarm_a}"]
key_file = "{key}"
""")  # fmt: skip
        self.start("watcher", f"""[node]
id = "watcher"
[source]
kind = "replay"
fps = 15
[model]
bundle = "{release.v1.root}"
[engine]
order = ["hilaccel", "tflite"]
hang_deadline_ms = 500
reprobe_min_s = 0.5
reprobe_max_s = 2.0
state_dir = "{tmp / "engine-state"}"
[sinks.jsonl]
path = "{tmp / "watcher.jsonl"}"
[sinks.mqtt]
enabled = true
port = {broker.port}
reconnect_max_s = 1.0
[service]
http_port = {self.port}
stall_s = 30.0
[ota]
enabled = true
state_dir = "{tmp / "ota-state"}"
root_keys = ["{release.root_pub}"]
watch_dir = "{self.watch_dir}"
poll_interval_s = 0.5
health_window_s = 2.0
latency_factor = 0.001
[swarm]
enabled = true
bind = "{swarm_a}"
key_file = "{key}"
""", "--test-control", str(self.control_path))  # fmt: skip
        # latency_factor 0.001: any new model is "too slow", so the update is rolled back (the OTA tests' way).
        self.phases: list[Phase] = []

    def start(self, name: str, config: str, *extra: str) -> None:
        path = self.tmp / f"{name}.toml"
        path.write_text(config)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(path), *extra],
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / f"{name}.log").open("w"),
            env=env,
        )

    def log(self, name: str = "watcher") -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def control(self, request: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10.0)
            sock.connect(str(self.control_path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(sock.makefile("rb").readline())
        assert answer.get("ok"), answer
        return answer

    def phase(self, name: str, reached: Callable[[dict[str, float] | None], bool]) -> Phase:
        """Scrape once a second until ``reached`` holds, then SETTLE_SCRAPES more, all of which must hold it."""
        phase = Phase(name)
        self.phases.append(phase)
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        next_at = time.monotonic()
        settled = 0
        while settled < SETTLE_SCRAPES + 1:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += SCRAPE_S
            samples = scrape(self.port)
            phase.scrapes.append(samples)
            if reached(samples):
                settled += 1
            else:
                assert not settled, f"{name}: the state came and went again: {samples}"
                assert time.monotonic() < deadline, f"{name}: not reached in {PHASE_TIMEOUT_S} s: {self.log()}"
        return phase

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def settled_running(s: dict[str, float] | None) -> bool:
    """Serving at the camera's pace, healthy, connected, both swarm members alive."""
    return (
        value(s, 'edgerun_health_state{state="running"}') == 1
        and (value(s, "edgerun_fps{}") or 0) >= 12
        and value(s, 'edgerun_sink_connected{sink="mqtt"}') == 1
        and value(s, 'edgerun_swarm_members{state="alive"}') == 2
    )


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> Watcher:
    from hil.fleet_release import prepare_fleet_release

    tmp = tmp_path_factory.mktemp("alerts")
    release = prepare_fleet_release(tmp / "release")
    with run_mosquitto() as broker:
        watcher = Watcher(tmp, broker, release)
        try:
            wait_http(f"http://127.0.0.1:{watcher.port}/healthz", 90, watcher.procs["watcher"])
            watcher.phase("baseline", settled_running)

            os.rename(release.release_dir, watcher.watch_dir)
            watcher.phase(
                "update rolled back",
                lambda s: value(s, "edgerun_ota_rolled_back_versions{}") == 1 and settled_running(s),
            )

            watcher.procs["peer"].kill()
            # Until gossip has forgotten the dead peer (gossip_to_the_dead_s, 30 s): the state the alert used to lose.
            watcher.phase(
                "peer killed",
                lambda s: (
                    value(s, "edgerun_swarm_members_missing{}") == 1
                    and value(s, 'edgerun_swarm_members{state="dead"}') == 0
                    and value(s, 'edgerun_swarm_members{state="suspect"}') == 0
                    and value(s, 'edgerun_health_state{state="running"}') == 1
                ),
            )

            watcher.control({"cmd": "accelerator", "mode": "hang"})
            watcher.phase(
                "accelerator wedged",
                lambda s: (
                    value(s, 'edgerun_engine_active{engine="tflite"}') == 1
                    and value(s, 'edgerun_health_state{state="degraded"}') == 1
                    and (value(s, "edgerun_fps{}") or 0) >= 12
                    and value(s, 'edgerun_sink_connected{sink="mqtt"}') == 1
                ),
            )

            broker.kill()
            watcher.phase("broker killed", lambda s: value(s, 'edgerun_sink_connected{sink="mqtt"}') == 0)

            watcher.control({"cmd": "camera", "present": False})
            watcher.phase("camera unplugged", lambda s: (value(s, "edgerun_fps{}") or 0) < 1)

            watcher.procs["watcher"].kill()
            watcher.phase("watcher killed", lambda s: s is None)
        finally:
            watcher.stop()
    return watcher


def rule_series(phases: list[Phase]) -> set[str]:
    """Every scraped series whose metric an alert rule reads."""
    rules = YAML(typ="safe").load(RULES.read_text())
    names = {n for g in rules["groups"] for r in g["rules"] for n in re.findall(r"\b(edgerun_[a-z_]+)", r["expr"])}
    return {key for p in phases for s in p.scrapes if s for key in s if key.split("{")[0] in names}


def number(v: float) -> str:
    return repr(int(v)) if v == int(v) else repr(v)


def series_values(phases: list[Phase], key: str) -> tuple[str, list[int]]:
    """promtool's values for one series over all phases (scrapes then the hold), and each phase's start (s)."""
    parts, starts, t = [], [], 0
    is_counter = key.split("{")[0].endswith("_total")
    offset = 0.0  # what the holds so far added to a counter: later scrapes go on from there, not reset
    for phase in phases:
        starts.append(t)
        got = [None if s is None or key not in s else s[key] + offset for s in phase.scrapes]
        parts += ["_" if v is None else number(v) for v in got]
        t += len(got)
        last = got[-1]
        if last is None:
            parts.append(f"_x{HOLD_S}")  # `_xn` is n blanks; `a+bxn` is n+1 values
        else:
            tail = [v for v in got[-SETTLE_SCRAPES - 1 :] if v is not None]
            step = round((tail[-1] - tail[0]) / (len(tail) - 1), 6) if is_counter and len(tail) > 1 else 0.0
            parts.append(f"{number(last + step)}+{number(step)}x{HOLD_S - 1}")
            offset += step * HOLD_S
        t += HOLD_S
    return " ".join(parts), starts


def promtool_test(phases: list[Phase], instance: str) -> dict:
    """The promtool unit test: each alert silent at the end of the hold before its phase, firing after it."""
    series = []
    for key in sorted(rule_series(phases)):
        values, starts = series_values(phases, key)
        selector = key.replace("{", f'{{instance="{instance}", job="edgerun", ', 1).replace(", }", "}")
        series.append({"series": selector, "values": values})
    up_parts = []  # 1 for a scrape that answered, as Prometheus writes it
    for phase in phases:
        ups = ["0" if s is None else "1" for s in phase.scrapes]
        up_parts += [*ups, f"{ups[-1]}x{HOLD_S - 1}"]
    up = " ".join(up_parts)
    series.append({"series": f'up{{instance="{instance}", job="edgerun"}}', "values": up})
    starts = dict(zip([p.name for p in phases], starts))
    rules = {r["alert"]: r for g in YAML(typ="safe").load(RULES.read_text())["groups"] for r in g["rules"]}
    cases = []
    for alert, phase_name in ALERT_PHASE.items():
        rule = rules[alert]
        start = starts[phase_name]
        fired_at = start + duration_s(rule.get("for", "0s")) + 5 * 60
        fired_at -= fired_at % EVAL_S
        phase = next(p for p in phases if p.name == phase_name)
        silent_at = start - 1 - (start - 1) % EVAL_S  # within the hold of the phase before
        cases.append({"eval_time": f"{silent_at}s", "alertname": alert, "exp_alerts": []})
        cases.append({
            "eval_time": f"{fired_at}s", "alertname": alert,
            "exp_alerts": [expected_alert(rule, instance, phase.scrapes[-1])],
        })  # fmt: skip
    return {
        "rule_files": [str(RULES)],
        "evaluation_interval": f"{EVAL_S}s",
        "tests": [{"name": "scraped faults", "interval": f"{SCRAPE_S}s", "input_series": series,
                   "alert_rule_test": cases}],
    }  # fmt: skip


def duration_s(text: str) -> int:
    return int(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def expected_alert(rule: dict, instance: str, last: dict[str, float] | None) -> dict:
    """The alert's labels (the selected series' own, as the rule keeps them) and its annotations rendered."""
    expr = rule["expr"]
    labels = {"instance": instance, **rule["labels"]}
    if not expr.startswith("sum by"):
        labels["job"] = "edgerun"
    selector = re.search(r"\b(edgerun_\w+|up)(\{[^}]*\})?", expr)
    assert selector is not None
    if selector.group(2):
        labels.update(re.findall(r'(\w+)="([^"]*)"', selector.group(2)))
    metric = selector.group(1)
    shown = None
    if last is not None:
        shown = next((v for k, v in last.items() if k.split("{")[0] == metric), None)

    def render(text: str) -> str:
        text = text.replace("{{ $labels.instance }}", instance)
        if shown is not None:
            text = text.replace("{{ $value }}", number(shown))
            text = text.replace('{{ $value | printf "%.1f" }}', f"{shown:.1f}")
        return text

    return {"exp_labels": labels, "exp_annotations": {k: render(v) for k, v in rule["annotations"].items()}}


def test_every_alert_fires_on_its_scraped_fault_and_not_before(scraped, tmp_path):
    instance = f"127.0.0.1:{scraped.port}"
    assert set(ALERT_PHASE) == {r["alert"] for g in YAML(typ="safe").load(RULES.read_text())["groups"]
                                for r in g["rules"]}  # fmt: skip
    test_file = tmp_path / "scraped.test.yml"
    with test_file.open("w") as f:
        YAML().dump(promtool_test(scraped.phases, instance), f)
    proc = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-6000:]


def test_a_dead_member_stays_missing_after_gossip_forgets_it(scraped):
    """The state the old rule (suspect + dead in edgerun_swarm_members) read as 0 within ~30 s of a kill."""
    last = next(p for p in scraped.phases if p.name == "peer killed").scrapes[-1]
    assert value(last, "edgerun_swarm_members_missing{}") == 1
    assert value(last, 'edgerun_swarm_members{state="dead"}') == 0
    assert value(last, 'edgerun_swarm_members{state="alive"}') == 1  # itself


def test_the_scraped_test_catches_a_rule_that_cannot_fire(scraped, tmp_path):
    """The same scrapes against the rule as it was (dead members counted only while gossip remembers them) fail."""
    rules = tmp_path / "edgerun-alerts.yml"
    text = RULES.read_text().replace(
        "expr: edgerun_swarm_members_missing > 0",
        'expr: sum by (instance) (edgerun_swarm_members{state=~"suspect|dead"}) > 0',
    )
    assert text != RULES.read_text()
    rules.write_text(text)
    test = promtool_test(scraped.phases, f"127.0.0.1:{scraped.port}")
    test["rule_files"] = [str(rules)]
    test_file = tmp_path / "old.test.yml"
    with test_file.open("w") as f:
        YAML().dump(test, f)
    proc = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "EdgerunSwarmMembersMissing" in proc.stdout + proc.stderr, proc.stdout[-3000:]

"""The ground station end to end: real mosquitto, three real node processes, the station, headless Chromium.

The operator logs in through the station's form first (--users). Checks on the page itself: the nodes and their
positions appear, fleet objects appear, a SIGKILLed node
turns dead (the broker's last will), and a halt issued on the page (with its confirmation) stops a
rollout: a node in the rollout's cohort that comes back after the halt stays on the old model while a
node of the same cohort that was up took the new one.

The three drones fly one replayed scene as a swarm (the demo's layout: the same path a few metres
apart, gossiping under one key), so the fleet objects on the page are the ones their dedup reported.

Set ``EDGERUN_STATION_SCREENSHOT=docs/station.png`` to keep the page's screenshot (the picture in docs/station.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from edgerun.demo_swarm import DEMO_RADIUS_M, SIDE_STEP_M, SPACING_M, write_swarm_key
from edgerun.ota.manifest import cohort_position
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.station.auth import set_password
from edgerun.testing.ports import free_tcp_udp_port
from tests.conftest import free_port
from tests.integration.brokers import REPO, Collector, collecting, wait_for
from tests.integration.station_rig import CHROMEDRIVER, browser, submit_login  # noqa: F401 (browser: a fixture)
from tests.unit.test_ota_release import Fleet, head_variant

NODES = ("drone-1", "drone-2", "drone-3")
OPERATOR, PASSWORD = "alice", "correct horse battery"
OBJECT_SCHEMA = REPO / "edgerun" / "schema" / "object-v2.json"

pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
    pytest.mark.skipif(
        not Path(CHROMEDRIVER).exists() or not (shutil.which("chromium")),
        reason="Debian's chromium and chromium-driver are not installed",
    ),
]


def cohort_salt() -> str:
    """A salt that puts drone-1 and drone-3 inside a 50 % rollout and drone-2 outside it."""
    for i in range(10_000):
        salt = f"station-test-{i}"
        pos = {n: cohort_position(salt, n) for n in NODES}
        if pos["drone-1"] < 50 and pos["drone-3"] < 50 and pos["drone-2"] >= 50:
            return salt
    raise AssertionError("no salt found")


class Node:
    def __init__(self, tmp: Path, index: int, broker_port: int, fleet: Fleet, swarm: dict[str, Any]) -> None:
        self.name = name = NODES[index]
        self.http_port = free_port()
        self.log_path = tmp / f"{name}.log"
        self.config = tmp / f"{name}.toml"
        roots = json.dumps(fleet.root_pub_paths)
        seeds = json.dumps([f"127.0.0.1:{p}" for j, p in enumerate(swarm["ports"]) if j != index])
        self.config.write_text(f"""[node]
id = "{name}"
[source]
kind = "replay"
fps = 5
[source.replay]
seed = 1
path_offset_m = {-SPACING_M * index}
east_offset_m = {SIDE_STEP_M[index]}
[swarm]
enabled = true
bind = "127.0.0.1:{swarm["ports"][index]}"
seeds = {seeds}
key_file = "{swarm["key"]}"
radius_m = {DEMO_RADIUS_M}
labels = ["face"]
share_sightings = true
[engine]
replicas = 1
num_threads = 1
[sinks.mqtt]
enabled = true
host = "127.0.0.1"
port = {broker_port}
metrics_interval_s = 1.0
keepalive_s = 5
[service]
http_port = {self.http_port}
[ota]
enabled = true
state_dir = "{tmp / (name + "-state")}"
root_keys = {roots}
mqtt = true
poll_interval_s = 0.5
health_window_s = 1.0
latency_factor = 50.0
""")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("a"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]


@pytest.fixture
def rig(tmp_path, blazeface_bundle):
    """Broker, keys, three nodes and the station (with the release signing key); torn down whatever happens."""
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    key_file = tmp_path / "release.key"
    key_file.write_text(fleet.release_keys[0].to_text())
    users = tmp_path / "station-users"
    set_password(users, OPERATOR, PASSWORD)
    nodes: list[Node] = []
    station = None
    with run_mosquitto() as broker:
        try:
            station_port = free_port()
            station_log = tmp_path / "station.log"
            swarm = {"key": tmp_path / "swarm.key", "ports": [free_tcp_udp_port() for _ in NODES]}
            write_swarm_key(swarm["key"])
            for index in range(len(NODES)):
                nodes.append(Node(tmp_path, index, broker_port=broker.port, fleet=fleet, swarm=swarm))
            station = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "edgerun",
                    "station",
                    "--mqtt",
                    f"127.0.0.1:{broker.port}",
                    "--bind",
                    f"127.0.0.1:{station_port}",
                    "--signing-key",
                    str(key_file),
                    "--root-key",
                    fleet.root_pub_paths[0],
                    "--users",
                    str(users),
                    "--truth",
                    "replay:1",
                    "--root-key",
                    fleet.root_pub_paths[0],
                    "--ground",
                    "replay:1",
                    "--stale-s",
                    "6",
                    "--no-auto-halt",
                    "--node-http",
                    f"drone-1=127.0.0.1:{nodes[0].http_port}",
                ],
                stdout=station_log.open("w"),
                stderr=subprocess.STDOUT,
            )
            yield {
                "broker": broker,
                "fleet": fleet,
                "key_file": key_file,
                "nodes": {n.name: n for n in nodes},
                "url": f"http://127.0.0.1:{station_port}/",
                "station_log": station_log,
                "tmp": tmp_path,
            }
        finally:
            for node in nodes:
                node.kill()
            if station is not None and station.poll() is None:
                station.terminate()
                try:
                    station.wait(10)
                except subprocess.TimeoutExpired:
                    station.kill()


DRONES_JS = """return [...document.querySelectorAll('g.drone')].map(g => ({id: g.dataset.id, state: g.dataset.state,
  east: +g.dataset.east, north: +g.dataset.north}));"""
ROWS_JS = """return [...document.querySelectorAll('#nodes tbody tr[data-id]')].map(r => ({id: r.dataset.id,
  state: r.dataset.state, model: r.querySelector('.model').textContent.trim(),
  fps: r.querySelector('.fps').textContent}));"""
OBJECTS_JS = """return [...document.querySelectorAll('g.object')].map(g => ({id: g.dataset.id, label: g.dataset.label,
  owner: g.dataset.owner, seen: +g.dataset.seen}));"""
EVENTS_JS = "return [...document.querySelectorAll('#events tbody tr')].map(r => r.textContent.replace(/\\s+/g, ' '));"
ROLLOUT_JS = """const r = document.querySelector('.rollout[data-model="blazeface_short"]');
  return r ? {phase: r.dataset.phase, percent: +r.dataset.percent, text: r.textContent} : null;"""


def page(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def text_of(driver: Any, element_id: str) -> str | None:
    """An element's rendered text, found and read in one script call: nothing is held across a re-render."""
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : null;", element_id
    )


def until(driver: Any, what: str, predicate, rig: dict, timeout: float = 90.0) -> None:
    if not wait_for(predicate, timeout, 0.25):
        logs = "\n".join(f"--- {n.name}\n{n.log()}" for n in rig["nodes"].values())
        raise AssertionError(
            f"page never showed {what}; rows {page(driver, ROWS_JS)}; "
            f"events {page(driver, EVENTS_JS)[:15]}\n{logs}\n--- station\n"
            f"{rig['station_log'].read_text()[-2000:]}"
        )


def rows(driver: Any) -> dict[str, dict]:
    return {r["id"]: r for r in page(driver, ROWS_JS)}


def click_halt(driver: Any) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    selector = '.rollout[data-model="blazeface_short"] button[data-act="halt"]'

    def halt(d: Any) -> bool:
        d.find_element(By.CSS_SELECTOR, selector).click()  # found afresh at every try
        return True

    # The rollout panel is redrawn when its figures change: a button found before a redraw is stale.
    WebDriverWait(driver, 10, ignored_exceptions=(StaleElementReferenceException,)).until(halt)
    alert = WebDriverWait(driver, 10).until(expected_conditions.alert_is_present())
    assert "HALT the rollout of blazeface_short v2" in alert.text
    alert.accept()


@pytest.mark.timeout(420)
def test_station_page_shows_the_fleet_marks_the_dead_and_halts_a_rollout(rig, browser, tmp_path, blazeface_bundle):  # noqa: F811

    driver = browser
    broker_port = rig["broker"].port
    # Every fleet object the drones report, from before their first frame (QoS 1, not retained).
    reported = Collector(broker_port, ["edgerun/fleet/objects"]).start()
    until(driver, "the station answering", lambda: _get_ok(driver, rig["url"]), rig, 60)
    log_in(driver, rig)

    # -- nodes and their positions ------------------------------------------------------------------------
    with collecting(broker_port, ["edgerun/+/detections"]) as seen:
        until(
            driver,
            "three running nodes",
            lambda: sum(r["state"] == "running" for r in rows(driver).values()) == 3,
            rig,
            120,
        )
        until(driver, "three drones on the map", lambda: len(page(driver, DRONES_JS)) == 3, rig)

        def latest_poses() -> dict[str, dict]:
            poses = {}
            for message in seen.snapshot():
                doc = json.loads(message.payload)
                poses[doc["node"]] = doc["pose"]
            return poses

        # The page may show all three before this subscriber heard each drone once (a CI run on a busy
        # machine did): wait for a frame from each, then compare page and broker at one moment.
        until(driver, "a frame from every drone on the broker", lambda: set(latest_poses()) == set(NODES), rig, 30)
        drones = {d["id"]: d for d in page(driver, DRONES_JS)}
        latest = latest_poses()
    assert set(drones) == set(NODES) == set(latest)
    for name, drone in drones.items():
        assert 0 < drone["east"] < 40 and 0 < drone["north"] < 40, drone
        # the drone flies 1.5 m/s; the page lags the broker by at most a few updates
        assert abs(drone["east"] - latest[name]["east_m"]) < 6 and abs(drone["north"] - latest[name]["north_m"]) < 6
    assert len({(round(d["east"]), round(d["north"])) for d in drones.values()}) == 3
    assert all(r["model"] == "blazeface_short v1" for r in rows(driver).values())
    assert page(driver, "return document.querySelectorAll('rect.truth').length") > 0
    assert page(driver, "return document.querySelectorAll('polygon.footprint').length") == 3
    assert page(driver, "return +document.getElementById('scalebar').dataset.metres") > 0

    # -- fleet objects, reported by the drones' own dedup ------------------------------------------------
    until(driver, "fleet objects on the page", lambda: len(page(driver, OBJECTS_JS)) >= 2, rig, 120)
    before = {o["id"] for o in reported.json_on("edgerun/fleet/objects")}
    time.sleep(1.0)  # the page refreshes a few times a second: it has caught up with ``before``
    shown = {o["id"]: o for o in page(driver, OBJECTS_JS)}
    time.sleep(1.0)  # ... and the broker has long delivered whatever the page shows
    messages = reported.json_on("edgerun/fleet/objects")
    reported.stop()
    objects = {o["id"]: o for o in messages}  # the latest message of each object
    assert before, "no fleet object reached the broker"
    schema = json.loads(OBJECT_SCHEMA.read_text())
    for obj in messages:
        jsonschema.validate(obj, schema)
    assert before <= set(shown) <= set(objects), (before, shown, objects)  # every report reaches the page
    seen_counts: dict[str, set[int]] = {}  # an owner publishes again when more drones saw its object
    for message in messages:
        seen_counts.setdefault(message["id"], set()).add(len(message["seen_by"]))
    for oid, page_obj in shown.items():
        assert (page_obj["label"], page_obj["owner"]) == ("face", objects[oid]["owner"])
        assert page_obj["seen"] in seen_counts[oid]
    assert {o["owner"] for o in shown.values()} <= set(NODES)

    # -- snapshot on click: live from a node with a known address ---------------------------------------
    driver.execute_script("document.querySelector('#nodes tbody tr[data-id=\"drone-1\"]').click()")
    until(
        driver,
        "drone-1's live snapshot",
        lambda: page(driver, "return document.getElementById('snapshot').dataset.kind") == "live",
        rig,
        30,
    )

    # -- a SIGKILLed node turns dead (the broker publishes its will) ------------------------------------
    rig["nodes"]["drone-3"].kill()
    until(driver, "drone-3 dead", lambda: rows(driver).get("drone-3", {}).get("state") == "dead", rig, 60)
    assert page(driver, "return document.querySelector('g.drone[data-id=\"drone-3\"]').dataset.state") == "dead"
    assert any("drone-3" in e and "last will" in e for e in page(driver, EVENTS_JS))
    driver.execute_script("document.querySelector('#nodes tbody tr[data-id=\"drone-3\"]').click()")
    until(
        driver,
        "drone-3's last boxes",
        lambda: page(driver, "return document.getElementById('snapshot').dataset.kind") == "boxes",
        rig,
        30,
    )

    # -- a rollout to drone-1 and drone-3's cohort, halted on the page ---------------------------------
    salt = cohort_salt()
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    publish = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgerun",
            "fleet",
            "publish",
            str(v2.root),
            "--percent",
            "50",
            "--salt",
            salt,
            "--keys",
            str(rig["fleet"].release_dir),
            "--signing-key",
            str(rig["key_file"]),
            "--base",
            str(blazeface_bundle.root),
            "--mqtt",
            f"127.0.0.1:{broker_port}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert publish.returncode == 0, publish.stderr
    assert "published blazeface_short v2 to 50% of the fleet" in publish.stdout
    assert "the fleet runs blazeface_short v1 on 2 node(s)" in publish.stdout  # drone-3 is dead
    until(driver, "the canary on the page", lambda: (page(driver, ROLLOUT_JS) or {}).get("phase") == "canary", rig)
    until(driver, "drone-1 on v2", lambda: rows(driver)["drone-1"]["model"] == "blazeface_short v2", rig, 120)
    until(
        driver,
        "drone-2 outside the cohort",
        lambda: any("drone-2" in e and "not_in_rollout" in e for e in page(driver, EVENTS_JS)),
        rig,
    )
    assert rows(driver)["drone-2"]["model"] == "blazeface_short v1"

    click_halt(driver)
    until(driver, "the rollout halted", lambda: (page(driver, ROLLOUT_JS) or {}).get("phase") == "halted", rig)
    assert (page(driver, ROLLOUT_JS) or {})["percent"] == 0
    assert "halted by the operator" in page(driver, ROLLOUT_JS)["text"]
    until(
        driver,
        "the halt in the event log, with who did it",
        lambda: any(f"halted at 0% by operator:{OPERATOR}" in e for e in page(driver, EVENTS_JS)),
        rig,
        30,
    )
    time.sleep(1.0)  # a second delta would bring a duplicate (the station hears its own event on the broker)
    assert sum("halted at 0% by operator" in e for e in page(driver, EVENTS_JS)) == 1
    shot = os.environ.get("EDGERUN_STATION_SCREENSHOT")  # docs/station.md's picture: a dead node, a halted canary
    driver.save_screenshot(str(Path(shot) if shot else tmp_path / "station.png"))

    # drone-3 is in the 50 % cohort (like drone-1, which took v2) and comes back after the halt
    rig["nodes"]["drone-3"].start()
    until(
        driver,
        "drone-3 back and refusing the halted release",
        lambda: any("drone-3" in e and "not_in_rollout" in e and "0%" in e for e in page(driver, EVENTS_JS)),
        rig,
        120,
    )
    until(driver, "drone-3 running", lambda: rows(driver)["drone-3"]["state"] == "running", rig, 60)
    assert rows(driver)["drone-3"]["model"] == "blazeface_short v1"
    assert rows(driver)["drone-1"]["model"] == "blazeface_short v2"

    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgerun",
            "fleet",
            "status",
            "--json",
            "--seconds",
            "2.5",
            "--mqtt",
            f"127.0.0.1:{broker_port}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    versions = {n["id"]: n["model_version"] for n in report["nodes"]}
    assert versions == {"drone-1": 2, "drone-2": 1, "drone-3": 1}
    assert report["rollouts"]["blazeface_short"]["phase"] == "halted"

    # -- roll back: v1's model ships as v3 to the whole fleet ------------------------------------------
    rollback = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgerun",
            "fleet",
            "rollback",
            "--to",
            str(blazeface_bundle.root),
            "--keys",
            str(rig["fleet"].release_dir),
            "--signing-key",
            str(rig["key_file"]),
            "--root-key",
            rig["fleet"].root_pub_paths[0],
            "--mqtt",
            f"127.0.0.1:{broker_port}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rollback.returncode == 0, rollback.stderr
    assert "published blazeface_short v3 (the model of v1) to 100% of the fleet" in rollback.stdout
    until(
        driver,
        "every node on v3",
        lambda: {r["model"] for r in rows(driver).values()} == {"blazeface_short v3"},
        rig,
        150,
    )
    # The page's rollout box follows the station's once-a-second rollout watch, which may trail the nodes' metrics.
    until(
        driver, "the v3 rollout complete", lambda: (page(driver, ROLLOUT_JS) or {}).get("phase") == "complete", rig, 30
    )


def log_in(driver: Any, rig: dict) -> None:
    """The station wants an operator: the page sends the browser to the login form, which brings it back."""
    assert driver.current_url.endswith("/login"), driver.current_url
    submit_login(driver, OPERATOR, PASSWORD)
    until(driver, "the page after logging in", lambda: driver.title == "edgerun ground station", rig, 30)
    until(
        driver,
        "the operator's name",
        lambda: page(driver, "return document.getElementById('who').textContent") == f"operator {OPERATOR}",
        rig,
        30,
    )


def _get_ok(driver: Any, url: str) -> bool:
    try:
        driver.get(url)
    except Exception:
        return False
    return "edgerun ground station" in driver.title


def test_actions_are_refused_without_the_signing_key_or_a_confirmation(tmp_path):
    """A read-only station answers 403 to a halt; any station wants the confirmation header (400)."""
    import urllib.error
    import urllib.request

    with run_mosquitto() as broker:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgerun",
                "station",
                "--mqtt",
                f"127.0.0.1:{broker.port}",
                "--bind",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "station.log").open("w"),
            text=True,
        )
        try:
            assert "read-only (no --signing-key)" in proc.stdout.readline()

            def post(headers: dict[str, str]) -> tuple[int, dict]:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/api/rollouts/m/halt", data=b"{}", headers=headers, method="POST"
                )
                try:
                    with urllib.request.urlopen(request, timeout=10) as r:
                        return r.status, json.loads(r.read())
                except urllib.error.HTTPError as err:
                    return err.code, json.loads(err.read())

            assert post({})[0] == 400
            code, body = post({"X-Edgerun-Confirm": "m"})
            assert code == 403 and "read-only" in body["error"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/snapshot", timeout=10) as r:
                snap = json.loads(r.read())
            assert snap["read_only"] is True
        finally:
            proc.terminate()
            proc.wait(10)

"""The fleet's release path attacked through the broker, end to end: real mosquitto, a real node, the real station.

The attacker is an anonymous MQTT client (the broker's documented default): it can retain anything on
``edgerun/fleet/releases/<model>``. Two attacks the station used to let through:

* a forged release (signed by the attacker's own key, with the fleet's real ``keys.json`` attached): the page
  showed it as a canary, and *promote* on the page or ``edgerun fleet promote`` re-signed it with the real
  release key, so the nodes installed the attacker's model;
* a recorded *promote* replayed after a *halt* while a node was offline: the node refused the halt as
  ``not_in_rollout``, then took the replayed promote.

Each is refused at every step: the page marks the release and refuses the action (HTTP 409), the CLI exits 2
with one line, the retained bytes stay the attacker's (nothing was signed), and the node refuses it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from edgerun.ota.minisign import SecretKey
from edgerun.ota.release import ReleaseSpec, build_release
from edgerun.ota.transport_mqtt import publish_release, release_topic
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.conftest import free_port
from tests.integration.brokers import collecting, wait_for
from tests.unit.test_ota_release import Fleet, head_variant

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")

MODEL = "blazeface_short"
NODE = "victim-1"


def node_config(tmp: Path, broker_port: int, fleet: Fleet) -> Path:
    config = tmp / "node.toml"
    config.write_text(f"""[node]
id = "{NODE}"
[source]
kind = "replay"
fps = 5
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
http_port = {free_port()}
[ota]
enabled = true
state_dir = "{tmp / "node-state"}"
root_keys = {json.dumps(fleet.root_pub_paths)}
mqtt = true
poll_interval_s = 0.5
health_window_s = 1.0
latency_factor = 50.0
""")
    return config


class Rig:
    def __init__(self, tmp: Path, broker: Any, fleet: Fleet, key_file: Path) -> None:
        self.tmp, self.broker, self.fleet, self.key_file = tmp, broker, fleet, key_file
        self.mqtt = f"127.0.0.1:{broker.port}"
        self.procs: list[subprocess.Popen[Any]] = []
        self.station_port = free_port()

    def start_node(self) -> subprocess.Popen[Any]:
        config = node_config(self.tmp, self.broker.port, self.fleet)
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / "node.log").open("a"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs.append(proc)
        return proc

    def start_station(self) -> None:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgerun",
                "station",
                "--mqtt",
                self.mqtt,
                "--bind",
                f"127.0.0.1:{self.station_port}",
                "--signing-key",
                str(self.key_file),
                "--root-key",
                self.fleet.root_pub_paths[0],
                "--no-auto-halt",
            ],
            stdout=subprocess.PIPE,
            stderr=(self.tmp / "station.log").open("w"),
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        assert "rollout actions signed by release key" in proc.stdout.readline()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def fleet_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "edgerun", "fleet", *args, "--mqtt", self.mqtt],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def publish(self, bundle: Path, percent: float) -> None:
        """``edgerun fleet publish`` as the operator runs it (the station is not asked what the fleet runs)."""
        done = self.fleet_cli(
            "publish",
            str(bundle),
            "--percent",
            f"{percent:g}",
            "--keys",
            str(self.fleet.release_dir),
            "--signing-key",
            str(self.key_file),
            "--fleet-seconds",
            "0",
        )
        assert done.returncode == 0, done.stderr

    def signed_step(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.fleet_cli(*args, "--signing-key", str(self.key_file), "--root-key", self.fleet.root_pub_paths[0])

    def rollout(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.station_port}/api/snapshot"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read()).get("rollouts", {}).get(MODEL, {})

    def page_action(self, action: str, percent: float) -> tuple[int, dict[str, Any]]:
        origin = f"http://127.0.0.1:{self.station_port}"
        request = urllib.request.Request(
            f"{origin}/api/rollouts/{MODEL}/{action}",
            data=json.dumps({"percent": percent}).encode(),
            method="POST",
            headers={"X-Edgerun-Confirm": MODEL, "Content-Type": "application/json", "Origin": origin},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def retained_release(self) -> bytes:
        from edgerun.fleet.rollout import read_topics

        return read_topics("127.0.0.1", self.broker.port, [release_topic(MODEL)])[release_topic(MODEL)]

    def retain(self, payload: bytes) -> None:
        """An anonymous client retains ``payload`` on the release topic (what any broker user can do)."""
        import paho.mqtt.publish as publish

        publish.single(release_topic(MODEL), payload, qos=1, retain=True, hostname="127.0.0.1", port=self.broker.port)


def page_rollout(port: int) -> dict[str, Any] | None:
    """The rollout box as headless Chromium renders it (None where Debian's chromium is not installed)."""
    import shutil

    if not Path("/usr/bin/chromedriver").exists() or not shutil.which("chromium"):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(f"http://127.0.0.1:{port}/")
        script = f"""const box = document.querySelector('.rollout[data-model="{MODEL}"]');
            return box ? {{trust: box.dataset.trust || "", buttons: box.querySelectorAll("button").length,
                           text: box.innerText}} : null;"""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = driver.execute_script(script)
            if found is not None:
                return found
            time.sleep(0.2)
        raise AssertionError("the page never showed the release")
    finally:
        driver.quit()


def ota_events(collector: Any) -> list[dict[str, Any]]:
    out = []
    for message in collector.messages:
        if message.topic == f"edgerun/{NODE}/events":
            doc = json.loads(message.payload)
            if doc.get("kind") == "ota":
                out.append(doc)
    return out


def model_version(collector: Any) -> int | None:
    for message in reversed(collector.messages):
        if message.topic == f"edgerun/{NODE}/metrics":
            return json.loads(message.payload).get("summary", {}).get("model_version")
    return None


@pytest.fixture
def rig(tmp_path):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    key_file = tmp_path / "release.key"
    key_file.write_text(fleet.release_keys[0].to_text())
    with run_mosquitto() as broker:
        rig = Rig(tmp_path, broker, fleet, key_file)
        try:
            yield rig
        finally:
            rig.stop()


def test_a_forged_release_is_never_shown_signed_or_installed(rig, blazeface_bundle, tmp_path):
    # The attacker builds a "v99" of its own, signed by its own key, with the fleet's real keys.json beside it.
    attacker = SecretKey.generate()
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    for name in ("keys.json", "keys.json.minisig"):
        (evil_dir / name).write_bytes((rig.fleet.release_dir / name).read_bytes())
    evil = head_variant(blazeface_bundle, tmp_path / "v99", 99, seed=7)
    build_release(evil.root, evil_dir, ReleaseSpec(rollout_percent=10.0, rollout_salt="evil"), key=attacker)
    with collecting(rig.broker.port, [f"edgerun/{NODE}/#"]) as seen:
        rig.start_node()
        rig.start_station()
        publish_release(evil_dir, MODEL, "127.0.0.1", rig.broker.port)  # anonymous, like any broker user
        forged_bytes = rig.retained_release()

        # 1. The page shows it as forged, with the node's own reason, and no cohort.
        assert wait_for(lambda: rig.rollout().get("trust") == "forged", 30), rig.rollout()
        view = rig.rollout()
        assert view["trust_code"] == "unknown_key" and "signed by unknown key" in view["trust_reason"]
        assert view["verified"] is False and view["cohort"] == {}
        page = page_rollout(rig.station_port)
        if page is not None:  # Debian's chromium: what the operator sees is FORGED and no button to press
            assert page["trust"] == "forged" and page["buttons"] == 0, page
            assert "FORGED" in page["text"] and "signed by unknown key" in page["text"], page

        # 2. Promote on the page: 409, one line, nothing signed.
        status, body = rig.page_action("promote", 100)
        assert status == 409, body
        assert "forged" in body["error"] and "\n" not in body["error"]
        # ... and halt: refused the same way (the station signs nothing about bytes it did not verify).
        assert rig.page_action("halt", 0)[0] == 409

        # 3. The CLI: exit 2, one line naming why.
        for args in (("promote", "--percent", "100"), ("halt",)):
            done = rig.signed_step(*args)
            assert done.returncode == 2, done.stderr
            assert done.stderr.strip().count("\n") == 0 and "forged" in done.stderr, done.stderr
        # Without the root keys the CLI will not act at all.
        done = rig.fleet_cli("promote", "--percent", "100", "--signing-key", str(rig.key_file))
        assert done.returncode == 2 and "--root-key is required" in done.stderr

        # 4. The broker still holds the attacker's bytes, never re-signed by the release key.
        assert rig.retained_release() == forged_bytes
        assert wait_for(
            lambda: any(e.get("step") == "rejected" and e.get("code") == "unknown_key" for e in ota_events(seen)), 60
        ), ota_events(seen)
        assert wait_for(lambda: model_version(seen) is not None, 60)
        time.sleep(2.0)
        assert model_version(seen) == 1
        assert not any(e.get("step") in ("accepted", "committed") for e in ota_events(seen))

        # fleet status marks it too.
        status_out = rig.fleet_cli("status", "--seconds", "2", "--root-key", rig.fleet.root_pub_paths[0])
        assert status_out.returncode == 0, status_out.stderr
        assert f"release {MODEL} v99: FORGED, not a release" in status_out.stdout


def test_a_promote_replayed_after_a_halt_is_refused_by_node_and_station(rig, blazeface_bundle, tmp_path):
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    # The node is offline while the operator publishes v2 to the whole fleet, then halts it.
    rig.start_station()
    rig.publish(v2.root, 100)
    promote = rig.retained_release()  # what an attacker records
    done = rig.signed_step("halt", "--reason", "bad canary")
    assert done.returncode == 0, done.stderr
    assert wait_for(lambda: rig.rollout().get("phase") == "halted", 30), rig.rollout()

    with collecting(rig.broker.port, [f"edgerun/{NODE}/#"]) as seen:
        rig.start_node()
        # The node sees the halt first (not in its 0 % cohort) and keeps it.
        assert wait_for(lambda: any(e.get("code") == "not_in_rollout" for e in ota_events(seen)), 90), ota_events(seen)
        steps = json.loads((tmp_path / "node-state" / "trust" / "steps.json").read_text())
        assert steps[MODEL]["2"] == {"halted": True, "step": 1}

        rig.retain(promote)  # the recorded promote, replayed by an anonymous client
        assert wait_for(lambda: any(e.get("code") == "replayed" for e in ota_events(seen)), 60), ota_events(seen)
        rejected = next(e for e in ota_events(seen) if e.get("code") == "replayed")
        assert "rollout step 0 is older than step 1 already verified" in rejected["reason"]
        time.sleep(2.0)
        assert model_version(seen) == 1
        assert not any(e.get("step") in ("accepted", "committed") for e in ota_events(seen))

    # The station, which saw the halt, calls the replay what it is and will not promote it.
    assert wait_for(lambda: rig.rollout().get("trust") == "replayed", 30), rig.rollout()
    status, body = rig.page_action("promote", 100)
    assert status == 409 and "replayed" in body["error"], body
    done = rig.signed_step("promote", "--percent", "100")
    assert done.returncode == 2 and "replayed" in done.stderr, done.stderr
    assert rig.retained_release() == promote


def test_a_halted_release_is_not_promoted_again(rig, blazeface_bundle, tmp_path):
    """A halt is final for its version: the station and the CLI say to publish a new version instead."""
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    rig.start_station()
    rig.publish(v2.root, 10)
    assert wait_for(lambda: rig.rollout().get("trust") == "verified", 30), rig.rollout()
    status, body = rig.page_action("halt", 0)
    assert status == 200, body
    assert wait_for(lambda: rig.rollout().get("phase") == "halted", 30), rig.rollout()
    status, body = rig.page_action("promote", 50)
    assert status == 409 and "publish a new version" in body["error"], body
    done = rig.signed_step("promote", "--percent", "50")
    assert done.returncode == 2 and "publish a new version" in done.stderr, done.stderr


def test_swapped_payload_chunks_on_the_broker_stop_a_promote(rig, blazeface_bundle, tmp_path):
    """The manifest is real, the payload chunks on the broker are the attacker's: promote is refused before any
    node is asked to download them (the nodes would refuse the hash too)."""
    import hashlib

    import paho.mqtt.publish as publish

    from edgerun.ota.manifest import parse_manifest
    from edgerun.ota.transport_mqtt import decode_release, file_topic

    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    rig.start_station()
    rig.publish(v2.root, 10)
    target = parse_manifest(decode_release(rig.retained_release(), "t").manifest).target
    evil = bytes(target.size)  # the signed size, other bytes; an index that agrees with them
    chunk = 64 * 1024
    chunks = [evil[i : i + chunk] for i in range(0, len(evil), chunk)]
    messages = [
        {"topic": file_topic(MODEL, target.file, str(i)), "payload": c, "qos": 1, "retain": True}
        for i, c in enumerate(chunks)
    ]
    index = {"size": len(evil), "chunk_size": chunk, "chunks": [hashlib.sha256(c).hexdigest() for c in chunks]}
    messages.append(
        {"topic": file_topic(MODEL, target.file, "index"), "payload": json.dumps(index), "qos": 1, "retain": True}
    )
    publish.multiple(messages, hostname="127.0.0.1", port=rig.broker.port)
    before = rig.retained_release()

    done = rig.signed_step("promote", "--percent", "100")
    assert done.returncode == 2, done.stderr
    assert "hash" in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    status, body = rig.page_action("promote", 100)
    assert status == 409 and "hash" in body["error"], body
    assert rig.retained_release() == before  # still the 10 % step: nothing was signed


def test_a_release_past_its_signed_expiry_is_refused_by_node_and_station_alike(rig, blazeface_bundle, tmp_path):
    """A release signed 40 days ago with the default 30-day expiry (a lapsed release, or one an attacker keeps
    retained to freeze the fleet): the node's updater refuses it as ``expired``; the station must not show it as
    a verified release either, but EXPIRED with the node's reason, no button, 409 on the page and FORGED in
    ``fleet status`` (before, it was shown and promotable as a canary until a node refused it)."""
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    signed_at = time.time() - 40 * 86400
    release = build_release(
        v2.root, rig.fleet.release_dir, ReleaseSpec(rollout_percent=100.0), key=rig.fleet.release_keys[0], now=signed_at
    )
    expired_at = release.manifest.expires
    with collecting(rig.broker.port, [f"edgerun/{NODE}/#"]) as seen:
        rig.start_node()
        rig.start_station()
        publish_release(rig.fleet.release_dir, MODEL, "127.0.0.1", rig.broker.port)
        lapsed_bytes = rig.retained_release()

        assert wait_for(lambda: any(e.get("code") == "expired" for e in ota_events(seen)), 90), ota_events(seen)
        node_said = next(e for e in ota_events(seen) if e.get("code") == "expired")
        assert f"manifest v2 expired at {expired_at}" in node_said["reason"], node_said

        assert wait_for(lambda: rig.rollout().get("trust_code") == "expired", 30), rig.rollout()
        view = rig.rollout()
        assert view["trust"] == "forged" and view["verified"] is False and view["cohort"] == {}, view
        assert f"manifest v2 expired at {expired_at}" in view["trust_reason"], view
        page = page_rollout(rig.station_port)
        if page is not None:  # Debian's chromium: the reason, and no button to press
            assert page["buttons"] == 0 and f"expired at {expired_at}" in page["text"], page
            assert "EXPIRED" in page["text"] and "FORGED" not in page["text"], page  # lapsed, not forged

        status, body = rig.page_action("promote", 100)
        assert status == 409 and "expired at" in body["error"], body
        done = rig.signed_step("promote", "--percent", "100")
        assert done.returncode == 2 and "expired at" in done.stderr, done.stderr
        assert rig.retained_release() == lapsed_bytes  # nothing was re-signed
        status_out = rig.fleet_cli("status", "--seconds", "2", "--root-key", rig.fleet.root_pub_paths[0])
        assert status_out.returncode == 0, status_out.stderr
        assert f"release {MODEL} v2: FORGED, not a release: manifest v2 expired at {expired_at}" in status_out.stdout
        assert model_version(seen) == 1

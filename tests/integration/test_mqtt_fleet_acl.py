"""The shipped fleet broker config (deploy/mosquitto) on a real mosquitto: TLS, one credential per identity, the ACL.

The broker runs deploy/mosquitto/edgerun-fleet.conf with only its listener moved to a free port on 127.0.0.1
and its file paths pointed at this test's files: the ACL file is the shipped one, unchanged; the password
file is made by deploy/mqtt-credential.sh; the TLS certificates by the test PKI (brokers.make_certs).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from edgerun.errors import ConfigError
from edgerun.sinks.mosquitto import give_to_broker_user
from edgerun.tomlfile import load_toml
from tests.integration.brokers import find_mosquitto, free_port, make_certs, wait_for

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONF = REPO / "deploy" / "mosquitto" / "edgerun-fleet.conf"
SHIPPED_ACL = REPO / "deploy" / "mosquitto" / "edgerun-fleet.acl"
CREDENTIAL = REPO / "deploy" / "mqtt-credential.sh"
ETC = "/etc/mosquitto/edgerun/"

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(find_mosquitto() is None or shutil.which("mosquitto_passwd") is None,
                       reason="mosquitto is not installed (.ci/install-system-deps)"),
]  # fmt: skip


@dataclass
class FleetBroker:
    port: int
    workdir: Path
    ca: Path
    credentials: dict[str, tuple[str, str]] = field(default_factory=dict)  # identity -> (username, password)
    process: subprocess.Popen[bytes] | None = None

    def add(self, *args: str) -> tuple[str, str]:
        """Run deploy/mqtt-credential.sh against this broker's password file; the [sinks.mqtt] lines it made."""
        snippet = self.workdir / f"cred-{len(self.credentials)}.toml"
        proc = subprocess.run(
            ["bash", str(CREDENTIAL), "-f", str(self.workdir / "passwd"), "-o", str(snippet), *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert snippet.stat().st_mode & 0o077 == 0  # the password is for its owner only
        give_to_broker_user([self.workdir / "passwd"])  # rewritten by mosquitto_passwd: the broker rereads it
        mqtt_cfg = load_toml(snippet, ConfigError, "credential snippet")["sinks"]["mqtt"]
        self.credentials[mqtt_cfg["username"]] = (mqtt_cfg["username"], mqtt_cfg["password"])
        return mqtt_cfg["username"], mqtt_cfg["password"]

    def reload(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGHUP)  # mosquitto rereads the password and ACL files


def fleet_config(shipped: str, port: int, workdir: Path) -> str:
    """The shipped config with its listener on a free loopback port and its files in ``workdir``."""
    shipped = "\n".join(line for line in shipped.splitlines() if not line.startswith("#")) + "\n"
    listeners = [line for line in shipped.splitlines() if line.startswith("listener ")]
    assert listeners == ["listener 8883"], listeners  # one TLS listener, nothing in plain text
    text = shipped.replace("listener 8883", f"listener {port} 127.0.0.1").replace(ETC, f"{workdir}/")
    text = re.sub(r"^persistence true$", "persistence false", text, flags=re.M)
    assert "/etc/" not in text
    return text + "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"


@pytest.fixture(scope="module")
def broker() -> Iterator[FleetBroker]:
    # Not under pytest's tmp_path (0700 root): a broker started as root reads its files as the mosquitto user.
    with tempfile.TemporaryDirectory(prefix="edgerun-fleet-broker-") as tmp:
        yield from _run_broker(Path(tmp))


def _run_broker(workdir: Path) -> Iterator[FleetBroker]:
    certs = make_certs(workdir / "pki")
    for source, name in ((certs.ca, "ca.crt"), (certs.server_cert, "server.crt"), (certs.server_key, "server.key")):
        shutil.copyfile(source, workdir / name)
    shutil.copyfile(SHIPPED_ACL, workdir / "edgerun-fleet.acl")
    port = free_port()
    fleet = FleetBroker(port, workdir, certs.ca)
    for args in (["drone-a"], ["drone-b"], ["--operator"], ["--station"]):
        fleet.add(*args)
    conf = workdir / "mosquitto.conf"
    conf.write_text(fleet_config(SHIPPED_CONF.read_text(), port, workdir))
    give_to_broker_user([workdir, *workdir.iterdir()])
    binary = find_mosquitto()
    assert binary is not None
    log = (workdir / "mosquitto.log").open("ab")
    fleet.process = subprocess.Popen([binary, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True)  # fmt: skip
    log.close()
    try:

        def listening() -> bool:
            assert fleet.process is not None and fleet.process.poll() is None, (workdir / "mosquitto.log").read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return True
            except OSError:
                return False

        assert wait_for(listening, 15), (workdir / "mosquitto.log").read_text()
        yield fleet
    finally:
        fleet.process.terminate()
        try:
            fleet.process.wait(10)
        except subprocess.TimeoutExpired:
            fleet.process.kill()
            fleet.process.wait()


class Client:
    """A paho MQTT 5 client over TLS in its own thread, recording its CONNACK, PUBACKs and messages."""

    def __init__(self, broker: FleetBroker, username: str | None, password: str | None = None) -> None:
        self.connack: Any = None
        self.connected = threading.Event()
        self.messages: list[tuple[str, bytes, bool]] = []
        self.acks: dict[int, Any] = {}
        self._subscribed = threading.Event()
        self._lock = threading.Lock()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{username}-{os.urandom(4).hex()}",
                        protocol=MQTTProtocolVersion.MQTTv5)  # fmt: skip
        c.tls_set(ca_certs=str(broker.ca))
        if username is not None:
            c.username_pw_set(username, password)
        c.on_connect = self._on_connect
        c.on_subscribe = lambda *a: self._subscribed.set()
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        self._client = c
        c.connect_async("127.0.0.1", broker.port, keepalive=10)
        c.loop_start()
        self.connected.wait(20)

    def _on_connect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
        self.connack = rc
        self.connected.set()
        if rc.is_failure:
            c.disconnect()  # no retry loop: the test reads the refusal

    def _on_message(self, c: Any, u: Any, msg: Any) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain)))

    def _on_publish(self, c: Any, u: Any, mid: int, rc: Any, props: Any) -> None:
        self.acks[mid] = rc

    @property
    def accepted(self) -> bool:
        return self.connack is not None and not self.connack.is_failure

    def subscribe(self, *topics: str) -> Client:
        self._subscribed.clear()
        self._client.subscribe([(t, 1) for t in topics])
        assert self._subscribed.wait(20)
        return self

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> Any:
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(20)
        assert wait_for(lambda: info.mid in self.acks, 20)
        return self.acks[info.mid]

    def topics(self) -> list[str]:
        with self._lock:
            return [t for t, _, _ in self.messages]

    def payloads(self, topic: str) -> list[bytes]:
        with self._lock:
            return [p for t, p, _ in self.messages if t == topic]

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@pytest.fixture
def clients(broker: FleetBroker) -> Iterator[Any]:
    made: list[Client] = []

    def connect(identity: str | None, password: str | None = None) -> Client:
        if identity is not None and password is None:
            identity, password = broker.credentials[identity]
        client = Client(broker, identity, password)
        made.append(client)
        return client

    yield connect
    for client in made:
        client.close()


def _marker() -> bytes:
    return os.urandom(8).hex().encode()


def test_anonymous_and_wrong_passwords_are_refused(clients: Any) -> None:
    anonymous = clients(None)
    assert anonymous.connack is not None and anonymous.connack.is_failure, anonymous.connack
    assert anonymous.connack.value in (134, 135)  # bad user name or password / not authorized
    wrong = clients("drone-a", "not-the-password")
    assert wrong.connack is not None and wrong.connack.is_failure, wrong.connack
    unknown = clients("drone-z", "whatever")
    assert unknown.connack is not None and unknown.connack.is_failure
    assert clients("drone-a").accepted


def test_a_node_cannot_publish_as_another_node_nor_a_release(clients: Any) -> None:
    station = clients("station").subscribe("#")
    a = clients("drone-a")
    assert station.accepted and a.accepted
    forged = ["edgerun/drone-b/detections", "edgerun/drone-b/status", "edgerun/fleet/releases/person",
              "edgerun/fleet/releases/person/files/model.tar/0", "edgerun/fleet/rollouts/person",
              "edgerun/station/events", "edgerun/operator/x", "other/topic"]  # fmt: skip
    for topic in forged:
        ack = a.publish(topic, b"forged by drone-a", retain=topic.endswith(("status", "person")))
        assert ack.is_failure and ack.value == 135, (topic, ack)  # PUBACK: not authorized
    # Its own topics and the fleet-object topic go through, in order after the forged ones.
    mine = _marker()
    for topic in ("edgerun/drone-a/detections", "edgerun/drone-a/status", "edgerun/fleet/objects"):
        assert not a.publish(topic, mine).is_failure
    assert wait_for(lambda: mine in station.payloads("edgerun/fleet/objects"), 20), station.topics()
    assert station.payloads("edgerun/drone-a/detections") == [mine]
    assert not [t for t in station.topics() if t in forged], station.topics()
    # A subscriber that joins later finds no forged retained message either.
    late = clients("station").subscribe("edgerun/drone-b/#", "edgerun/fleet/#")
    time.sleep(0.5)
    assert not [t for t in late.topics() if t in forged], late.topics()


def test_the_operator_publishes_releases_and_rollouts_and_nodes_read_them(clients: Any) -> None:
    node = clients("drone-b").subscribe("edgerun/#")  # the broker filters it down to what drone-b may read
    station = clients("station").subscribe("edgerun/#")
    operator = clients("operator")
    release, rollout = _marker(), _marker()
    assert not operator.publish("edgerun/fleet/releases/acl-model", release, retain=True).is_failure
    assert not operator.publish("edgerun/fleet/releases/acl-model/files/p.tar/0", release, retain=True).is_failure
    assert not operator.publish("edgerun/fleet/rollouts/acl-model", rollout, retain=True).is_failure
    for client in (node, station):
        assert wait_for(lambda c=client: rollout in c.payloads("edgerun/fleet/rollouts/acl-model"), 20)
        assert client.payloads("edgerun/fleet/releases/acl-model") == [release]
    # The operator speaks for no node.
    assert operator.publish("edgerun/drone-b/status", b"offline").is_failure
    # A node reads the fleet's releases and rollouts, not another node's detections.
    other = _marker()
    assert not clients("drone-a").publish("edgerun/drone-a/detections", other).is_failure
    assert wait_for(lambda: other in station.payloads("edgerun/drone-a/detections"), 20)
    assert not node.payloads("edgerun/drone-a/detections")
    for topic in ("edgerun/fleet/releases/acl-model", "edgerun/fleet/rollouts/acl-model"):
        operator.publish(topic, b"", retain=True)  # clear the retained messages for other tests


def test_the_station_reads_everything_and_writes_only_its_events(clients: Any) -> None:
    station = clients("station").subscribe("#")
    a, b, operator = clients("drone-a"), clients("drone-b"), clients("operator")
    sent = {}
    for client, topic in ((a, "edgerun/drone-a/metrics"), (b, "edgerun/drone-b/swarm"),
                          (b, "edgerun/fleet/objects"), (operator, "edgerun/fleet/releases/other-model")):  # fmt: skip
        sent[topic] = _marker()
        assert not client.publish(topic, sent[topic]).is_failure
    assert wait_for(lambda: all(p in station.payloads(t) for t, p in sent.items()), 20), station.topics()
    assert not station.publish("edgerun/station/events", b"{}").is_failure
    assert station.publish("edgerun/fleet/rollouts/acl-model", b"halt").is_failure
    assert station.publish("edgerun/drone-a/status", b"offline").is_failure


def test_operator_and_station_retire_nodes_and_a_node_cannot(clients: Any) -> None:
    """The retire marks (edgerun fleet retire, the station's button and its clearing) and a node's pictures."""
    station = clients("station").subscribe("edgerun/fleet/#")
    operator, node = clients("operator"), clients("drone-a")
    mark = _marker()
    assert not operator.publish("edgerun/fleet/retired/drone-b", mark, retain=True).is_failure
    assert wait_for(lambda: mark in station.payloads("edgerun/fleet/retired/drone-b"), 20)
    assert not station.publish("edgerun/fleet/retired/drone-b", b"", retain=True).is_failure
    assert node.publish("edgerun/fleet/retired/drone-b", _marker(), retain=True).is_failure
    picture = _marker()
    assert not node.publish("edgerun/fleet/objects/00000000000000a1/image", picture).is_failure
    assert wait_for(lambda: picture in station.payloads("edgerun/fleet/objects/00000000000000a1/image"), 20)


def test_the_credential_script_refuses_reserved_and_malformed_names(broker: FleetBroker) -> None:
    for name in ("fleet", "operator", "station", "a/b", "+", "#", "drone a", ""):
        proc = subprocess.run(["bash", str(CREDENTIAL), "-f", str(broker.workdir / "passwd.other"), name],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (name, proc.stderr)
        assert proc.stdout == ""
    assert not (broker.workdir / "passwd.other").exists()


def test_a_rotated_password_replaces_the_old_one_after_a_reload(broker: FleetBroker, clients: Any) -> None:
    _, old = broker.credentials["drone-b"]
    _, new = broker.add("drone-b")
    assert new != old
    broker.reload()
    assert wait_for(lambda: clients("drone-b", old).connack.is_failure, 20)
    assert clients("drone-b", new).accepted


def test_the_swarm_demo_publishes_through_the_acl_broker(broker: FleetBroker, clients: Any, tmp_path: Path,
                                                         blazeface_bundle: Any) -> None:  # fmt: skip
    """Two demo drones (edgerun run, gossiping) with one credential each, TLS, and the station identity listening.

    ``edgerun demo --mqtt`` itself takes only host:port (and its station and listeners no credentials), so the
    demo's own pieces fly here: drone_configs, then each node config gets its [sinks.mqtt] credential and CA.
    """
    import json

    import tomli_w

    from edgerun.demo_swarm import drone_configs, score_swarm, start_drones, stop_drones

    station = clients("station").subscribe("edgerun/#")
    crew = drone_configs(tmp_path, 2, model=str(blazeface_bundle.root), mqtt=f"127.0.0.1:{broker.port}")
    for drone in crew:
        username, password = broker.add(drone.node_id)
        drone.config["sinks"]["mqtt"].update(
            username=username, password=password, tls_ca=str(broker.ca), qos_detections=1
        )
        (drone.out_dir / "node.toml").write_text(tomli_w.dumps(drone.config))
    broker.reload()
    time.sleep(0.5)  # SIGHUP is handled between network loops: let the new passwords in first
    try:
        start_drones(crew, 10.0)
    finally:
        codes = stop_drones(crew, timeout_s=90.0)
    logs = {d.node_id: (d.out_dir / "node.log").read_text(errors="replace") for d in crew}
    assert all(code == 0 for code in codes.values()), (codes, logs)
    summary = score_swarm(crew, 15.0)
    for drone in crew:
        topic = f"edgerun/{drone.node_id}/detections"
        assert wait_for(lambda t=topic: len(station.payloads(t)) >= 10, 20), (station.topics()[-5:], logs)
        heard = [json.loads(p) for p in station.payloads(topic)]
        assert all(b["node"] == drone.node_id for b in heard)
        assert station.payloads(f"edgerun/{drone.node_id}/status")[:1] == [b"online"]
        assert "not authori" not in logs[drone.node_id].lower(), logs[drone.node_id]
    objects = [json.loads(p) for p in station.payloads("edgerun/fleet/objects")]
    assert objects and {o["owner"] for o in objects} <= {d.node_id for d in crew}, objects
    assert summary["fleet_objects"] >= 1, summary  # dedup quality is test_demo's; here: the objects got through


def test_the_station_acknowledges_alerts_and_a_node_cannot(clients: Any) -> None:
    """The retained ack marks of the station's alerts (edgerun/fleet/acks/<object id>): station yes, node no."""
    operator = clients("operator").subscribe("edgerun/fleet/acks/#")
    station, node = clients("station"), clients("drone-a")
    ack = _marker()
    assert not station.publish("edgerun/fleet/acks/00000000000000a1", ack, retain=True).is_failure
    assert wait_for(lambda: ack in operator.payloads("edgerun/fleet/acks/00000000000000a1"), 20), operator.topics()
    assert node.publish("edgerun/fleet/acks/00000000000000a2", _marker(), retain=True).is_failure

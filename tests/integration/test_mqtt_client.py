"""The one MQTT client module (edgerun/mqtt_client.py) against a real mosquitto on a free loopback port.

Unique client ids (two default-built clients share a broker; two with one fixed id evict each other), a
refused login and an unreachable broker as one line naming the cause (the blocking connect, the station's
background connection, ``edgerun listen``), and a publish the broker's ACL refuses reported from its PUBACK.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgerun.config import MqttSinkConfig
from edgerun.mqtt_client import MqttError, connect_blocking, connect_in_background, new_client, publish_confirmed
from edgerun.sinks.mosquitto import Mosquitto
from edgerun.station.subscriber import FleetSubscriber
from tests.integration.brokers import find_mosquitto, free_port, run_mosquitto, wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(find_mosquitto() is None or shutil.which("mosquitto_passwd") is None,
                       reason="mosquitto is not installed (.ci/install-system-deps)"),
]  # fmt: skip

USER, PASSWORD = "alice", "correct horse"


@pytest.fixture(scope="module")
def broker() -> Iterator[Mosquitto]:
    """A broker with one login (alice) whose ACL lets her write ``allowed/#`` and read everything."""
    # Not under pytest's tmp_path (0700 root): a broker started as root reads its files as the mosquitto user.
    with tempfile.TemporaryDirectory(prefix="edgerun-mqtt-client-") as tmp:
        workdir = Path(tmp)
        passwd, acl = workdir / "passwd", workdir / "acl"
        subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwd), USER, PASSWORD], check=True,
                       capture_output=True, timeout=30)  # fmt: skip
        acl.write_text(f"user {USER}\ntopic write allowed/#\ntopic read #\n")
        os.chmod(passwd, 0o644)  # a broker started as root reads it as the mosquitto user
        with run_mosquitto(workdir=workdir, extra=[f"password_file {passwd}", f"acl_file {acl}"]) as running:
            yield running


def login(password: str = PASSWORD) -> MqttSinkConfig:
    return MqttSinkConfig(username=USER, password=password)


class Watched:
    """A client in paho's thread that records its CONNACKs and disconnects."""

    def __init__(self, broker: Mosquitto, **kwargs: Any) -> None:
        self.connects = 0
        self.disconnects: list[str] = []
        self.client = new_client(login(), reconnect=None, **kwargs)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        connect_in_background(self.client, broker.host, broker.port)

    def _on_connect(self, c: Any, u: Any, flags: Any, reason: Any, props: Any) -> None:
        self.connects += 0 if reason.is_failure else 1

    def _on_disconnect(self, c: Any, u: Any, flags: Any, reason: Any, props: Any) -> None:
        self.disconnects.append(str(reason))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_two_clients_built_with_defaults_share_a_broker(broker: Mosquitto) -> None:
    first = Watched(broker, id_prefix="edgerun-station")
    try:
        assert wait_for(lambda: first.connects == 1)
        second = Watched(broker, id_prefix="edgerun-station")
        try:
            assert wait_for(lambda: second.connects == 1)
            time.sleep(1.0)  # an eviction would be immediate: the broker drops the older session at once
            assert first.disconnects == [] and second.disconnects == []
            assert first.client._client_id != second.client._client_id
        finally:
            second.close()
    finally:
        first.close()


def test_two_clients_with_one_explicit_id_evict_each_other(broker: Mosquitto) -> None:
    """What the unique default prevents: the broker hands the id to the newer client and drops the older."""
    # mosquitto 2.0.11 closes the older connection without a DISCONNECT, so any disconnect counts.
    first = Watched(broker, client_id="edgerun-station")
    try:
        assert wait_for(lambda: first.connects == 1)
        second = Watched(broker, client_id="edgerun-station")
        try:
            assert wait_for(lambda: second.connects == 1)
            assert wait_for(lambda: len(first.disconnects) > 0), first.disconnects
        finally:
            second.close()
    finally:
        first.close()


def test_two_stations_with_default_ids_both_stay_connected(broker: Mosquitto) -> None:
    async def run() -> list[list[tuple[bool, str]]]:
        states: list[list[tuple[bool, str]]] = [[], []]
        stations = [FleetSubscriber(broker.host, broker.port, lambda *message: None,
                                    lambda c, r, i=i: states[i].append((c, r)), cfg=login())
                    for i in range(2)]  # fmt: skip
        for station in stations:
            station.start()
        try:
            for _ in range(100):
                if all(s and s[-1] == (True, "") for s in states):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
        finally:
            for station in stations:
                await station.stop()
        return states

    assert asyncio.run(run()) == [[(True, "")], [(True, "")]]


def test_a_refused_login_is_one_line_naming_the_refusal(broker: Mosquitto) -> None:
    client = new_client(login("wrong"))
    with pytest.raises(MqttError) as caught:
        connect_blocking(client, broker.host, broker.port)
    message = str(caught.value)
    assert message.startswith(f"mqtt://127.0.0.1:{broker.port}: refused the connection ("), message
    assert "Not authorized" in message or "Bad user name or password" in message, message
    assert "\n" not in message


def test_an_unreachable_port_is_one_line_naming_the_os_reason() -> None:
    port = free_port()  # nothing listens on it
    with pytest.raises(MqttError) as caught:
        connect_blocking(new_client(), "127.0.0.1", port)
    assert str(caught.value) == f"mqtt://127.0.0.1:{port}: connection refused"


def test_the_station_names_why_it_cannot_reach_the_broker() -> None:
    port = free_port()

    async def run() -> list[tuple[bool, str]]:
        states: list[tuple[bool, str]] = []
        station = FleetSubscriber("127.0.0.1", port, lambda *message: None, lambda c, r: states.append((c, r)))
        station.start()
        for _ in range(100):
            if states:
                break
            await asyncio.sleep(0.05)
        await station.stop()
        return states

    states = asyncio.run(run())
    assert states and states[0] == (False, f"cannot reach mqtt://127.0.0.1:{port} (connection refused); retrying")


def test_listen_names_why_it_cannot_connect() -> None:
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "edgerun", "listen", "--mqtt", f"127.0.0.1:{port}", "--seconds", "2"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == f"edgerun: error: listen: mqtt://127.0.0.1:{port}: connection refused\n"


def test_a_publish_the_acl_refuses_is_reported_from_its_puback(broker: Mosquitto) -> None:
    client = new_client(login())
    connect_blocking(client, broker.host, broker.port)
    try:
        publish_confirmed(client, "mqtt://test", [("allowed/a", b"1")])  # accepted: no error
        with pytest.raises(MqttError) as caught:
            publish_confirmed(
                client,
                "mqtt://test",
                [("allowed/b", b"2"), ("forbidden/c", b"3")],
                refused_hint="is this the operator's identity?",
            )
    finally:
        client.disconnect()
        client.loop_stop()
    assert str(caught.value) == (
        "mqtt://test: the broker refused forbidden/c (Not authorized): is this the operator's identity?"
    )
    # What the broker accepted is there, what it refused is not.
    retained = _retained(broker, ["allowed/#", "forbidden/#"])
    assert retained == {"allowed/a": b"1", "allowed/b": b"2"}


def _retained(broker: Mosquitto, topics: list[str]) -> dict[str, bytes]:
    got: dict[str, bytes] = {}
    subscribed = threading.Event()
    client = new_client(login())
    client.on_subscribe = lambda *a: subscribed.set()
    client.on_message = lambda c, u, msg: got.__setitem__(msg.topic, bytes(msg.payload))
    connect_blocking(client, broker.host, broker.port)
    try:
        client.subscribe([(t, 1) for t in topics])
        assert subscribed.wait(20)
        time.sleep(0.5)  # retained messages follow the SUBACK at once
    finally:
        client.disconnect()
        client.loop_stop()
    return got

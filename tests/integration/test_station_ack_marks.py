"""Acknowledgement marks do not stay on the broker forever: real mosquitto, the station as a process, a paho MQTT 5
client reading what the broker retains.

* An ack's retained mark (``edgerun/fleet/acks/<id>``) carries the station's ``--ack-expiry-s`` as its MQTT 5
  message expiry, and the broker no longer hands it to a new subscriber once that has passed.
* When the station forgets an acknowledged object (its bound of 5000 objects), it clears the object's mark.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from edgerun import wire
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.integration.brokers import wait_for
from tests.integration.station_rig import StationProcess, post_ack, publish, publish_until

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
T0 = 1_800_000_000.0


def fleet_objects(first: int, count: int, last_seen: float) -> bytes:
    """``count`` fleet objects in one message (the stream takes lists of up to 100)."""
    return json.dumps(
        [
            {
                "schema": "edgerun.object/2",
                "id": f"{i:016x}",
                "label": "person",
                "lat": 53.117,
                "lon": -4.13,
                "first_seen": last_seen - 1,
                "last_seen": last_seen,
                "score": 0.9,
                "owner": "drone-1",
                "seen_by": ["drone-1"],
            }
            for i in range(first, first + count)
        ]
    ).encode()


def retained_marks(port: int, quiet_s: float = 1.0) -> dict[str, dict[str, Any]]:
    """What the broker retains under ``edgerun/fleet/acks/#`` for a new subscriber: object id -> the mark's
    JSON and its remaining message expiry (None when it has none)."""
    import paho.mqtt.client as mqtt

    from edgerun.mqtt_client import connect_blocking, new_client

    marks: dict[str, dict[str, Any]] = {}
    got = threading.Event()

    def on_message(client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.payload:
            expiry = getattr(msg.properties, "MessageExpiryInterval", None) if msg.properties else None
            marks[msg.topic.rsplit("/", 1)[1]] = {"mark": json.loads(msg.payload), "expiry": expiry}
        got.set()

    client = new_client(id_prefix="test-ack-reader")
    client.on_message = on_message
    connect_blocking(client, "127.0.0.1", port)
    try:
        client.subscribe("edgerun/fleet/acks/#", qos=1)
        while got.wait(quiet_s):  # retained messages come right after the SUBACK; quiet for quiet_s: all came
            got.clear()
    finally:
        client.disconnect()
        client.loop_stop()
    return marks


@pytest.mark.timeout(180)
def test_an_ack_mark_expires_at_the_broker_and_is_cleared_when_its_object_is_forgotten(tmp_path):
    with run_mosquitto() as broker:
        station = StationProcess(tmp_path, broker.port, "--ack-expiry-s", "4")
        try:
            station.wait_connected()
            now = time.time()
            ids = [f"{1:016x}", f"{2:016x}"]
            first = station
            alerting = lambda: {a["id"] for a in first.snapshot()["alerts"]} == set(ids)  # noqa: E731
            assert publish_until(broker.port, [("edgerun/fleet/objects", fleet_objects(1, 2, now - 60), {})], alerting)

            # -- the mark expires: a subscriber within the expiry gets it, one after it does not --------------
            post_ack(station.url, ids[0])
            assert wait_for(lambda: ids[0] in retained_marks(broker.port, 0.5), 10, 0.25)
            mark = retained_marks(broker.port, 0.5)[ids[0]]
            assert mark["mark"]["object"] == ids[0] and mark["mark"]["by"] == "operator"
            assert mark["expiry"] is not None and 0 < mark["expiry"] <= 4
            time.sleep(5.0)  # past the expiry (the broker's clock, whole seconds)
            assert ids[0] not in retained_marks(broker.port, 0.5)

        finally:
            station.stop()

        # -- the station forgets an acknowledged object (5000 newer ones): it clears its mark -----------------
        station = StationProcess(tmp_path, broker.port, name="station-2")  # the default expiry: three days
        try:
            station.wait_connected()
            old = f"{3:016x}"
            second = station
            alerting = lambda: old in {a["id"] for a in second.snapshot()["alerts"]}  # noqa: E731
            assert publish_until(broker.port, [("edgerun/fleet/objects", fleet_objects(3, 1, now - 60), {})], alerting)
            post_ack(station.url, old)
            assert wait_for(lambda: old in retained_marks(broker.port, 0.5), 10, 0.25)
            assert 3 * 86400 - 60 < retained_marks(broker.port, 0.5)[old]["expiry"] <= 3 * 86400
            newer = [
                (wire.FLEET_OBJECTS_TOPIC, fleet_objects(100 + k * 100, 100, now), {}) for k in range(50)
            ]  # 5000 newer finds: the model's bound is 5000, so the old one goes
            publish(broker.port, newer, retain=False)
            assert wait_for(lambda: old not in {o["id"] for o in station.snapshot()["objects"]}, 30, 0.5)
            assert wait_for(lambda: old not in retained_marks(broker.port, 0.5), 10, 0.25)
        finally:
            station.stop()

"""The station halts a regressing canary by itself: real mosquitto, the real station and ``edgerun fleet`` commands.

The fleet's metrics are injected (a fault: the canary node reports a third of the baseline's frame rate),
published as ``edgerun.metrics/1`` messages into the real broker; everything the station does about it
(a release re-signed at 0 %, a signed rollout state saying why, an event) is read back from the broker
and verified as a node would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from edgerun.fleet.rollout import decode_state, read_topics, rollout_topic
from edgerun.ota.transport_mqtt import decode_release, release_topic
from edgerun.ota.trust import TrustStore
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.conftest import free_port
from tests.integration.brokers import collecting, wait_for
from tests.unit.test_ota_release import Fleet, head_variant

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def metrics(node: str, ts: float, frames: int, version: int) -> bytes:
    summary = {
        "model": "blazeface_short",
        "model_version": version,
        "engine": "tflite",
        "state": "running",
        "frames": frames,
        "detections": frames // 2,
        "fps": 0.0,
        "latency_p99_ms": 30.0,
        "dropped": 0,
    }
    return json.dumps({"schema": "edgerun.metrics/1", "node": node, "ts": ts, "summary": summary}).encode()


@pytest.mark.timeout(240)
def test_a_canary_with_an_fps_regression_is_halted_by_the_station(tmp_path, blazeface_bundle):
    import paho.mqtt.client as mqtt

    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    key_file = tmp_path / "release.key"
    key_file.write_text(fleet.release_keys[0].to_text())
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    with run_mosquitto() as broker:
        mqtt_addr = f"127.0.0.1:{broker.port}"
        station = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgerun",
                "station",
                "--mqtt",
                mqtt_addr,
                "--bind",
                f"127.0.0.1:{free_port()}",
                "--signing-key",
                str(key_file),
                "--root-key",
                fleet.root_pub_paths[0],
            ],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "station.log").open("w"),
            text=True,
        )
        try:
            assert "rollout actions signed by release key" in station.stdout.readline()
            published = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "edgerun",
                    "fleet",
                    "publish",
                    str(v2.root),
                    "--percent",
                    "10",
                    "--keys",
                    str(fleet.release_dir),
                    "--signing-key",
                    str(key_file),
                    "--mqtt",
                    mqtt_addr,
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert published.returncode == 0, published.stderr
            with collecting(broker.port, ["edgerun/station/events"]) as events:
                client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
                client.connect("127.0.0.1", broker.port)
                client.loop_start()
                try:
                    t0 = time.time()
                    for step in range(4):  # two intervals: rates need two samples per node
                        ts = t0 + step * 2.0
                        for node, version, fps in (("canary", 2, 3.0), ("base-1", 1, 10.0), ("base-2", 1, 9.0)):
                            client.publish(
                                f"edgerun/{node}/metrics", metrics(node, ts, int(100 + step * 2 * fps), version), qos=1
                            ).wait_for_publish(10)
                        time.sleep(0.3)
                finally:
                    client.disconnect()
                    client.loop_stop()
                assert wait_for(lambda: any(b"auto-halt" in m.payload for m in events.snapshot()), 30), (
                    "the station never published an auto-halt event"
                )
                event = json.loads(next(m.payload for m in events.snapshot() if b"auto-halt" in m.payload))
            assert event["schema"] == "edgerun.event/1" and event["kind"] == "rollout"
            assert "fps 3.0 on v2 against 9.5 on the nodes not updated" in event["text"]

            retained = read_topics(
                "127.0.0.1", broker.port, [release_topic("blazeface_short"), rollout_topic("blazeface_short")]
            )
            offer = decode_release(retained[release_topic("blazeface_short")], "test")
            store = TrustStore([k.public_key for k in fleet.root_keys])
            keyring = store.verify_keys(offer.keys, offer.keys_sig, time.time(), None)
            manifest = store.verify_manifest(offer.manifest, offer.manifest_sig, keyring)
            assert (manifest.version, manifest.rollout.percent) == (2, 0.0)
            release_key = fleet.release_keys[0].public_key
            state = decode_state(retained[rollout_topic("blazeface_short")], {release_key.id_hex: release_key})
            assert state.verified
            assert (state.state.phase, state.state.by) == ("halted", "auto")
            assert state.state.reason.startswith("auto-halt: fps 3.0 on v2")

            status = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "edgerun",
                    "fleet",
                    "status",
                    "--mqtt",
                    mqtt_addr,
                    "--seconds",
                    "1",
                    "--root-key",
                    fleet.root_pub_paths[0],
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert status.returncode == 0, status.stderr
            assert "rollout blazeface_short v2: halted at 0%" in status.stdout and "auto-halt: fps" in status.stdout
        finally:
            station.terminate()
            station.wait(10)

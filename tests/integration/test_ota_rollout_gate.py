"""A halt reaches a download in flight: the MQTT transport against a real mosquitto stops between chunks.

A rate-limited download runs while the test publishes, retained on the release topic, first a forged
halt (signed by a key keys.json does not list: the download goes on), then the real halt signed by the
release key: the transport stops with a TransportError, which the updater reports and retries on the
next poll, where the halted release is refused as not in the rollout.
"""

from __future__ import annotations

import asyncio

import pytest

from edgerun.fleet.rollout import resign
from edgerun.ota.manifest import cohort_position
from edgerun.ota.minisign import SecretKey
from edgerun.ota.release import ReleaseSpec
from edgerun.ota.transport import RateLimiter, TransportError
from edgerun.ota.transport_mqtt import MqttTransport, encode_release, publish_release, release_topic
from tests.unit.test_ota_release import Fleet, head_variant

mosquitto = pytest.importorskip("edgerun.sinks.mosquitto")
if mosquitto.find_mosquitto() is None:
    pytest.skip("mosquitto not installed (make system-deps)", allow_module_level=True)

NODE = "gate-node"


def test_a_signed_halt_stops_a_download_in_flight_and_a_forged_one_does_not(tmp_path, blazeface_bundle):
    import paho.mqtt.publish as publish

    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    salt = next(f"s{i}" for i in range(1000) if cohort_position(f"s{i}", NODE) < 10)
    rel = fleet.publish(
        head_variant(blazeface_bundle, tmp_path / "v2", 2), spec=ReleaseSpec(rollout_percent=10.0, rollout_salt=salt)
    )
    target = rel.manifest.target
    with mosquitto.run_mosquitto() as broker:
        publish_release(fleet.release_dir, "blazeface_short", broker.host, broker.port, chunk_size=4096)

        def retain(offer) -> bytes:
            payload = encode_release(offer.manifest, offer.manifest_sig, offer.keys, offer.keys_sig)
            publish.single(
                release_topic("blazeface_short"), payload, qos=1, retain=True, hostname=broker.host, port=broker.port
            )
            return payload

        async def grown(dest, by: int) -> None:
            start = dest.stat().st_size if dest.exists() else 0
            while (dest.stat().st_size if dest.exists() else 0) < start + by:
                await asyncio.sleep(0.05)

        async def main() -> None:
            transport = MqttTransport(broker.host, broker.port, "gate-test", node_id=NODE)
            try:
                offer = None
                while offer is None:
                    offer = await transport.poll("blazeface_short")
                    await asyncio.sleep(0.05)
                dest = tmp_path / "payload.part"
                fetch = asyncio.create_task(
                    transport.fetch("blazeface_short", target.file, target.size, dest, RateLimiter(40_000, 4096))
                )
                await asyncio.wait_for(grown(dest, 3 * 4096), 60)
                forged = retain(resign(offer, 0.0, SecretKey.generate()))  # not a release key
                while transport._latest.get(release_topic("blazeface_short")) != forged:  # the node has it
                    await asyncio.sleep(0.02)
                await asyncio.wait_for(grown(dest, 3 * 4096), 60)  # and went on downloading
                assert not fetch.done()
                retain(resign(offer, 0.0, fleet.release_keys[0]))
                with pytest.raises(TransportError, match="no longer this node"):
                    await asyncio.wait_for(fetch, 60)
                assert dest.stat().st_size < target.size
            finally:
                await transport.close()

        asyncio.run(main())

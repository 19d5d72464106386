"""The MQTT transport against a real mosquitto on loopback: retained release, hashed chunks, resume."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from edgerun.ota.errors import Rejected
from edgerun.ota.transport import RateLimiter
from edgerun.ota.transport_mqtt import MqttTransport, file_topic, publish_release
from tests.unit.test_ota_release import Fleet, head_variant

mosquitto = pytest.importorskip("edgerun.sinks.mosquitto")
if mosquitto.find_mosquitto() is None:
    pytest.skip("mosquitto not installed (make system-deps)", allow_module_level=True)


@pytest.fixture(scope="module")
def release(tmp_path_factory, blazeface_bundle):
    tmp = tmp_path_factory.mktemp("mqtt")
    fleet = Fleet(tmp / "fleet")
    fleet.write_keys()
    return fleet, fleet.publish(head_variant(blazeface_bundle, tmp / "v2", 2), base=blazeface_bundle)


async def _poll_until(transport: MqttTransport, model: str):
    for _ in range(100):
        offer = await transport.poll(model)
        if offer is not None:
            return offer
        await asyncio.sleep(0.05)
    raise AssertionError("no retained release message arrived")


def test_release_and_chunked_resumable_download(tmp_path, release):
    fleet, rel = release
    target = rel.manifest.target
    with mosquitto.run_mosquitto() as broker:
        publish_release(fleet.release_dir, "blazeface_short", broker.host, broker.port, chunk_size=16 * 1024)

        async def main():
            transport = MqttTransport(broker.host, broker.port, "test-node")
            try:
                offer = await _poll_until(transport, "blazeface_short")
                assert offer.manifest == rel.manifest_bytes
                assert offer.keys == (fleet.release_dir / "keys.json").read_bytes()
                # A download cut off two and a half chunks in resumes at chunk 2.
                full = (rel.directory / target.file).read_bytes()
                dest = tmp_path / "payload.part"
                dest.write_bytes(full[: 40 * 1024])
                await transport.fetch("blazeface_short", target.file, target.size, dest, RateLimiter(0))
                assert hashlib.sha256(dest.read_bytes()).hexdigest() == target.sha256
                delta = rel.manifest.delta
                await transport.fetch("blazeface_short", delta.file, delta.size, tmp_path / "d", RateLimiter(0))
                assert hashlib.sha256((tmp_path / "d").read_bytes()).hexdigest() == delta.sha256
            finally:
                await transport.close()

        asyncio.run(main())


def test_an_index_claiming_more_than_signed_is_refused(tmp_path, release):
    fleet, rel = release
    target = rel.manifest.target
    with mosquitto.run_mosquitto() as broker:
        publish_release(fleet.release_dir, "blazeface_short", broker.host, broker.port)
        import paho.mqtt.publish as publish

        lie = {"size": target.size * 10, "chunk_size": 65536, "chunks": ["0" * 64] * (target.size * 10 // 65536 + 1)}
        publish.single(
            file_topic("blazeface_short", target.file, "index"),
            json.dumps(lie),
            qos=1,
            retain=True,
            hostname=broker.host,
            port=broker.port,
        )

        async def main():
            transport = MqttTransport(broker.host, broker.port, "test-node-2")
            try:
                await _poll_until(transport, "blazeface_short")
                await transport.fetch("blazeface_short", target.file, target.size, tmp_path / "p", RateLimiter(0))
            finally:
                await transport.close()

        with pytest.raises(Rejected) as info:
            asyncio.run(main())
        assert info.value.code == "oversized"

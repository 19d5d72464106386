"""The host side against the real C firmware: ``edgelink-sim`` on a pty, McuBridge over pyserial-asyncio-fast.

Detections flow into real sinks (JSON Lines on disk, MQTT through a private mosquitto), a signed
model goes over the air to the simulated MCU, tampered and unsigned releases are refused by the
MCU itself, a power cut during a flash write leaves the old model active, and a relay cut off
mid-way resumes where the MCU is.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from edgerun.config import JsonlSinkConfig, McuConfig, MqttSinkConfig
from edgerun.mcu.bridge import McuBridge
from edgerun.mcu.ota_relay import RelayResult
from edgerun.mcu.release import McuManifest, McuRelease, build_mcu_release
from edgerun.ota.errors import Rejected
from edgerun.ota.minisign import SecretKey
from edgerun.sinks.jsonl import JsonlSink
from edgerun.types import DetectionBatch

REPO = Path(__file__).resolve().parents[2]
FIRMWARE = REPO / "firmware_mcu"
SIM = FIRMWARE / "build" / "edgelink-sim"
SCHEMA = REPO / "edgerun" / "schema" / "detections-v1.json"
NODE = "mcu-test-node"
LABELS = ["person", "vehicle", "animal"]
IMAGE_V1 = bytes((i * 7 + 3) & 0xFF for i in range(5000))
IMAGE_V2 = bytes((i * 11 + 1) & 0xFF for i in range(9000))

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make and a C compiler")


@pytest.fixture(scope="module")
def sim_binary() -> Path:
    proc = subprocess.run(["make", "-C", str(FIRMWARE), "sim"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SIM


@pytest.fixture()
def key(tmp_path: Path) -> tuple[SecretKey, Path]:
    secret = SecretKey.generate()
    pub = tmp_path / "release.pub"
    pub.write_text(secret.public_key.to_text())
    return secret, pub


@contextmanager
def running_sim(sim: Path, storage: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [str(sim), "--storage", str(storage), "--pty", "--slot-size", "65536", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().split() if proc.stdout else []
        assert len(line) == 2 and line[0] == "PTY", f"sim said {line!r}: {proc.stderr.read() if proc.stderr else ''}"
        yield proc, line[1]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


def _bridge(port: str, submit: Callable[[DetectionBatch], None], pub: Path | None = None, **cfg) -> McuBridge:
    values = dict(
        enabled=True,
        port=port,
        labels=LABELS,
        release_keys=[str(pub)] if pub else [],
        ack_timeout_s=1.0,
        ota_retries=3,
        reconnect_s=0.05,
    )
    values.update(cfg)
    return McuBridge(McuConfig(**values), NODE, submit)


def test_detections_flow_into_the_jsonl_sink(sim_binary: Path, tmp_path: Path) -> None:
    import jsonschema

    count = 300
    out = tmp_path / "mcu.jsonl"

    async def go() -> dict:
        sink = JsonlSink(JsonlSinkConfig(path=str(out)), NODE)
        await sink.start()
        args = ("--rate", "200", "--count", str(count), "--baud", "921600", "--device-id", "0xC0FFEE")
        with running_sim(sim_binary, tmp_path / "flash", *args) as (_, port):
            bridge = _bridge(port, lambda b: sink.submit(b, time.monotonic()))
            await bridge.start()

            def all_in() -> bool:
                hb = bridge.link.heartbeat
                return bridge.detections == count and hb is not None and hb.detections_sent == count

            await until(all_in, what="all detections")
            counters = bridge.counters()
            await bridge.stop()
        await sink.close(2.0)
        return counters

    counters = asyncio.run(go())
    assert counters["detections"] == count == counters["mcu_detections_sent"]
    assert counters["lost_frames"] == 0 and sum(counters["dropped_frames"].values()) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == counters["batches"]
    assert sum(len(r["detections"]) for r in records) == count
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    for record in records[:20]:
        validator.validate(record)
    first = records[0]
    assert first["node"] == NODE and first["frame"]["source"] == "mcu:00c0ffee"
    assert first["frame"]["width"] == 96 and first["model"]["engine"] == "mcu"
    # The sim cycles class ids 0, 1, 2; the labels come from [mcu].labels.
    assert [r["detections"][0]["label"] for r in records[:3]] == LABELS
    assert first["detections"][0]["box"] == [10.0, 12.0, 50.0, 60.0]


def test_detections_reach_mqtt_through_a_real_broker(sim_binary: Path, tmp_path: Path) -> None:
    from brokers import collecting, run_mosquitto

    from edgerun.sinks.mqtt import MqttSink

    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed")
    topic = f"edgerun/{NODE}/detections"
    count = 50
    with run_mosquitto() as broker, collecting(broker.port, [topic]) as col:

        async def go() -> None:
            cfg = MqttSinkConfig(enabled=True, port=broker.port, qos_detections=1, keepalive_s=5)
            sink = MqttSink(cfg, NODE)
            await sink.start()
            with running_sim(sim_binary, tmp_path / "flash", "--rate", "200", "--count", str(count)) as (_, port):
                bridge = _bridge(port, lambda b: sink.submit(b, time.monotonic()))
                await bridge.start()
                await until(
                    lambda: bridge.detections == count and sink.stats.sent == bridge.batches,
                    what="PUBACKs for every batch",
                )
                await bridge.stop()
            await sink.close(2.0)

        asyncio.run(go())
        deadline = time.monotonic() + 10
        while sum(len(json.loads(m.payload)["detections"]) for m in col.on(topic)) < count:
            assert time.monotonic() < deadline, "the subscriber did not get every detection"
            time.sleep(0.02)
    payloads = [json.loads(m.payload) for m in col.on(topic)]
    assert {p["model"]["engine"] for p in payloads} == {"mcu"}
    assert {p["node"] for p in payloads} == {NODE}


async def _connected(bridge: McuBridge) -> None:
    await bridge.start()
    assert await bridge.wait_connected(10)
    await until(lambda: bridge.link.hello is not None, what="HELLO")


async def _hello_version(bridge: McuBridge, version: int) -> None:
    await until(
        lambda: bridge.link.hello is not None and bridge.link.hello.model_version == version,
        what=f"HELLO with model v{version}",
    )


def test_ota_installs_and_survives_a_restart(sim_binary: Path, tmp_path: Path, key) -> None:
    secret, pub = key
    rel = build_mcu_release(IMAGE_V1, "kws-int8", 1, tmp_path / "v1", secret)
    flash = tmp_path / "flash"

    async def go() -> RelayResult:
        with running_sim(sim_binary, flash, "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            assert bridge.link.hello.model_version == 0
            result = await bridge.relay_directory(rel)
            await _hello_version(bridge, 1)
            assert bridge.link.hello.name == "kws-int8"
            await bridge.stop()
        # Power off and on: the committed model is still the one.
        with running_sim(sim_binary, flash, "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            assert bridge.link.hello.model_version == 1
            await bridge.stop()
        return result

    result = asyncio.run(go())
    assert result.ok and result.version == 1
    assert result.chunks_sent == -(-len(IMAGE_V1) // 236)


def test_mcu_refuses_tampered_unsigned_and_older_releases(sim_binary: Path, tmp_path: Path, key) -> None:
    """The node would refuse these too; here they are handed to the relay directly to show the MCU checks."""
    secret, pub = key
    rel_v2 = build_mcu_release(IMAGE_V2, "kws-int8", 2, tmp_path / "v2", secret)
    from edgerun.mcu.release import verify_mcu_release

    good = verify_mcu_release(rel_v2, [secret.public_key])
    tampered_image = bytearray(good.image)
    tampered_image[4321] ^= 0x01
    tampered = McuRelease(good.manifest, good.manifest_bytes, good.signature, bytes(tampered_image))
    stranger = SecretKey.generate()
    unsigned = McuRelease(
        good.manifest,
        good.manifest_bytes,
        stranger.sign(good.manifest_bytes, good.manifest.trusted_comment(1)),
        good.image,
    )
    forged_manifest = McuManifest("kws-int8", 2, len(IMAGE_V2), hashlib.sha256(b"other").digest())
    forged = McuRelease(forged_manifest, forged_manifest.encode(), good.signature, good.image)
    older = build_mcu_release(IMAGE_V1, "kws-int8", 1, tmp_path / "v1", secret)

    async def go() -> dict[str, str]:
        reasons = {}
        with running_sim(sim_binary, tmp_path / "flash", "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            reasons["tampered"] = (await bridge.relay(tampered)).reason
            reasons["unsigned"] = (await bridge.relay(unsigned)).reason
            reasons["forged"] = (await bridge.relay(forged)).reason
            assert bridge.link.hello.model_version == 0  # nothing became active
            assert (await bridge.relay(good)).ok
            await _hello_version(bridge, 2)
            reasons["older"] = (await bridge.relay_directory(older)).reason
            assert bridge.link.hello.model_version == 2
            assert bridge.counters()["ota"] == {
                "hash_mismatch": 1,
                "unknown_key": 1,
                "bad_signature": 1,
                "ok": 1,
                "rollback": 1,
            }
            await bridge.stop()
        return reasons

    assert asyncio.run(go()) == {
        "tampered": "hash_mismatch",
        "unsigned": "unknown_key",
        "forged": "bad_signature",
        "older": "rollback",
    }


def test_node_refuses_a_tampered_release_before_relaying(sim_binary: Path, tmp_path: Path, key) -> None:
    secret, pub = key
    rel = build_mcu_release(IMAGE_V1, "kws-int8", 1, tmp_path / "v1", secret)
    (rel / "image.bin").write_bytes(IMAGE_V1[:-1] + b"\x00")

    async def go() -> None:
        with running_sim(sim_binary, tmp_path / "flash", "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            with pytest.raises(Rejected, match="image.bin: does not match"):
                await bridge.relay_directory(rel)
            assert bridge.link.counters.by_type.get("ack", 0) == 0  # not a byte of it went to the MCU
            await bridge.stop()

    asyncio.run(go())


def test_power_cut_mid_write_leaves_the_old_model_active(sim_binary: Path, tmp_path: Path, key) -> None:
    secret, pub = key
    v1 = build_mcu_release(IMAGE_V1, "kws-int8", 1, tmp_path / "v1", secret)
    v2 = build_mcu_release(IMAGE_V2, "kws-int8", 2, tmp_path / "v2", secret)
    flash = tmp_path / "flash"

    async def go() -> tuple[RelayResult, int | None, RelayResult]:
        with running_sim(sim_binary, flash, "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            assert (await bridge.relay_directory(v1)).ok
            await bridge.stop()
        # 20 flash writes into the v2 update the power goes: the sim dies mid-write, as an MCU would.
        with running_sim(sim_binary, flash, "--key", str(pub), "--power-cut-after", "20") as (proc, port):
            bridge = _bridge(port, lambda b: None, pub, ack_timeout_s=0.3, ota_retries=1)
            await _connected(bridge)
            cut = await bridge.relay_directory(v2)
            await until(lambda: proc.poll() is not None, what="the sim to die")
            code = proc.returncode
            await bridge.stop()
        with running_sim(sim_binary, flash, "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            assert bridge.link.hello.model_version == 1, "the old model must still be active"
            again = await bridge.relay_directory(v2)  # and the update can simply be sent again
            await _hello_version(bridge, 2)
            await bridge.stop()
        return cut, code, again

    cut, code, again = asyncio.run(go())
    assert not cut.ok and cut.reason == "timeout"
    assert code == 3
    assert again.ok and again.version == 2


def test_relay_cut_off_mid_way_resumes_where_the_mcu_is(sim_binary: Path, tmp_path: Path, key) -> None:
    secret, pub = key
    image = bytes((i * 13) & 0xFF for i in range(60000))  # 255 chunks: long enough to cut off part way
    rel = build_mcu_release(image, "kws-int8", 1, tmp_path / "v1", secret)

    async def go() -> RelayResult:
        with running_sim(sim_binary, tmp_path / "flash", "--key", str(pub)) as (_, port):
            bridge = _bridge(port, lambda b: None, pub)
            await _connected(bridge)
            task = asyncio.create_task(bridge.relay_directory(rel))
            await until(lambda: bridge.link.counters.by_type.get("ack", 0) >= 10, what="10 ACKs")
            assert not task.done()
            task.cancel()  # the node stops mid-transfer (restart, link handed over)
            with pytest.raises(asyncio.CancelledError):
                await task
            result = await bridge.relay_directory(rel)
            await _hello_version(bridge, 1)
            await bridge.stop()
        return result

    result = asyncio.run(go())
    assert result.ok
    assert result.resumed_from >= 9 * 236  # at least the chunks the MCU acknowledged before the cut
    assert result.chunks_sent == -(-(len(image) - result.resumed_from) // 236)


def test_link_bench_short_form_accounts_for_every_detection(sim_binary: Path, tmp_path: Path) -> None:
    """The benchmark's building block in a short form: with every 10th frame damaged, nothing goes uncounted."""
    from edgerun.mcu.bench import run_rate

    damaged = asyncio.run(run_rate(sim_binary, 200.0, 1.0, 921600, tmp_path, corrupt_every=10))
    assert damaged["mcu_sent"] == 200 and damaged["mcu_accounted"] and damaged["sink_accounted"]
    assert sum(damaged["host_dropped_frames"].values()) >= 19  # bad_crc or bad_cobs, by where the flip landed
    assert damaged["host_received"] < 200 and damaged["unaccounted"] == 0
    assert damaged["host_received"] + damaged["host_lost_frames_seq_gaps"] >= 200


def test_bridge_reopens_the_port_after_the_mcu_goes_away(sim_binary: Path, tmp_path: Path) -> None:
    """Like a USB serial adapter unplugged and plugged back: the same path (a by-id symlink) comes back."""
    link = tmp_path / "ttyMCU"

    async def go() -> tuple[int, int]:
        with running_sim(sim_binary, tmp_path / "flash", "--device-id", "1") as (proc, port):
            link.symlink_to(port)
            bridge = _bridge(str(link), lambda b: None)
            await _connected(bridge)
            assert bridge.link.hello.device_id == 1
            proc.kill()
        link.unlink()
        await until(lambda: not bridge.connected, what="the bridge to see the port go")
        with running_sim(sim_binary, tmp_path / "flash", "--device-id", "2") as (_, port):
            link.symlink_to(port)
            await until(
                lambda: bridge.connected and bridge.link.hello is not None and bridge.link.hello.device_id == 2,
                what="HELLO from the MCU on the reopened port",
            )
            counters = bridge.counters()
            await bridge.stop()
        return counters["connects"], counters["lost_frames"]

    connects, lost = asyncio.run(go())
    assert connects == 2
    assert lost == 0  # a reopened port starts a new sequence: no phantom gap

"""The MQTT sink against a real mosquitto on a free loopback port.

Every test starts its own broker (and tears it down); waits are generous and
nothing asserts on speed, so a busy 2-core CI machine passes as well.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from brokers import (
    PYTHON,
    BrokerTls,
    Certs,
    collecting,
    find_mosquitto,
    free_port,
    make_batch,
    make_certs,
    make_other_ca,
    python_env,
    run_mosquitto,
    wait_for,
)

from edgerun.config import MqttSinkConfig
from edgerun.sinks import sink_class
from edgerun.sinks.mqtt import MqttSink, backoff_delay

pytestmark = pytest.mark.skipif(
    find_mosquitto() is None or shutil.which("mosquitto_sub") is None,
    reason="mosquitto is not installed (run .ci/install-system-deps)",
)

HERE = Path(__file__).resolve().parent
SCHEMA_PATH = HERE.parents[1] / "edgerun" / "schema" / "detections-v1.json"
NODE = "test-node"
DETECTIONS = f"edgerun/{NODE}/detections"
STATUS = f"edgerun/{NODE}/status"


@pytest.fixture(scope="module")
def validator():
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_certs(tmp_path_factory.mktemp("pki"))


def mqtt_cfg(port: int, **overrides) -> MqttSinkConfig:
    values = dict(
        enabled=True,
        host="127.0.0.1",
        port=port,
        keepalive_s=5,
        connect_timeout_s=5.0,
        metrics_interval_s=0.0,
        reconnect_min_s=0.05,
        reconnect_max_s=0.5,
    )
    values.update(overrides)
    return MqttSinkConfig(**values)


async def until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


def count_attempts(sink: MqttSink) -> list[int]:
    """Counts the sink's connection attempts (each makes a fresh client); install before ``start``."""
    attempts = [0]
    new_client = sink._new_client

    def counted() -> Any:
        attempts[0] += 1
        return new_client()

    sink._new_client = counted  # type: ignore[method-assign]  # counts the attempts
    return attempts


def test_registered_by_key() -> None:
    assert sink_class("mqtt") is MqttSink


def test_backoff_is_full_jitter_and_capped() -> None:
    rng = random.Random(7)
    for attempt in range(12):
        cap = min(5.0, 0.1 * 2**attempt)
        delays = [backoff_delay(attempt, 0.1, 5.0, rng.uniform) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > 0.5 * cap  # spread over the whole window, not clustered at the top
    assert backoff_delay(10_000, 0.1, 5.0, lambda a, b: b) == 5.0


def test_delivers_to_listener_and_mosquitto_sub(validator) -> None:
    """Detections reach both the project's listener and mosquitto_sub, and match the JSON schema."""
    count = 5
    with run_mosquitto() as broker:
        listener = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "edgerun.commands.listen",
                "--mqtt",
                f"127.0.0.1:{broker.port}",
                "--json",
                "--count",
                str(count),
                "--seconds",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        human = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "edgerun.commands.listen",
                "--mqtt",
                f"127.0.0.1:{broker.port}",
                "--count",
                "2",
                "--seconds",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        sub = subprocess.Popen(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-V",
                "mqttv5",
                "-t",
                DETECTIONS,
                "-C",
                str(count),
                "-W",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs = [listener, human, sub]
        try:

            async def publish_until_all_have_enough() -> MqttSink:
                sink = MqttSink(mqtt_cfg(broker.port), NODE)
                await sink.start()
                seq = 0
                # The subscribers connect in their own time: keep publishing until each has its messages.
                while any(p.poll() is None for p in procs) and seq < 2000:
                    sink.submit(make_batch(seq, keypoints=2 if seq % 2 else 0, pose=seq % 3 != 0), time.monotonic())
                    seq += 1
                    await asyncio.sleep(0.05)
                await sink.close(1.0)
                return sink

            sink = asyncio.run(publish_until_all_have_enough())
            outs = [p.communicate(timeout=30) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert sink.stats.errors == 0
    for lines in (outs[0][0].splitlines(), outs[2][0].splitlines()):
        payloads = [json.loads(line) for line in lines]
        assert len(payloads) == count
        for payload in payloads:
            validator.validate(payload)
            assert payload["node"] == NODE
            assert payload["model"] == {"name": "synthetic", "version": 3, "engine": "tflite"}
        seqs = [p["seq"] for p in payloads]
        assert seqs == list(range(seqs[0], seqs[0] + count))  # in order, none missing on a healthy link
    human_lines = outs[1][0].splitlines()
    assert len(human_lines) == 2
    assert all(
        line.startswith(f"{NODE} #") and "synthetic v3/tflite" in line and "2 det: face" in line for line in human_lines
    ), human_lines


def test_message_properties(validator) -> None:
    """ContentType, expiry (counting down from submit), and the model as user properties."""
    with run_mosquitto() as broker, collecting(broker.port, [DETECTIONS]) as col:

        async def go() -> None:
            sink = MqttSink(mqtt_cfg(broker.port, message_expiry_s=30, qos_detections=1), NODE)
            await sink.start()
            sink.submit(make_batch(1), time.monotonic())
            await until(lambda: sink.stats.sent == 1, what="PUBACK")
            await sink.close(1.0)

        asyncio.run(go())
        assert wait_for(lambda: len(col.on(DETECTIONS)) == 1)
    msg = col.on(DETECTIONS)[0]
    validator.validate(json.loads(msg.payload))
    assert msg.properties["ContentType"] == "application/json"
    assert msg.properties["PayloadFormatIndicator"] == 1
    assert 1 <= msg.properties["MessageExpiryInterval"] <= 30
    assert ("model", "synthetic") in msg.properties["UserProperty"]
    assert ("model_version", "3") in msg.properties["UserProperty"]
    assert ("schema", "edgerun.detections/1") in msg.properties["UserProperty"]


def test_status_online_retained_and_will_after_kill9() -> None:
    """While the process runs, status is retained "online"; after kill -9 the broker's will says "lost"."""
    with run_mosquitto() as broker:
        driver = subprocess.Popen(
            [PYTHON, str(HERE / "mqtt_driver.py"), "--port", str(broker.port), "--node", NODE, "--rate", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        try:
            assert driver.stdout is not None
            ready = driver.stdout.readline().strip()
            assert ready == "READY", driver.stderr.read() if driver.stderr else ""
            with collecting(broker.port, [STATUS]) as col:
                assert wait_for(lambda: len(col.on(STATUS)) >= 1)
                first = col.on(STATUS)[0]
                assert (first.payload, first.retain) == (b"online", True)
                driver.kill()  # SIGKILL: no goodbye, the socket just dies
                driver.wait(10)
                assert wait_for(lambda: [m.payload for m in col.on(STATUS)][-1:] == [b"lost"])
            with collecting(broker.port, [STATUS]) as late:
                assert wait_for(lambda: len(late.on(STATUS)) >= 1)
                retained = late.on(STATUS)[0]
                assert (retained.payload, retained.retain) == (b"lost", True)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()


def test_clean_close_publishes_stopped_itself() -> None:
    with run_mosquitto() as broker:

        async def go() -> MqttSink:
            sink = MqttSink(mqtt_cfg(broker.port), NODE)
            await sink.start()
            await until(lambda: sink.stats.connected, what="connection")
            assert sink.status_reason == ""
            for seq in range(20):
                sink.submit(make_batch(seq), time.monotonic())
            await sink.close(1.0)
            return sink

        sink = asyncio.run(go())
        assert sink.stats.sent == 20 and sink.stats.dropped == 0
        with collecting(broker.port, [STATUS]) as late:
            assert wait_for(lambda: len(late.on(STATUS)) >= 1)
            assert (late.on(STATUS)[0].payload, late.on(STATUS)[0].retain) == (b"stopped", True)
        assert "Client edgerun-test-node disconnected." in broker.log_path.read_text()


def test_broker_restart_reconnects_and_delivers_queued_up_to_the_bound() -> None:
    """QoS 1 batches queued during an outage arrive after it; those past the bound are counted exactly."""
    bound, before, during = 20, 10, 35
    with run_mosquitto(persistence=True) as broker:
        # A persistent subscriber session: what the sink sends before the subscriber is back waits for it.
        with collecting(broker.port, [DETECTIONS], qos=1, session=True) as col:

            async def go() -> MqttSink:
                sink = MqttSink(mqtt_cfg(broker.port, qos_detections=1, outbox=bound, message_expiry_s=0), NODE)
                await sink.start()
                for seq in range(before):
                    sink.submit(make_batch(seq), time.monotonic())
                await until(lambda: sink.stats.sent == before, what="the first batches to be acknowledged")
                broker.stop()
                await until(lambda: not sink.stats.connected, what="the sink to notice the broker is gone")
                assert sink.status_reason.startswith(f"mqtt 127.0.0.1:{broker.port}: ")
                for seq in range(before, before + during):
                    sink.submit(make_batch(seq), time.monotonic())
                assert sink.stats.dropped == during - bound  # exact: one count per batch evicted
                broker.start()
                await until(lambda: sink.stats.sent == before + bound, timeout=30, what="the queued batches")
                assert sink.stats.connected and sink.status_reason == "" and sink.connects == 2
                await sink.close(1.0)
                return sink

            sink = asyncio.run(go())
            expected = set(range(before)) | set(range(before + during - bound, before + during))
            assert wait_for(lambda: {m["seq"] for m in col.json_on(DETECTIONS)} >= expected, timeout=30)
            got = {m["seq"] for m in col.json_on(DETECTIONS)}
    assert got == expected
    assert sink.stats.submitted == before + during
    assert sink.stats.dropped == during - bound
    assert sink.stats.sent + sink.stats.dropped == sink.stats.submitted


def test_unreachable_broker_at_start_then_it_appears() -> None:
    port = free_port()  # nothing listens here yet

    async def go() -> MqttSink:
        sink = MqttSink(mqtt_cfg(port, qos_detections=1, outbox=10), NODE)
        attempts = count_attempts(sink)
        await sink.start()  # must not raise, nor wait for a broker that is not there
        await until(lambda: "refused" in sink.status_reason, what="the first attempt to fail")
        await until(lambda: attempts[0] >= 2, what="a retry in the background after start returned")
        assert not sink.stats.connected
        assert sink.status_reason == f"mqtt 127.0.0.1:{port}: connection refused"
        for seq in range(15):
            sink.submit(make_batch(seq), time.monotonic())
        assert (sink.stats.dropped, len(sink._outbox)) == (5, 10)
        with run_mosquitto(port=port):
            await until(lambda: sink.stats.sent == 10, timeout=30, what="delivery once the broker is up")
            await sink.close(1.0)
        return sink

    sink = asyncio.run(go())
    assert sink.stats.submitted == 15 and sink.stats.sent == 10 and sink.stats.dropped == 5


def test_stale_batches_expire_before_sending() -> None:
    port = free_port()

    async def go() -> MqttSink:
        sink = MqttSink(mqtt_cfg(port, qos_detections=1, message_expiry_s=1), NODE)
        await sink.start()
        for seq in range(4):
            sink.submit(make_batch(seq), time.monotonic())
        await asyncio.sleep(1.2)
        with run_mosquitto(port=port):
            await until(lambda: sink.stats.connected, timeout=30, what="connection")
            await until(lambda: sink.expired == 4, what="the stale batches to expire")
            sink.submit(make_batch(9), time.monotonic())
            await until(lambda: sink.stats.sent == 1, what="a fresh batch")
            await sink.close(1.0)
        return sink

    sink = asyncio.run(go())
    assert sink.stats.dropped == 4 and sink.expired == 4


def test_receive_maximum_and_topic_aliases_from_connack() -> None:
    n = 60
    with run_mosquitto(extra=["max_inflight_messages 3", "max_topic_alias 2"]) as broker:
        metrics = f"edgerun/{NODE}/metrics"
        with collecting(broker.port, [DETECTIONS, metrics], qos=1) as col:

            async def go() -> MqttSink:
                sink = MqttSink(mqtt_cfg(broker.port, qos_detections=1, metrics_interval_s=0.2, max_inflight=50), NODE)
                sink.set_metrics_provider(lambda: {"frames": 7})
                await sink.start()
                for seq in range(n):
                    sink.submit(make_batch(seq), time.monotonic())
                await until(lambda: sink.stats.sent == n, what="all batches")
                await until(lambda: len(col.on(metrics)) >= 2, what="metrics messages")
                await sink.close(1.0)
                return sink

            sink = asyncio.run(go())
            assert wait_for(lambda: len(col.on(DETECTIONS)) == n)
            seqs = [m["seq"] for m in col.json_on(DETECTIONS)]
            summary = col.json_on(metrics)[0]
    assert (sink.broker_receive_maximum, sink.inflight_limit, sink.broker_topic_alias_maximum) == (3, 3, 2)
    assert 1 <= sink.peak_inflight <= 3
    assert seqs == list(range(n))  # aliased publishes arrive on the full topic, in order
    assert summary["schema"] == "edgerun.metrics/1" and summary["summary"] == {"frames": 7}
    assert summary["mqtt"]["connected"] is True


def test_events_are_published_and_wait_through_an_outage() -> None:
    port = free_port()
    events = f"edgerun/{NODE}/events"

    async def go() -> None:
        sink = MqttSink(mqtt_cfg(port), NODE)
        await sink.start()
        sink.publish_event("health", {"state": "degraded", "reasons": {"engine": "tensorrt failed"}})
        sink.publish_event("failover", {"from": "tensorrt", "to": "tflite"})
        with run_mosquitto(port=port), collecting(port, [events], qos=1) as col:
            await until(lambda: sink.events_sent == 2, what="events")
            await sink.close(1.0)
            await until(lambda: len(col.on(events)) == 2, what="events at the subscriber")
            got = col.json_on(events)
        assert [e["kind"] for e in got] == ["health", "failover"]
        assert got[0]["schema"] == "edgerun.event/1" and got[0]["node"] == NODE
        assert got[0]["state"] == "degraded" and got[0]["reasons"] == {"engine": "tensorrt failed"}

    asyncio.run(go())


# -- TLS ---------------------------------------------------------------------------------------


def _deliver_over_tls(port: int, **tls) -> MqttSink:
    async def go() -> MqttSink:
        sink = MqttSink(mqtt_cfg(port, qos_detections=1, **tls), NODE)
        await sink.start()
        await until(lambda: sink.stats.connected or "TLS" in sink.status_reason, what="the TLS handshake")
        for seq in range(5):
            sink.submit(make_batch(seq), time.monotonic())
        if sink.stats.connected:
            await until(lambda: sink.stats.sent == 5, what="delivery over TLS")
        await sink.close(1.0)
        return sink

    return asyncio.run(go())


def test_tls_with_ca(certs: Certs) -> None:
    tls = BrokerTls(str(certs.ca), str(certs.server_cert), str(certs.server_key))
    with run_mosquitto(tls=tls) as broker:
        sink = _deliver_over_tls(broker.port, tls_ca=str(certs.ca))
    assert sink.stats.sent == 5 and sink.stats.errors == 0


def test_mutual_tls(certs: Certs) -> None:
    tls = BrokerTls(str(certs.ca), str(certs.server_cert), str(certs.server_key), require_certificate=True)
    with run_mosquitto(tls=tls) as broker:
        sink = _deliver_over_tls(
            broker.port, tls_ca=str(certs.ca), tls_cert=str(certs.client_cert), tls_key=str(certs.client_key)
        )
        assert sink.stats.sent == 5

        async def without_client_cert() -> MqttSink:
            sink = MqttSink(mqtt_cfg(broker.port, tls_ca=str(certs.ca)), NODE)
            attempts = count_attempts(sink)
            await sink.start()
            await until(lambda: "before CONNACK" in sink.status_reason, what="the broker to hang up")
            await until(lambda: attempts[0] >= 3, what="two retries")
            connected, reason = sink.stats.connected, sink.status_reason
            await sink.close(0.5)
            assert not connected
            assert reason.endswith(
                "broker closed the connection before CONNACK (does it require a client"
                " certificate? set tls_cert and tls_key)"
            ), reason
            return sink

        refused = asyncio.run(without_client_cert())
    assert refused.connects == 0


def test_wrong_ca_fails_with_one_clear_line(certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other_ca = make_other_ca(tmp_path)
    tls = BrokerTls(str(certs.ca), str(certs.server_cert), str(certs.server_key))
    caplog.set_level(logging.WARNING, logger="edgerun.sinks.mqtt")
    with run_mosquitto(tls=tls) as broker:

        async def go() -> tuple[bool, str]:
            sink = MqttSink(mqtt_cfg(broker.port, tls_ca=str(other_ca)), NODE)
            attempts = count_attempts(sink)
            await sink.start()
            await until(lambda: "TLS" in sink.status_reason, what="the handshake to fail")
            await until(lambda: attempts[0] >= 3, what="two retries, still logged once")
            state = (sink.stats.connected, sink.status_reason)
            await sink.close(0.5)
            return state

        connected, reason = asyncio.run(go())
    assert not connected
    assert reason.startswith(f"mqtt 127.0.0.1:{broker.port}: TLS: broker certificate not trusted (")
    assert "\n" not in reason
    logged = [r.getMessage() for r in caplog.records if "TLS" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(reason)


def test_unreadable_tls_file_is_a_config_error(tmp_path: Path) -> None:
    from edgerun.errors import ConfigError

    async def go() -> None:
        sink = MqttSink(mqtt_cfg(free_port(), tls_ca=str(tmp_path / "missing.pem")), NODE)
        await sink.start()

    with pytest.raises(ConfigError, match=r"^sinks\.mqtt\.tls_ca: cannot read .*missing\.pem"):
        asyncio.run(go())


def test_listener_skips_malformed_messages() -> None:
    """Untrusted payloads: garbage is counted and skipped, the next good message still prints."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    with run_mosquitto() as broker:
        listener = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "edgerun.commands.listen",
                "--mqtt",
                f"127.0.0.1:{broker.port}",
                "--topic",
                "edgerun/#",
                "--json",
                "--count",
                "2",
                "--seconds",
                "60",
                "--max-bytes",
                "4096",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        good = json.dumps(make_batch(3).to_payload(time.monotonic())).encode()
        bad = [
            b"\xff\xfe not utf-8",
            b"{not json",
            b'{"schema": "edgerun.detections/1", "node": 5}',
            b'{"schema": "edgerun.detections/1", "node": "n", "seq": 1, "ts": 1.0, "model": {"name": "m"},'
            b' "latency_ms": null, "detections": [{"label": "x", "score": 0.5, "box": [1, 2, 3]}]}',
            b"[" * 5000,
            b"ok\x00",
        ]
        try:
            deadline = time.monotonic() + 60
            while listener.poll() is None and time.monotonic() < deadline:
                for payload in bad:
                    pub.publish(f"edgerun/{NODE}/detections", payload, qos=1).wait_for_publish(10)
                pub.publish(f"edgerun/{NODE}/detections", good, qos=1).wait_for_publish(10)
                time.sleep(0.2)
            out, err = listener.communicate(timeout=30)
        finally:
            pub.disconnect()
            pub.loop_stop()
            if listener.poll() is None:
                listener.kill()
                listener.wait()
    assert listener.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["seq"] == 3 for line in lines)
    assert "listen: skipped a bad message on edgerun/test-node/detections:" in err
    assert "bad messages skipped" in err


def test_bench_sinks_short_form() -> None:
    """``edgerun bench --sinks`` in CI's short form: every number is there; none is judged for speed."""
    from edgerun.bench.sinks import bench_sinks, format_table

    result = asyncio.run(bench_sinks(0.3))
    assert set(result["sinks"]) == {"mqtt_qos0", "mqtt_qos1", "dds"}
    for name, r in result["sinks"].items():
        assert r["publish_batches_per_s"] > 0 and r["sustained_batches_per_s"] > 0, name
        assert r["latency_ms_p50"] is not None and r["latency_ms_p50"] > 0, name  # receipts matched to sends
        assert r["latency_delivered_fraction"] > 0.5, name
    stall = result["dds_stall"]  # the stalled reader costs nothing but counted drops
    assert stall["submitted"] > 0 and stall["sent"] + stall["dropped"] == stall["submitted"]
    assert stall["loop_wakeups"] > 0
    assert format_table(result).count("\n") == 3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_a_fleet_object_is_streamed_and_retained_on_its_own_topic_for_a_later_reader() -> None:
    """A station or `edgerun fleet objects` that connects after the owner reported still gets the find: the
    latest of each object is retained on edgerun/fleet/objects/<id>, with the configured expiry."""
    obj = {"schema": "edgerun.object/2", "id": "9f2c41d07b3e8a15", "label": "face", "lat": 53.1172073,
           "lon": -4.1297391, "alt_m": 100.0, "uncertainty_m": 0.6, "first_seen": 1.0, "last_seen": 2.0,
           "score": 0.9, "owner": NODE, "seen_by": [NODE], "ts": 2.5}  # fmt: skip
    with run_mosquitto() as broker:
        with collecting(broker.port, ["edgerun/fleet/objects"]) as live:
            delivered: list[str] = []

            async def go() -> None:
                sink = MqttSink(mqtt_cfg(broker.port, object_retain_s=600), NODE)
                await sink.start()
                await until(lambda: sink.stats.connected, what="connection")
                sink.publish_object(obj, lambda: delivered.append("first"))
                sink.publish_object({**obj, "seen_by": [NODE, "drone-9"], "ts": 3.0})  # an update: the latest stays
                await until(lambda: sink.objects_sent >= 2, what="PUBACKs")
                await sink.close(1.0)

            asyncio.run(go())
            assert delivered == ["first"]  # once, on the broker's PUBACK of the stream message
            assert wait_for(lambda: len(live.on("edgerun/fleet/objects")) == 2)
        with collecting(broker.port, ["edgerun/fleet/objects/+"]) as late:
            assert wait_for(lambda: len(late.on(f"edgerun/fleet/objects/{obj['id']}")) >= 1)
            time.sleep(0.3)
            (msg,) = late.on(f"edgerun/fleet/objects/{obj['id']}")
        assert msg.retain and json.loads(msg.payload)["seen_by"] == [NODE, "drone-9"]
        assert 1 <= msg.properties["MessageExpiryInterval"] <= 600
        done = subprocess.run(
            [sys.executable, "-m", "edgerun", "fleet", "objects", "--mqtt", f"127.0.0.1:{broker.port}",
             "--format", "csv", "--seconds", "0.5"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = done.stdout.strip().splitlines()
    assert len(rows) == 2 and rows[1].startswith(obj["id"]), done.stdout


def test_a_fleet_object_counts_as_delivered_only_once_the_broker_acknowledged_it() -> None:
    """At-least-once reporting rests on this: while the broker is away the object waits, and the node's claims must
    not say "reported" (peers would stay quiet about a find nobody received); the PUBACK after the reconnect says it."""
    port = free_port()
    obj = {"schema": "edgerun.object/2", "id": "00000000000000a1", "label": "person", "lat": 53.1, "lon": -4.1,
           "alt_m": 100.0, "uncertainty_m": 1.0, "first_seen": 1.0, "last_seen": 1.0, "score": 0.9, "owner": NODE,
           "seen_by": [NODE], "ts": 1.0}  # fmt: skip
    delivered: list[float] = []

    async def go() -> None:
        sink = MqttSink(mqtt_cfg(port, object_retain_s=0), NODE)
        await sink.start()
        sink.publish_object(obj, lambda: delivered.append(time.monotonic()))
        await asyncio.sleep(1.5)
        assert delivered == [] and not sink.stats.connected  # no broker yet: not delivered, still queued
        with run_mosquitto(port=port):
            await until(lambda: bool(delivered), timeout=30, what="the PUBACK after the broker came up")
            await sink.close(1.0)

    asyncio.run(go())
    assert len(delivered) == 1

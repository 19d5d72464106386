"""McuBridge without a port: bytes in through ``receive``, DetectionBatches out, counters for /metrics."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from edgerun.config import McuConfig
from edgerun.mcu.bridge import McuBridge
from edgerun.mcu.protocol import Detection, Heartbeat, Hello, Log, encode_message
from edgerun.types import DetectionBatch


def _bridge(batches: list[DetectionBatch]) -> McuBridge:
    cfg = McuConfig(enabled=True, port="/dev/ttyTEST", labels=["person", "car"])
    return McuBridge(cfg, "node-1", batches.append, release_keys=[], clock=lambda: 100.0, wall_clock=lambda: 1.7e9)


def test_one_batch_per_timestamp_in_sensor_pixels() -> None:
    batches: list[DetectionBatch] = []
    bridge = _bridge(batches)
    stream = encode_message(Hello(0xAB, 1, 5, 160, 120, 1, 0, b"person-det"), 0)
    stream += encode_message(Detection(1000, 0, 65535, (1, 2, 30, 40)), 1)
    stream += encode_message(Detection(1000, 1, 32768, (50, 60, 70, 80)), 2)
    stream += encode_message(Detection(1033, 0, 16384, (5, 6, 7, 8)), 3)
    bridge.receive(stream)
    assert [len(b.detections) for b in batches] == [2, 1]
    first = batches[0]
    assert first.node_id == "node-1" and first.engine == "mcu"
    assert (first.model_name, first.model_version) == ("person-det", 5)
    assert (first.meta.source, first.meta.width, first.meta.height) == ("mcu:000000ab", 160, 120)
    np.testing.assert_allclose(first.detections.boxes, [[1, 2, 30, 40], [50, 60, 70, 80]])
    np.testing.assert_allclose(first.detections.scores, [1.0, 32768 / 65535], rtol=1e-6)
    payload = first.to_payload(100.0)
    assert [d["label"] for d in payload["detections"]] == ["person", "car"]
    assert payload["ts"] == 1.7e9 and payload["latency_ms"] == 0.0


def test_a_failing_sink_is_counted_and_the_link_goes_on() -> None:
    calls: list[int] = []

    def broken(batch: DetectionBatch) -> None:
        calls.append(1)
        raise RuntimeError("sink bug")

    bridge = McuBridge(McuConfig(port="/dev/x"), "n", broken, release_keys=[])
    two = [encode_message(Detection(ts, 0, 1, (0, 0, 1, 1)), ts) for ts in (1, 2)]
    bridge.receive(b"".join(two))
    assert len(calls) == 2 and bridge.submit_errors == 2 and bridge.detections == 2


def test_metrics_expose_link_and_mcu_health() -> None:
    bridge = _bridge([])
    good = encode_message(Detection(1, 0, 1, (0, 0, 1, 1)), 0)
    bad = bytearray(encode_message(Detection(2, 0, 1, (0, 0, 1, 1)), 1))
    bad[-3] ^= 0x80
    bridge.receive(good + bytes(bad) + encode_message(Heartbeat(5000, 10, 2, 1), 3))
    registry = CollectorRegistry()
    registry.register(bridge)  # type: ignore[arg-type]  # a collector by its collect(), not by class
    text = generate_latest(registry).decode()
    assert 'edgerun_mcu_detections_total{port="/dev/ttyTEST"} 1.0' in text
    assert 'edgerun_mcu_dropped_frames_total{port="/dev/ttyTEST",reason="bad_crc"} 1.0' in text
    assert 'edgerun_mcu_lost_frames_total{port="/dev/ttyTEST"} 2.0' in text  # seq 1 (bad CRC) and 2 never whole
    assert 'edgerun_mcu_reported_dropped_total{port="/dev/ttyTEST"} 2.0' in text
    assert 'edgerun_mcu_uptime_seconds{port="/dev/ttyTEST"} 5.0' in text
    assert 'edgerun_mcu_connected{port="/dev/ttyTEST"} 0.0' in text


def test_mcu_log_lines_are_rate_limited_and_counted(caplog) -> None:
    bridge = _bridge([])
    with caplog.at_level("DEBUG", logger="edgerun.mcu.bridge"):
        bridge.receive(b"".join(encode_message(Log(2, f"line {i}".encode()), i) for i in range(25)))
    lines = [r for r in caplog.records if "line" in r.getMessage()]
    assert len(lines) == 10 and lines[0].levelname == "WARNING"
    assert bridge.counters()["mcu_logs_suppressed"] == 15

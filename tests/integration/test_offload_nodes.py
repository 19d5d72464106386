"""Three real node processes: one sends its frames to a neighbour, the neighbour is killed, it carries on.

drone-1 offloads (``mode = "always"``, lossless ``zstd`` frames); drone-2 serves the same model for
neighbours and flies drone-1's exact path, so its own detections of each frame are the reference for
the frames it inferred for drone-1; drone-3 is a plain member that serves nobody (once drone-2 is gone
there is no helper left, and drone-1 must serve itself). Both drone-1 and drone-2 export traces to one
real OTLP receiver. What is checked:

* drone-1 published frames that drone-2 inferred, and their detections equal drone-2's own detections of
  the same frames (same model by hash, lossless pixels: the hop changes nothing);
* one offloaded frame is one trace across both nodes: drone-2's SERVER ``infer`` span is the child of
  drone-1's CLIENT ``infer`` span, and drone-1's payload names that trace;
* drone-2 SIGKILLed mid-run: drone-1 loses at most the window's frames in flight (counted as
  ``offload_lost``), then publishes frames it inferred itself; every frame it captured is published or
  dropped-and-counted.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w

from edgerun.demo_swarm import drone_configs, start_drones, stop_drones
from edgerun.testing.otlp import run_otlp_receiver
from hil.offload_bench import summary
from tests.integration.brokers import wait_for
from tests.integration.jsonl import read_records

pytest.importorskip("opentelemetry.sdk", reason="tracing extra not installed (pip install edgerun[tracing])")

WINDOW = 4
FAST_TIMING = {"probe_interval_s": 0.3, "probe_timeout_s": 0.15, "gossip_interval_s": 0.1, "suspicion_mult": 3}


def batches(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(path) if r.get("schema") == "edgerun.detections/1"]


@pytest.fixture(scope="module")
def flight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    with run_otlp_receiver() as receiver:
        crew = drone_configs(tmp, 3)
        weak, helper, bystander = crew
        for drone in crew:
            drone.config["node"]["log_level"] = "info"
            drone.config["swarm"]["timing"] = dict(FAST_TIMING)
        # The helper flies the weak drone's path: its own frames are the weak drone's frames.
        helper.config["source"]["replay"] = dict(weak.config["source"]["replay"])
        weak.config["offload"] = {"mode": "always", "codec": "zstd", "window": WINDOW, "deadline_ms": 1000}
        helper.config["offload"] = {"serve": True}
        tracing = {"enabled": True, "endpoint": receiver.endpoint, "export_interval_s": 0.5}
        weak.config["tracing"] = {**tracing, "sample_ratio": 1.0}
        helper.config["tracing"] = {**tracing, "sample_ratio": 0.0}  # its own frames untraced, its help traced
        for drone in crew:
            (drone.out_dir / "node.toml").write_text(tomli_w.dumps(drone.config))
        start_drones(crew, seconds=120)
        try:
            yield crew, receiver
        finally:
            stop_drones(crew, timeout_s=0.1)


def test_offloaded_frames_match_the_helper_then_the_node_serves_itself(flight):
    crew, receiver = flight
    weak, helper, bystander = crew

    def offloaded() -> list[dict[str, Any]]:
        return [b for b in batches(weak.detections_path) if b["model"]["engine"] == "remote:drone-2"]

    assert wait_for(lambda: len(offloaded()) >= 30, timeout=60), (weak.out_dir / "node.log").read_text()[-3000:]

    # The hop changes nothing: the helper's own detections of the same frames.
    theirs = {b["seq"]: b for b in batches(helper.detections_path)}
    compared = with_faces = 0
    for ours in offloaded():
        reference = theirs.get(ours["seq"])
        if reference is None:
            continue
        compared += 1
        # Published as the origin's own frame: its pose, in the fleet's geodetic frame too.
        assert ours["pose"] == reference["pose"] and ours["pose"]["lat"] and ours["node"] == "drone-1"
        assert len(ours["detections"]) == len(reference["detections"]), (ours, reference)
        with_faces += bool(ours["detections"])
        for a, b in zip(ours["detections"], reference["detections"]):
            assert a["label"] == b["label"]
            assert a["score"] == pytest.approx(b["score"], abs=1e-4)
            assert np.allclose(a["box"], b["box"], atol=0.05), (a, b)
    assert compared >= 20 and with_faces >= 5, (compared, with_faces)

    # One offloaded frame, one trace across both nodes.
    def joined() -> tuple[str, str] | None:
        for trace_id, spans in receiver.traces().items():
            client = [s for s in spans if s.name == "infer" and s.resource.get("service.instance.id") == "drone-1"]
            server = [s for s in spans if s.name == "infer" and s.resource.get("service.instance.id") == "drone-2"]
            if client and server and server[0].parent_id == client[0].span_id:
                assert client[0].kind == "SPAN_KIND_CLIENT" and server[0].kind == "SPAN_KIND_SERVER"
                assert client[0].attributes.get("edgerun.remote.helper") == "drone-2"
                assert server[0].attributes.get("edgerun.remote.origin") == "drone-1"  # as its sealed request said
                assert any(s.name == "frame" and not s.parent_id for s in spans), "the origin's root is there"
                return trace_id, client[0].span_id
        return None

    assert wait_for(lambda: joined() is not None, timeout=20), f"{len(receiver.spans)} spans, none joined"
    trace_id, _ = joined() or ("", "")
    assert wait_for(lambda: any(b.get("trace_id") == trace_id for b in offloaded()), timeout=10)

    # The helper dies: at most the window's frames are lost, then the node serves itself.
    assert helper.proc is not None
    helper.proc.send_signal(signal.SIGKILL)
    killed_at_seq = max(b["seq"] for b in batches(weak.detections_path))

    def local_after_kill() -> int:
        return sum(
            1 for b in batches(weak.detections_path) if b["seq"] > killed_at_seq and b["model"]["engine"] == "tflite"
        )

    assert wait_for(lambda: local_after_kill() >= 30, timeout=30), (weak.out_dir / "node.log").read_text()[-3000:]
    weak.proc.send_signal(signal.SIGTERM)
    bystander.proc.send_signal(signal.SIGTERM)
    weak.proc.wait(30)
    time.sleep(0.2)
    result = summary(weak.out_dir / "node.log")
    assert result is not None, (weak.out_dir / "node.log").read_text()[-3000:]
    lost = result["dropped_by_reason"].get("infer/offload_lost", 0) + result["dropped_by_reason"].get(
        "infer/offload_late", 0
    )
    assert lost <= WINDOW, result
    assert result["captured"] == result["frames"] + result["dropped"], result
    assert result["offload"]["frames"]["done"] == result["offload"]["offloaded"] >= 30, result
    assert result["offload"]["helper"] is None and result["offload"]["frames"].get("helper_dropped", 0) >= 1

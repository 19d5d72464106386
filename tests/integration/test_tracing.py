"""Frames as OpenTelemetry traces: a real node process exports real OTLP (protobuf over HTTP) to a receiver
built on the opentelemetry-proto messages, and each trace's span tree is checked against the frame it was."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgerun.config import parse_config
from edgerun.errors import ConfigError
from edgerun.testing.otlp import ReceivedSpan, run_otlp_receiver
from edgerun.testing.ports import free_port
from tests.integration.jsonl import read_records

STAGES = ["capture", "preprocess", "infer", "decode", "publish"]


class TracedNode:
    def __init__(self, tmp: Path, bundle: Path, endpoint: str, ratio: float) -> None:
        self.tmp = tmp
        self.http_port = free_port()
        self.jsonl = tmp / "detections.jsonl"
        cfg = tmp / "node.toml"
        cfg.write_text(
            f"""[node]
id = "traced-node"
[source]
kind = "replay"
fps = 20
[model]
bundle = "{bundle}"
[sinks.jsonl]
path = "{self.jsonl}"
[service]
http_port = {self.http_port}
[tracing]
enabled = true
endpoint = "{endpoint}"
sample_ratio = {ratio}
export_interval_s = 0.2
export_timeout_s = 1.0
"""
        )
        self.stderr = tmp / "stderr.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr.open("w"),
            env=dict(os.environ),
        )

    def alive(self) -> None:
        assert self.proc.poll() is None, self.stderr.read_text()[-2000:]

    def metric(self, name: str) -> float:
        """A counter from the node's /metrics; -1 before it serves HTTP or when the counter is absent."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return -1.0
        m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else -1.0

    def batches(self) -> dict[int, dict]:
        return {r["seq"]: r for r in read_records(self.jsonl) if r["schema"] == "edgerun.detections/1"}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture
def traced(tmp_path: Path, blazeface_bundle) -> Iterator:  # type: ignore[no-untyped-def]
    nodes: list[TracedNode] = []

    def start(endpoint: str, ratio: float = 1.0) -> TracedNode:
        n = TracedNode(tmp_path, blazeface_bundle.root, endpoint, ratio)
        nodes.append(n)
        return n

    yield start
    for n in nodes:
        n.stop()


def _wait(predicate, node: TracedNode, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        node.alive()
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_each_published_frame_is_one_trace_of_its_stages(traced) -> None:  # type: ignore[no-untyped-def]
    with run_otlp_receiver() as receiver:
        node = traced(receiver.endpoint, ratio=1.0)
        _wait(lambda: len(receiver.traces()) >= 30, node)
        assert node.stop() == 0
        batches = node.batches()
        traces = receiver.traces()
    assert len(traces) >= 30
    # Every frame the node published was traced (ratio 1.0) and exported before it exited (flushed on stop).
    seqs = {root.attributes["edgerun.frame.seq"] for root in _roots(traces)}
    assert seqs == set(batches), f"{len(set(batches) - seqs)} published frames have no trace"
    with_faces = 0
    for root in _roots(traces):
        spans = traces[root.trace_id]
        children = sorted((s for s in spans if s.parent_id == root.span_id), key=lambda s: s.start_ns)
        assert [s.name for s in children] == STAGES
        assert len(spans) == 1 + len(STAGES), "nothing else in the frame's trace"
        # The stages tile the frame: each starts where the one before ended, from the read to the hand-off.
        assert children[0].start_ns == root.start_ns and children[-1].end_ns == root.end_ns
        for before, after in zip(children, children[1:]):
            assert before.end_ns == after.start_ns
        assert all(s.end_ns >= s.start_ns for s in spans)
        batch = batches[root.attributes["edgerun.frame.seq"]]
        # The capture span ends at the capture time the payload carries (wall clock, the same frame).
        assert abs(children[0].end_ns / 1e9 - batch["ts"]) < 2e-3
        assert root.attributes["edgerun.detections"] == len(batch["detections"])
        assert root.attributes["edgerun.model"] == batch["model"]["name"]
        assert children[2].attributes["edgerun.engine"] == root.attributes["edgerun.engine"] == "tflite"
        assert root.resource["service.instance.id"] == "traced-node"
        # The payload names its trace: a find leads to the trace of the frame it was seen in.
        assert batch["trace_id"] == root.trace_id
        with_faces += bool(batch["detections"])
    assert with_faces > 0, "the replay's faces were detected and traced"


def _roots(traces: dict[str, list[ReceivedSpan]]) -> list[ReceivedSpan]:
    roots = [s for spans in traces.values() for s in spans if not s.parent_id]
    assert all(r.name == "frame" for r in roots)
    assert len(roots) == len(traces), "one root per trace"
    return roots


def test_a_collector_that_is_down_costs_spans_not_frames(traced) -> None:  # type: ignore[no-untyped-def]
    with run_otlp_receiver() as receiver:
        receiver.refuse = True
        node = traced(receiver.endpoint, ratio=1.0)
        _wait(lambda: node.metric("edgerun_trace_spans_failed") > 0, node)
        published = len(node.batches())
        _wait(lambda: len(node.batches()) > published + 20, node)  # frames go on while the collector is down
        assert not receiver.spans
        receiver.refuse = False
        _wait(lambda: node.metric("edgerun_trace_spans_exported") > 0 and len(receiver.traces()) > 5, node)
        assert node.stop() == 0
    log = node.stderr.read_text()
    assert "Traceback" not in log
    # The failure is said, once a minute at most, not once per batch (5 batches a second here).
    exporter_lines = [line for line in log.splitlines() if "opentelemetry" in line]
    assert 1 <= len(exporter_lines) <= 2, log[-2000:]


def test_sample_ratio_zero_traces_nothing(traced) -> None:  # type: ignore[no-untyped-def]
    with run_otlp_receiver() as receiver:
        node = traced(receiver.endpoint, ratio=0.0)
        _wait(lambda: len(node.batches()) > 20, node)
        assert node.metric("edgerun_trace_frames_sampled") == 0
        assert node.metric("edgerun_trace_remote_spans") == 0  # served to /metrics, nothing offloaded here
        assert node.stop() == 0
        assert receiver.spans == []
    assert not any("trace_id" in b for b in node.batches().values())


def test_only_sampled_frames_name_a_trace_in_their_payload(traced) -> None:  # type: ignore[no-untyped-def]
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parents[2] / "edgerun/schema/detections-v1.json").read_text())
    with run_otlp_receiver() as receiver:
        node = traced(receiver.endpoint, ratio=0.3)
        _wait(lambda: len(receiver.traces()) >= 10, node)
        assert node.stop() == 0
        batches = node.batches()
        traces = receiver.traces()
    for batch in batches.values():
        jsonschema.validate(batch, schema)
    named = {seq: b["trace_id"] for seq, b in batches.items() if "trace_id" in b}
    traced_seqs = {root.attributes["edgerun.frame.seq"]: root.trace_id for root in _roots(traces)}
    # Exactly the sampled frames carry a trace id, and it is the one their spans went out under.
    assert named == traced_seqs
    assert 0 < len(named) < len(batches)


def test_a_bad_endpoint_is_one_config_line() -> None:
    with pytest.raises(
        ConfigError, match=r"^tracing.endpoint: expected an http:// or https:// URL, got 'collector:4318'$"
    ):
        parse_config({"tracing": {"enabled": True, "endpoint": "collector:4318"}})
    with pytest.raises(ConfigError, match=r"^tracing.sample_ratio: expected"):
        parse_config({"tracing": {"sample_ratio": 1.5}})

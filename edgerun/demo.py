"""``edgerun demo``: the node on its embedded default, scored against the replay's ground truth.

A seeded synthetic flight over a scene made from real photos, BlazeFace short
range on LiteRT, detections to JSON Lines. Because the replay knows where every
face is, the demo reports recall, not just frame rates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.config import Config, parse_config
from edgerun.node import Node
from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)

MIN_TRUTH_HEIGHT_PX = 40.0
MATCH_IOU = 0.5


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of (N,4) and (M,4) x1,y1,x2,y2 boxes."""
    if a.size == 0 or b.size == 0:
        return np.zeros((a.shape[0], b.shape[0]), np.float32)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


class RecallMeter:
    """Counts ground-truth objects of one label and how many a detection matched (greedy, IoU >= 0.5)."""

    def __init__(self, label: str, min_height_px: float = MIN_TRUTH_HEIGHT_PX, iou: float = MATCH_IOU) -> None:
        self.label = label
        self.min_height_px = min_height_px
        self.iou = iou
        self.truths = 0
        self.matched = 0

    def __call__(self, batch: DetectionBatch) -> None:
        meta = batch.meta
        if meta.truth_boxes is None or not len(meta.truth_labels):
            return
        labels = np.asarray(meta.truth_labels)
        boxes = meta.truth_boxes[labels == self.label]
        boxes = boxes[(boxes[:, 3] - boxes[:, 1]) >= self.min_height_px]
        if boxes.shape[0] == 0:
            return
        det = batch.detections
        ids = np.flatnonzero([batch.label_of(c) == self.label for c in det.class_ids.tolist()])
        self.truths += boxes.shape[0]
        if ids.size == 0:
            return
        ious = iou_matrix(boxes, det.boxes[ids])
        # Greedy one-to-one: best pairs first.
        used_t, used_d = set(), set()
        for flat in np.argsort(-ious, axis=None):
            t, d = divmod(int(flat), ious.shape[1])
            if ious[t, d] < self.iou:
                break
            if t in used_t or d in used_d:
                continue
            used_t.add(t)
            used_d.add(d)
        self.matched += len(used_t)

    @property
    def recall(self) -> float | None:
        return self.matched / self.truths if self.truths else None


def demo_config(
    out_dir: Path | None,
    model: str | None = None,
    mqtt: str | None = None,
    dds: bool = False,
    http_port: int | None = None,
    fps: float | None = None,
) -> Config:
    data: dict[str, Any] = {
        "node": {"id": "demo-node"},
        "source": {"kind": "replay"},
        "sinks": {"jsonl": {"path": str(out_dir / "detections.jsonl") if out_dir else "-"}},
        "service": {"http_port": 0 if http_port is None else http_port},
    }
    if fps is not None:
        data["source"]["fps"] = fps
    if not model:
        from edgerun.models.demo import ensure_demo_bundle

        # The demo may fetch its bundle; a node started by `edgerun run` never does.
        model = str(ensure_demo_bundle().root)
    data["model"] = {"bundle": model}
    if mqtt:
        host, _, port = mqtt.rpartition(":")
        data["sinks"]["mqtt"] = {"enabled": True, "host": host or "127.0.0.1", "port": int(port)}
    if dds:
        data["sinks"]["dds"] = {"enabled": True}
    return parse_config(data)


async def _status_line(node: Node, stop: asyncio.Event) -> None:
    """A live one-line status on a terminal (stderr), refreshed twice a second."""
    while not stop.is_set():
        stats = node.stats
        e2e = stats.end_to_end
        if e2e.total:
            line = (
                f"\r{node.fps():5.1f} fps  p50 {e2e.percentile_ms(50):6.1f} ms  p99 {e2e.percentile_ms(99):6.1f} ms"
                f"  frames {stats.published}  detections {stats.detections}  dropped {stats.dropped_total}  "
            )
            sys.stderr.write(line)
            sys.stderr.flush()
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    sys.stderr.write("\n")


class LocalListeners:
    """``edgerun listen`` subprocesses that prove the demo's MQTT and DDS messages really arrive.

    Each writes what it receives as JSON lines next to the demo's other outputs.
    """

    def __init__(self, out_dir: Path, mqtt_port: int | None, dds: bool) -> None:
        self.files: dict[str, Path] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        cmd = [sys.executable, "-m", "edgerun", "listen", "--json"]
        if mqtt_port is not None:
            self._start("mqtt", [*cmd, "--mqtt", f"127.0.0.1:{mqtt_port}", "--qos", "1"], out_dir)
        if dds:
            self._start("dds", [*cmd, "--dds"], out_dir)

    def _start(self, name: str, cmd: list[str], out_dir: Path) -> None:
        path = out_dir / f"received-{name}.jsonl"
        self.files[name] = path
        with path.open("wb") as out:
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL))

    def stop(self) -> dict[str, int]:
        """Stop the listeners; how many detection messages each received."""
        time.sleep(0.5)  # the last batches are still on the wire
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        return {name: sum(1 for _ in path.open()) for name, path in self.files.items()}


async def run_demo(cfg: Config, seconds: float | None, out_dir: Path | None, live: bool) -> dict[str, Any]:
    recall = RecallMeter("face")
    node = Node(cfg, observers=[recall])
    listeners = None
    if out_dir is not None and (cfg.sinks.mqtt.enabled or cfg.sinks.dds.enabled):
        mqtt_port = cfg.sinks.mqtt.port if cfg.sinks.mqtt.enabled and cfg.sinks.mqtt.host == "127.0.0.1" else None
        listeners = LocalListeners(out_dir, mqtt_port, cfg.sinks.dds.enabled)
        await asyncio.sleep(1.0)  # let the subscribers connect and match before the first frame
    stop = asyncio.Event()
    status = asyncio.create_task(_status_line(node, stop)) if live else None
    t0 = time.monotonic()
    try:
        await node.run(seconds=seconds)
    finally:
        stop.set()
        if status is not None:
            await status
    summary = node.summary()
    if listeners is not None:
        summary["received"] = listeners.stop()
    summary["recall"] = None if recall.recall is None else round(recall.recall, 4)
    summary["recall_truths"] = recall.truths
    summary["wall_s"] = round(time.monotonic() - t0, 3)
    if out_dir is not None and node.pipeline is not None:
        from edgerun.service.snapshot import render_snapshot

        png = render_snapshot(node.pipeline.snapshot, ".png")
        if png is not None:
            (out_dir / "snapshot.png").write_bytes(png)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    recall = summary.get("recall")
    received = summary.get("received")
    heard = "".join(f"  {name} listener got {count}" for name, count in (received or {}).items())
    return (
        f"frames {summary['frames']}  fps {summary['fps']}  latency p50 {summary['latency_p50_ms']} ms"
        f"  p99 {summary['latency_p99_ms']} ms  detections {summary['detections']}  dropped {summary['dropped']}"
        f"  recall {'n/a' if recall is None else f'{recall:.3f}'} ({summary['recall_truths']} faces)"
        f"{heard}"
    )

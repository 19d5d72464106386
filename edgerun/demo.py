"""``edgerun demo``: the node on its embedded default, scored against the replay's ground truth.

A seeded synthetic flight over a scene made from real photos, BlazeFace short
range on LiteRT, detections to JSON Lines. Because the replay knows where every
face is, the demo reports recall, not just frame rates.

``snapshot.png`` is the frame of the run with the most detections (ground truth
drawn too), not the last one, which often shows bare ground; ``contact_sheet.png``
shows a few annotated frames spread over the flight. The replay is a pure
function of the camera pose each batch carries, so those frames are rendered
again after the run from their batches: the run itself copies no image for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from edgerun.config import Config, parse_config
from edgerun.hostport import parse_hostport
from edgerun.node import Node
from edgerun.testing.scoring import MATCH_IOU, MIN_TRUTH_HEIGHT_PX, greedy_matches, iou_matrix
from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)


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
        self.matched += greedy_matches(iou_matrix(boxes, det.boxes[ids]), self.iou)

    @property
    def recall(self) -> float | None:
        return self.matched / self.truths if self.truths else None


def _kept(batch: DetectionBatch) -> DetectionBatch:
    """A batch whose arrays are its own (decoders may reuse their output buffers for the next frame)."""
    det = batch.detections
    keypoints = None if det.keypoints is None else det.keypoints.copy()
    own = dataclasses.replace(
        det, boxes=det.boxes.copy(), scores=det.scores.copy(), class_ids=det.class_ids.copy(), keypoints=keypoints
    )
    return dataclasses.replace(batch, detections=own)


class FrameChooser:
    """Observer that keeps the batch with the most detections and batches spread over the flight.

    Ties go to the frame with more ground truth in view, then to the more confident one
    (sum of scores: a face seen whole rather than cut by the frame edge), then the earlier.
    ``spread`` keeps at most ``capacity`` batches at even frame intervals, thinning
    itself (every other one) when full, so memory stays bounded on any run length.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.best: DetectionBatch | None = None
        self._best_key: tuple[int, int, float] = (-1, -1, 0.0)
        self.spread: list[DetectionBatch] = []
        self.capacity = capacity
        self._stride = 1

    def __call__(self, batch: DetectionBatch) -> None:
        truth = 0 if batch.meta.truth_boxes is None else len(batch.meta.truth_boxes)
        key = (len(batch.detections), truth, float(batch.detections.scores.sum()))
        if key > self._best_key:
            self.best, self._best_key = _kept(batch), key
        if batch.meta.seq % self._stride == 0:
            self.spread.append(_kept(batch))
            if len(self.spread) >= self.capacity:
                self.spread = self.spread[::2]
                self._stride *= 2

    def sheet_batches(self, count: int) -> list[DetectionBatch]:
        """``count`` batches at even intervals from the first kept to the last."""
        if len(self.spread) <= count:
            return list(self.spread)
        picks = np.linspace(0, len(self.spread) - 1, count).round().astype(int)
        return [self.spread[i] for i in picks]


def annotated_frame(batch: DetectionBatch, image: np.ndarray) -> np.ndarray:
    """``image`` (the batch's frame) with detections, ground truth and a caption drawn."""
    from edgerun.pipeline.runner import Snapshot
    from edgerun.service.snapshot import draw_batch

    holder = Snapshot(0.0)
    holder.image, holder.batch = image, batch
    canvas = draw_batch(holder)
    truth = 0 if batch.meta.truth_boxes is None else len(batch.meta.truth_boxes)
    caption = f"frame {batch.meta.seq}: {len(batch.detections)} detected, {truth} in ground truth"
    cv2.putText(canvas, caption, (8, 22), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (0, 0, 0), 3, cv2.LINE_AA)
    cv2.putText(canvas, caption, (8, 22), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (255, 255, 255), 1, cv2.LINE_AA)
    return canvas


def contact_sheet(frames: list[np.ndarray], columns: int = 3, width: int = 320) -> np.ndarray:
    """Frames scaled to ``width`` and laid out in rows of ``columns`` (blank cells filled black)."""
    h, w = frames[0].shape[:2]
    height = round(h * width / w)
    rows = -(-len(frames) // columns)
    sheet = np.zeros((rows * height, columns * width, 3), np.uint8)
    for i, frame in enumerate(frames):
        r, c = divmod(i, columns)
        sheet[r * height : (r + 1) * height, c * width : (c + 1) * width] = cv2.resize(
            frame, (width, height), interpolation=cv2.INTER_AREA
        )
    return sheet


def write_flight_images(cfg: Config, chooser: FrameChooser, out_dir: Path, sheet_frames: int = 6) -> list[str]:
    """``snapshot.png`` (most detections) and ``contact_sheet.png``, re-rendered from the replay; the files written."""
    from edgerun.sources.replay import ReplaySource

    if chooser.best is None or cfg.source.kind != "replay":
        return []
    replay = ReplaySource(cfg.source.replay, fps=cfg.source.fps)
    replay.open()
    try:

        def frame_of(batch: DetectionBatch) -> np.ndarray:
            assert batch.meta.pose is not None
            image = np.empty((batch.meta.height, batch.meta.width, 3), np.uint8)
            replay.render(batch.meta.pose, image)
            return annotated_frame(batch, image)

        cv2.imwrite(str(out_dir / "snapshot.png"), frame_of(chooser.best))
        sheet = contact_sheet([frame_of(b) for b in chooser.sheet_batches(sheet_frames)])
        cv2.imwrite(str(out_dir / "contact_sheet.png"), sheet)
    finally:
        replay.close()
    return ["snapshot.png", "contact_sheet.png"]


def add_demo_settings(
    data: dict[str, Any], *, model: str | None, mqtt: str | None, dds: bool, fps: float | None
) -> None:
    """The demo's model (fetched when not cached), replay rate and local sinks, into a node config's data."""
    if fps is not None:
        data["source"]["fps"] = fps
    if not model:
        from edgerun.models.demo import ensure_demo_bundle

        # The demo may fetch its bundle; a node started by `edgerun run` never does.
        model = str(ensure_demo_bundle().root)
    data["model"] = {"bundle": model}
    if mqtt:
        host, port = parse_hostport(mqtt, "--mqtt")
        data["sinks"]["mqtt"] = {"enabled": True, "host": host, "port": port}
    if dds:
        data["sinks"]["dds"] = {"enabled": True}


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
    add_demo_settings(data, model=model, mqtt=mqtt, dds=dds, fps=fps)
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
    chooser = FrameChooser()
    node = Node(cfg, observers=[recall, chooser])
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
        written = write_flight_images(cfg, chooser, out_dir)
        if not written:  # not a replay: the node's last snapshot is all there is
            from edgerun.service.snapshot import render_snapshot

            png = render_snapshot(node.pipeline.snapshot, ".png")
            if png is not None:
                (out_dir / "snapshot.png").write_bytes(png)
        if chooser.best is not None:
            summary["snapshot_frame"] = {"seq": chooser.best.meta.seq, "detections": len(chooser.best.detections)}
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

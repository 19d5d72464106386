"""The data that flows from a frame source to the sinks.

Detections are kept as parallel numpy arrays (one row per object) so decoders
and the letterbox mapping stay vectorised; they become JSON only at the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Version of the JSON payload published by every sink; bump on any breaking change.
PAYLOAD_SCHEMA = "edgerun.detections/1"


@dataclass(slots=True)
class Pose:
    """Camera pose: position in a local east/north/up frame (metres) and attitude (degrees)."""

    east_m: float
    north_m: float
    up_m: float
    yaw_deg: float = 0.0
    pitch_deg: float = 0.0
    roll_deg: float = 0.0
    hfov_deg: float = 60.0

    def to_payload(self) -> dict[str, float]:
        return {
            "east_m": round(self.east_m, 3),
            "north_m": round(self.north_m, 3),
            "up_m": round(self.up_m, 3),
            "yaw_deg": round(self.yaw_deg, 3),
            "pitch_deg": round(self.pitch_deg, 3),
            "roll_deg": round(self.roll_deg, 3),
            "hfov_deg": round(self.hfov_deg, 3),
        }


@dataclass(slots=True)
class Detections:
    """N detections as parallel arrays.

    ``boxes`` are ``(N, 4)`` float32 ``x1, y1, x2, y2``. Decoders return them
    normalised to the model input (0..1); after the letterbox is undone they are
    source-frame pixels. ``keypoints`` is ``(N, K, 2)`` in the same coordinates,
    or ``None`` for models without keypoints.
    """

    boxes: np.ndarray
    scores: np.ndarray
    class_ids: np.ndarray
    keypoints: np.ndarray | None = None

    @classmethod
    def empty(cls, num_keypoints: int = 0) -> Detections:
        kp = np.zeros((0, num_keypoints, 2), np.float32) if num_keypoints else None
        return cls(
            boxes=np.zeros((0, 4), np.float32),
            scores=np.zeros((0,), np.float32),
            class_ids=np.zeros((0,), np.int32),
            keypoints=kp,
        )

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def select(self, index: np.ndarray) -> Detections:
        """The subset at ``index`` (a boolean mask or integer indices)."""
        return Detections(
            boxes=self.boxes[index],
            scores=self.scores[index],
            class_ids=self.class_ids[index],
            keypoints=None if self.keypoints is None else self.keypoints[index],
        )


@dataclass(slots=True)
class FrameMeta:
    """What is known about one captured frame before inference."""

    seq: int
    source: str
    width: int
    height: int
    wall_time: float  # time.time() at capture, for payloads
    t_capture: float  # time.monotonic() at capture, for latency
    pose: Pose | None = None
    # Ground truth from synthetic sources: (M, 4) xyxy pixels and their labels.
    truth_boxes: np.ndarray | None = None
    truth_labels: tuple[str, ...] = ()


@dataclass(slots=True)
class DetectionBatch:
    """All detections of one frame, in source-frame pixels, ready for the sinks."""

    node_id: str
    meta: FrameMeta
    detections: Detections
    labels: tuple[str, ...]
    model_name: str
    model_version: int
    engine: str
    # Monotonic timestamps of each stage's end, keyed by stage name.
    stamps: dict[str, float] = field(default_factory=dict)

    def label_of(self, class_id: int) -> str:
        if 0 <= class_id < len(self.labels):
            return self.labels[class_id]
        return str(class_id)

    def to_payload(self, t_publish: float | None = None) -> dict[str, Any]:
        """The versioned JSON payload documented in README.md (schema ``edgerun.detections/1``)."""
        det = self.detections
        boxes = np.round(det.boxes.astype(np.float64), 1).tolist()
        scores = np.round(det.scores.astype(np.float64), 4).tolist()
        ids = det.class_ids.tolist()
        keypoints = None if det.keypoints is None else np.round(det.keypoints.astype(np.float64), 1).tolist()
        items: list[dict[str, Any]] = []
        for i, (box, score, cid) in enumerate(zip(boxes, scores, ids)):
            item: dict[str, Any] = {
                "label": self.label_of(cid),
                "class_id": cid,
                "score": score,
                "box": box,
            }
            if keypoints is not None:
                item["keypoints"] = keypoints[i]
            items.append(item)
        latency_ms = None
        if t_publish is not None:
            latency_ms = round((t_publish - self.meta.t_capture) * 1000.0, 3)
        return {
            "schema": PAYLOAD_SCHEMA,
            "node": self.node_id,
            "seq": self.meta.seq,
            "ts": round(self.meta.wall_time, 6),
            "frame": {
                "width": self.meta.width,
                "height": self.meta.height,
                "source": self.meta.source,
            },
            "model": {
                "name": self.model_name,
                "version": self.model_version,
                "engine": self.engine,
            },
            "latency_ms": latency_ms,
            "pose": None if self.meta.pose is None else self.meta.pose.to_payload(),
            "detections": items,
        }

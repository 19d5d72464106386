"""The latest frame with its detections drawn, encoded on demand (/snapshot.jpg, the demo's PNG)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import cv2
import numpy as np

if TYPE_CHECKING:
    from edgerun.pipeline.runner import Snapshot

BOX_COLOUR = (0, 220, 0)  # BGR
TRUTH_COLOUR = (255, 160, 0)


def draw_batch(snapshot: Snapshot) -> np.ndarray:
    """A copy of the snapshot frame with detections (green) and ground truth (blue, thin) drawn."""
    with snapshot.lock:
        if snapshot.image is None or snapshot.batch is None:
            raise LookupError("no frame yet")
        canvas = snapshot.image.copy()
        batch = snapshot.batch
    meta = batch.meta
    if meta.truth_boxes is not None:
        for x1, y1, x2, y2 in meta.truth_boxes.astype(int).tolist():
            cv2.rectangle(canvas, (x1, y1), (x2, y2), TRUTH_COLOUR, 1)
    det = batch.detections
    rows = zip(det.boxes.astype(int).tolist(), det.scores.tolist(), det.class_ids.tolist())
    for i, (box, score, cid) in enumerate(rows):
        x1, y1, x2, y2 = box
        cv2.rectangle(canvas, (x1, y1), (x2, y2), BOX_COLOUR, 2)
        text = f"{batch.label_of(cid)} {score:.2f}"
        cv2.putText(canvas, text, (x1, max(12, y1 - 4)), cv2.FONT_HERSHEY_SIMPLEX, 0.5, BOX_COLOUR, 1, cv2.LINE_AA)
        if det.keypoints is not None:
            for x, y in det.keypoints[i].astype(int).tolist():
                cv2.circle(canvas, (x, y), 2, BOX_COLOUR, -1)
    return canvas


def render_snapshot(snapshot: Snapshot, ext: str = ".jpg") -> bytes | None:
    """Encoded image bytes, or None when no frame has been decoded yet."""
    try:
        canvas = draw_batch(snapshot)
    except LookupError:
        return None
    ok, buf = cv2.imencode(ext, canvas)
    return buf.tobytes() if ok else None

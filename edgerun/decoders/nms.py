"""Non-maximum suppression: MediaPipe's weighted clustering and greedy class-aware NMS.

Both take boxes as ``(M, 4)`` ``x1, y1, x2, y2`` that have already been
filtered by score, so M is small (tens to a few thousand). Each loop iteration
produces one *kept* box and does its overlap test against all remaining boxes
at once, so the Python loop runs as many times as there are results, never
once per candidate.
"""

from __future__ import annotations

import numpy as np


def box_area(boxes: np.ndarray) -> np.ndarray:
    """Areas of ``(M, 4)`` xyxy boxes; inverted boxes count as empty."""
    w = np.maximum(boxes[:, 2] - boxes[:, 0], 0.0)
    h = np.maximum(boxes[:, 3] - boxes[:, 1], 0.0)
    return w * h


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box in ``a`` (M, 4) with every box in ``b`` (N, 4): (M, N)."""
    a = np.asarray(a, dtype=np.float32).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float32).reshape(-1, 4)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.maximum(x2 - x1, 0.0) * np.maximum(y2 - y1, 0.0)
    union = box_area(a)[:, None] + box_area(b)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0.0)


def _iou_one_to_many(box: np.ndarray, area: np.floating, boxes: np.ndarray, areas: np.ndarray) -> np.ndarray:
    x1 = np.maximum(boxes[:, 0], box[0])
    y1 = np.maximum(boxes[:, 1], box[1])
    x2 = np.minimum(boxes[:, 2], box[2])
    y2 = np.minimum(boxes[:, 3], box[3])
    inter = np.maximum(x2 - x1, 0.0) * np.maximum(y2 - y1, 0.0)
    union = areas + area - inter
    # Two empty boxes have no union; MediaPipe and torchvision both call that no overlap.
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0.0)


def weighted_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    iou_threshold: float,
    keypoints: np.ndarray | None = None,
    max_results: int = -1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """MediaPipe's WEIGHTED non-maximum suppression (``NonMaxSuppressionCalculator``).

    Take the best remaining box; every remaining box whose IoU with it is
    above ``iou_threshold`` joins its cluster and leaves the pool. The cluster
    becomes one detection: the score-weighted mean of its boxes and keypoints,
    with the score of its best member. Averaging instead of discarding is what
    keeps BlazeFace boxes and eye keypoints steady from frame to frame.

    Returns ``(boxes, scores, keypoints, top_index)``, best first, where
    ``top_index`` is the input index of each cluster's best box (for class ids).
    One deliberate difference: the best box always belongs to its own cluster,
    where MediaPipe stops altogether if that box has zero area (IoU 0 with itself).
    """
    count = int(scores.shape[0])
    num_kp = 0 if keypoints is None else int(keypoints.shape[1])
    if count == 0:
        kp_empty = None if keypoints is None else np.zeros((0, num_kp, 2), np.float32)
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.float32), kp_empty, np.zeros((0,), np.intp)

    order = np.argsort(-scores, kind="stable")
    sorted_boxes = np.asarray(boxes, dtype=np.float32)[order]
    sorted_scores = np.asarray(scores, dtype=np.float32)[order]
    sorted_kp = None if keypoints is None else np.asarray(keypoints, dtype=np.float32)[order].reshape(count, -1)
    areas = box_area(sorted_boxes)

    limit = count if max_results < 0 else min(count, max_results)
    out_boxes = np.empty((limit, 4), np.float32)
    out_scores = np.empty((limit,), np.float32)
    out_kp = None if sorted_kp is None else np.empty((limit, sorted_kp.shape[1]), np.float32)
    out_top = np.empty((limit,), np.intp)

    remaining = np.arange(count)
    kept = 0
    while remaining.size and kept < limit:
        top = remaining[0]
        overlap = _iou_one_to_many(sorted_boxes[top], areas[top], sorted_boxes[remaining], areas[remaining])
        in_cluster = overlap > iou_threshold
        in_cluster[0] = True
        cluster = remaining[in_cluster]
        remaining = remaining[~in_cluster]

        weights = sorted_scores[cluster]
        total = weights.sum(dtype=np.float32)
        out_boxes[kept] = weights @ sorted_boxes[cluster] / total
        if out_kp is not None and sorted_kp is not None:
            out_kp[kept] = weights @ sorted_kp[cluster] / total
        out_scores[kept] = sorted_scores[top]
        out_top[kept] = order[top]
        kept += 1

    kp_out = None if out_kp is None else out_kp[:kept].reshape(kept, num_kp, 2)
    return out_boxes[:kept], out_scores[:kept], kp_out, out_top[:kept]


def hard_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    iou_threshold: float,
    class_ids: np.ndarray | None = None,
    max_results: int = -1,
) -> np.ndarray:
    """Greedy NMS; with ``class_ids`` only boxes of the same class suppress each other.

    Returns the indices of the kept boxes, best first. Class awareness uses the
    usual offset trick (torchvision's ``batched_nms``): each class is shifted
    to its own region of the plane, so one pass handles all classes and boxes
    of different classes can never overlap.
    """
    count = int(scores.shape[0])
    if count == 0 or max_results == 0:
        return np.zeros((0,), np.intp)
    order = np.argsort(-scores, kind="stable")
    # float64 so that large class offsets do not eat the precision of the coordinates.
    sorted_boxes = np.asarray(boxes, dtype=np.float64)[order]
    if class_ids is not None and count > 1:
        extent = float(np.abs(sorted_boxes).max()) * 2.0 + 1.0
        sorted_boxes += (np.asarray(class_ids)[order].astype(np.float64) * extent)[:, None]
    areas = box_area(sorted_boxes)

    limit = count if max_results < 0 else min(count, max_results)
    keep = np.empty((limit,), np.intp)
    remaining = np.arange(count)
    kept = 0
    while remaining.size and kept < limit:
        top = remaining[0]
        keep[kept] = top
        kept += 1
        rest = remaining[1:]
        overlap = _iou_one_to_many(sorted_boxes[top], areas[top], sorted_boxes[rest], areas[rest])
        remaining = rest[overlap <= iou_threshold]
    return order[keep[:kept]]

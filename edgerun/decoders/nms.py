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


# Up to this many boxes, weighted NMS forms its clusters in plain Python and averages all of them
# with one matrix product. A frame usually has a few to tens of candidates, where each numpy call
# (microseconds of interpreter time, under the GIL the pipeline workers share) costs more than the
# arithmetic: measured on BlazeFace frames, 6 candidates, decode 140 -> ~70 us. Above it, one
# vectorised overlap test per cluster.
_SMALL = 32


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
    values = np.asarray(boxes, dtype=np.float32).reshape(count, 4)
    if keypoints is not None:
        values = np.concatenate([values, np.asarray(keypoints, dtype=np.float32).reshape(count, 2 * num_kp)], axis=1)
    out, out_scores, top = weighted_nms_rows(values, scores, iou_threshold, max_results)
    kept = int(out_scores.shape[0])
    kp_out = None if keypoints is None else np.ascontiguousarray(out[:, 4:]).reshape(kept, num_kp, 2)
    return np.ascontiguousarray(out[:, :4]), out_scores, kp_out, top


def weighted_nms_rows(
    values: np.ndarray, scores: np.ndarray, iou_threshold: float, max_results: int = -1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weighted_nms`` on rows of ``x1, y1, x2, y2`` followed by any values averaged with the box
    (keypoints): one weighted mean per cluster covers them all. Returns ``(rows, scores, top_index)``."""
    count = int(scores.shape[0])
    limit = count if max_results < 0 else min(count, max_results)
    if count == 0 or limit == 0:
        return (
            np.zeros((0, values.shape[1]), np.float32),
            np.zeros((0,), np.float32),
            np.zeros((0,), np.intp),
        )
    order = np.argsort(-scores, kind="stable")
    rows = np.asarray(values, dtype=np.float32)[order]
    sorted_scores = np.asarray(scores, dtype=np.float32)[order]

    if count <= _SMALL:
        clusters = _clusters(rows[:, :4].tolist(), iou_threshold, limit)
        weights = np.zeros((len(clusters), count), np.float32)
        for c, members in enumerate(clusters):
            weights[c, members] = sorted_scores[members]
        tops = [members[0] for members in clusters]
        means = weights @ rows
        means /= weights.sum(axis=1, keepdims=True)
        return means, sorted_scores[tops], order[tops]

    out_rows = np.empty((limit, rows.shape[1]), np.float32)
    out_scores = np.empty((limit,), np.float32)
    out_top = np.empty((limit,), np.intp)
    areas = box_area(rows)
    pool = np.arange(count)
    kept = 0
    while pool.size and kept < limit:
        top = pool[0]
        overlap = _iou_one_to_many(rows[top], areas[top], rows[pool], areas[pool])
        in_cluster = overlap > iou_threshold
        in_cluster[0] = True
        cluster = pool[in_cluster]
        pool = pool[~in_cluster]
        weights = sorted_scores[cluster]
        out_rows[kept] = weights @ rows[cluster] / weights.sum(dtype=np.float32)
        out_scores[kept] = sorted_scores[top]
        out_top[kept] = order[top]
        kept += 1
    return out_rows[:kept], out_scores[:kept], out_top[:kept]


def _clusters(boxes: list[list[float]], iou_threshold: float, limit: int) -> list[list[int]]:
    """Weighted NMS clusters of a few boxes sorted best first, each led by its best box."""
    areas = [max(x2 - x1, 0.0) * max(y2 - y1, 0.0) for x1, y1, x2, y2 in boxes]
    pool = list(range(len(boxes)))
    clusters: list[list[int]] = []
    while pool and len(clusters) < limit:
        top = pool[0]
        tx1, ty1, tx2, ty2 = boxes[top]
        top_area = areas[top]
        members: list[int] = [top]
        rest: list[int] = []
        for i in pool[1:]:
            x1, y1, x2, y2 = boxes[i]
            inter = max(min(x2, tx2) - max(x1, tx1), 0.0) * max(min(y2, ty2) - max(y1, ty1), 0.0)
            union = areas[i] + top_area - inter
            # Two empty boxes have no union; MediaPipe and torchvision both call that no overlap.
            (members if union > 0.0 and inter / union > iou_threshold else rest).append(i)
        clusters.append(members)
        pool = rest
    return clusters


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

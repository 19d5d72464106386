"""Detections scored against the replay's ground truth: pairwise IoU and one-to-one matching.

The demo's recall, the swarm demo's and the HIL rig's fleet scores and the ground-error bench all match
detections to true boxes the same way, with these thresholds.
"""

from __future__ import annotations

import numpy as np

# Ground-truth boxes shorter than this (pixels) are left out of the score.
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


def greedy_pairs(ious: np.ndarray, min_iou: float = MATCH_IOU) -> list[tuple[int, int]]:
    """(truth, detection) index pairs matched one-to-one at IoU >= ``min_iou``, best pairs first."""
    used_t: set[int] = set()
    used_d: set[int] = set()
    pairs = []
    for flat in np.argsort(-ious, axis=None):
        t, d = divmod(int(flat), ious.shape[1])
        if ious[t, d] < min_iou:
            break
        if t in used_t or d in used_d:
            continue
        used_t.add(t)
        used_d.add(d)
        pairs.append((t, d))
    return pairs


def greedy_matches(ious: np.ndarray, min_iou: float = MATCH_IOU) -> int:
    """Truths (rows) matched one-to-one to detections (columns) at IoU >= ``min_iou``, best pairs first."""
    return len(greedy_pairs(ious, min_iou))

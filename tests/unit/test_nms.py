"""Weighted (MediaPipe) and hard class-aware NMS, against hand-worked cases and literal reference loops."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.decoders.nms import box_iou, hard_nms, weighted_nms


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def test_box_iou_known_values():
    a = f32([[0, 0, 2, 2]])
    b = f32([[1, 1, 3, 3], [0, 0, 2, 2], [2, 0, 4, 2], [5, 5, 6, 6], [1, 1, 1, 1]])
    np.testing.assert_allclose(box_iou(a, b), [[1 / 7, 1.0, 0.0, 0.0, 0.0]], rtol=1e-6)
    # Two empty boxes: no union, no overlap (not NaN).
    assert box_iou(f32([[1, 1, 1, 1]]), f32([[1, 1, 1, 1]]))[0, 0] == 0.0


# ---- weighted NMS ---------------------------------------------------------------------------


def mediapipe_weighted_reference(boxes, scores, keypoints, threshold):
    """A literal port of NonMaxSuppressionCalculator::WeightedNonMaxSuppression (IoU overlap)."""

    def iou(r1, r2):
        ix = max(0.0, min(r1[2], r2[2]) - max(r1[0], r2[0]))
        iy = max(0.0, min(r1[3], r2[3]) - max(r1[1], r2[1]))
        inter = ix * iy
        norm = (r1[2] - r1[0]) * (r1[3] - r1[1]) + (r2[2] - r2[0]) * (r2[3] - r2[1]) - inter
        return inter / norm if norm > 0 else 0.0

    remained = sorted(range(len(scores)), key=lambda i: -scores[i])
    out = []
    while remained:
        top = remained[0]
        candidates, rest = [], []
        for i in remained:
            (candidates if iou(boxes[i], boxes[top]) > threshold else rest).append(i)
        total = sum(scores[i] for i in candidates)
        box = [sum(boxes[i][k] * scores[i] for i in candidates) / total for k in range(4)]
        kps = [
            [sum(keypoints[i][j][d] * scores[i] for i in candidates) / total for d in range(2)]
            for j in range(len(keypoints[top]))
        ]
        out.append((box, scores[top], kps, top))
        if len(rest) == len(remained):
            break
        remained = rest
    return out


def test_weighted_nms_averages_a_cluster_by_score():
    boxes = f32([[0.10, 0.10, 0.30, 0.30], [0.12, 0.12, 0.32, 0.32], [0.60, 0.60, 0.80, 0.80]])
    scores = f32([0.6, 0.9, 0.7])
    kps = f32([[[0.2, 0.2]], [[0.3, 0.3]], [[0.7, 0.7]]])
    out_boxes, out_scores, out_kps, top = weighted_nms(boxes, scores, 0.3, kps)

    assert out_scores.tolist() == pytest.approx([0.9, 0.7])  # best member's score, best cluster first
    assert top.tolist() == [1, 2]
    w = np.array([0.9, 0.6]) / 1.5
    np.testing.assert_allclose(out_boxes[0], w[0] * boxes[1] + w[1] * boxes[0], rtol=1e-6)
    np.testing.assert_allclose(out_kps[0, 0], w[0] * kps[1, 0] + w[1] * kps[0, 0], rtol=1e-6)
    np.testing.assert_allclose(out_boxes[1], boxes[2])  # a cluster of one is unchanged
    assert out_boxes.dtype == np.float32 and out_kps.shape == (2, 1, 2)


def test_weighted_nms_threshold_is_strict():
    boxes = f32([[0, 0, 2, 2], [1, 1, 3, 3]])  # IoU 1/7
    scores = f32([0.9, 0.8])
    assert len(weighted_nms(boxes, scores, 0.2)[1]) == 2
    assert len(weighted_nms(boxes, scores, 0.1)[1]) == 1
    assert len(weighted_nms(boxes, scores, 1 / 7 + 1e-6)[1]) == 2


def test_weighted_nms_max_results_and_empty():
    boxes = f32([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]])
    b, s, k, top = weighted_nms(boxes, f32([0.5, 0.9, 0.7]), 0.3, max_results=2)
    assert s.tolist() == pytest.approx([0.9, 0.7]) and top.tolist() == [1, 2] and k is None
    b, s, k, top = weighted_nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), 0.3, np.zeros((0, 6, 2)))
    assert b.shape == (0, 4) and s.shape == (0,) and k.shape == (0, 6, 2) and top.shape == (0,)


@pytest.mark.parametrize("small_limit", [0, 1000], ids=["vectorised-path", "python-clusters-path"])
@pytest.mark.parametrize("seed", range(20))
def test_weighted_nms_matches_mediapipe_reference(seed, small_limit, monkeypatch):
    # Both ways of forming clusters (plain Python for a few boxes, numpy rows for many) must agree.
    monkeypatch.setattr("edgerun.decoders.nms._SMALL", small_limit)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    centre = rng.uniform(0.2, 0.8, (n, 2))
    size = rng.uniform(0.05, 0.3, (n, 2))
    boxes = f32(np.concatenate([centre - size / 2, centre + size / 2], axis=1))
    scores = f32(rng.uniform(0.5, 1.0, n))
    kps = f32(rng.uniform(0, 1, (n, 3, 2)))
    ref = mediapipe_weighted_reference(boxes.tolist(), scores.tolist(), kps.tolist(), 0.3)
    out_boxes, out_scores, out_kps, top = weighted_nms(boxes, scores, 0.3, kps)
    assert top.tolist() == [r[3] for r in ref]
    np.testing.assert_allclose(out_scores, [r[1] for r in ref], rtol=1e-6)
    np.testing.assert_allclose(out_boxes, [r[0] for r in ref], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_kps, [r[2] for r in ref], rtol=1e-5, atol=1e-6)


# ---- hard NMS --------------------------------------------------------------------------------


def greedy_reference(boxes, scores, classes, threshold):
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep: list[int] = []
    for i in order:
        if all(
            classes[i] != classes[j] or box_iou(boxes[i : i + 1], boxes[j : j + 1])[0, 0] <= threshold for j in keep
        ):
            keep.append(i)
    return keep


def test_hard_nms_is_class_aware():
    boxes = f32([[10, 10, 50, 50], [12, 12, 52, 52], [11, 11, 51, 51], [100, 100, 140, 140]])
    scores = f32([0.9, 0.8, 0.7, 0.6])
    classes = np.array([0, 0, 1, 0], np.int32)
    # Same class, overlapping: the weaker is suppressed. Different class: both kept.
    assert hard_nms(boxes, scores, 0.45, classes).tolist() == [0, 2, 3]
    # Without classes the class-1 box goes too.
    assert hard_nms(boxes, scores, 0.45).tolist() == [0, 3]


def test_hard_nms_order_limit_and_empty():
    boxes = f32([[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]])
    assert hard_nms(boxes, f32([0.2, 0.9, 0.5]), 0.5).tolist() == [1, 2, 0]
    assert hard_nms(boxes, f32([0.2, 0.9, 0.5]), 0.5, max_results=2).tolist() == [1, 2]
    assert hard_nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), 0.5).shape == (0,)


@pytest.mark.parametrize("seed", range(20))
def test_hard_nms_matches_greedy_reference(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 60))
    xy = rng.uniform(0, 600, (n, 2))
    wh = rng.uniform(10, 200, (n, 2))
    boxes = f32(np.concatenate([xy, xy + wh], axis=1))
    scores = f32(rng.uniform(0, 1, n))
    classes = rng.integers(0, 3, n).astype(np.int32)
    assert hard_nms(boxes, scores, 0.45, classes).tolist() == greedy_reference(boxes, scores, classes, 0.45)

"""Anchor-based SSD heads as MediaPipe decodes them (BlazeFace, the pose detector, palms).

This is MediaPipe's ``TensorsToDetectionsCalculator`` (CPU path, raw
regressor and score tensors, anchors from ``SsdAnchorsCalculator``) followed by
``NonMaxSuppressionCalculator`` with the WEIGHTED algorithm and
INTERSECTION_OVER_UNION, which is what MediaPipe's detection graphs chain.
Parameters use MediaPipe's option names, so values can be copied from a
graph's ``.pbtxt``.

Per frame the work is: threshold all scores in the raw (logit) domain on a
view of the output, then decode only the few candidates that pass. Nothing of
the size of the output tensors is allocated per frame.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edgerun.decoders.anchors import SsdAnchorOptions, ssd_anchors
from edgerun.decoders.base import Decoder
from edgerun.decoders.nms import weighted_nms_rows
from edgerun.decoders.params import ParamReader
from edgerun.engines.base import TensorSpec
from edgerun.errors import ModelError
from edgerun.types import Detections

# MediaPipe face_detection_short_range.pbtxt (via face_detection.pbtxt) for the
# 128x128 BlazeFace model: 896 anchors, 6 keypoints (eyes, nose, mouth, ear tragions).
BLAZEFACE_SHORT_PARAMS: dict[str, Any] = {
    "num_layers": 4,
    "min_scale": 0.1484375,
    "max_scale": 0.75,
    "input_size_height": 128,
    "input_size_width": 128,
    "anchor_offset_x": 0.5,
    "anchor_offset_y": 0.5,
    "strides": [8, 16, 16, 16],
    "aspect_ratios": [1.0],
    "fixed_anchor_size": True,
    "interpolated_scale_aspect_ratio": 1.0,
    "reduce_boxes_in_lowest_layer": False,
    "num_classes": 1,
    "num_boxes": 896,
    "num_coords": 16,
    "box_coord_offset": 0,
    "keypoint_coord_offset": 4,
    "num_keypoints": 6,
    "num_values_per_keypoint": 2,
    "sigmoid_score": True,
    "score_clipping_thresh": 100.0,
    "reverse_output_order": True,
    "x_scale": 128.0,
    "y_scale": 128.0,
    "w_scale": 128.0,
    "h_scale": 128.0,
    "min_score_thresh": 0.5,
    "min_suppression_threshold": 0.3,
}

# MediaPipe pose_detection_cpu.pbtxt for the 224x224 pose detector: 2254 anchors,
# 4 keypoints (mid-hip, full-body size/rotation, mid-shoulder, upper-body size/rotation).
# The graph file says min_score_thresh 0.2, but MediaPipe's Pose solution overrides it
# with min_detection_confidence, 0.5 by default; 0.5 is what users of MediaPipe get.
POSE_DETECTOR_PARAMS: dict[str, Any] = {
    "num_layers": 5,
    "min_scale": 0.1484375,
    "max_scale": 0.75,
    "input_size_height": 224,
    "input_size_width": 224,
    "anchor_offset_x": 0.5,
    "anchor_offset_y": 0.5,
    "strides": [8, 16, 32, 32, 32],
    "aspect_ratios": [1.0],
    "fixed_anchor_size": True,
    "interpolated_scale_aspect_ratio": 1.0,
    "reduce_boxes_in_lowest_layer": False,
    "num_classes": 1,
    "num_boxes": 2254,
    "num_coords": 12,
    "box_coord_offset": 0,
    "keypoint_coord_offset": 4,
    "num_keypoints": 4,
    "num_values_per_keypoint": 2,
    "sigmoid_score": True,
    "score_clipping_thresh": 100.0,
    "reverse_output_order": True,
    "x_scale": 224.0,
    "y_scale": 224.0,
    "w_scale": 224.0,
    "h_scale": 224.0,
    "min_score_thresh": 0.5,
    "min_suppression_threshold": 0.3,
}

# The raw-score pre-filter runs this far below logit(min_score_thresh), so float32
# rounding of the sigmoid can never drop a box the exact check would keep.
_LOGIT_MARGIN = 0.01


def _shapes(specs: list[TensorSpec]) -> str:
    return "[" + ", ".join(str(tuple(s.shape)) for s in specs) + "]"


def _size(spec: TensorSpec) -> int:
    return int(np.prod(spec.shape)) if spec.shape else 1


class MediaPipeSSDDecoder(Decoder):
    """Regressors ``[1, num_boxes, num_coords]`` + scores ``[1, num_boxes, num_classes]`` -> detections.

    Params (MediaPipe option names): the ``SsdAnchorsCalculator`` options
    (``num_layers``, ``min_scale``, ``max_scale``, ``input_size_height``/``width``
    (default: the model input), ``anchor_offset_x``/``y``, ``strides``,
    ``aspect_ratios``, ``fixed_anchor_size``, ``interpolated_scale_aspect_ratio``,
    ``reduce_boxes_in_lowest_layer``, ``feature_map_height``/``width``) and the
    ``TensorsToDetectionsCalculator`` options (``num_classes``, ``num_boxes``,
    ``num_coords``, ``box_coord_offset``, ``keypoint_coord_offset``,
    ``num_keypoints``, ``num_values_per_keypoint``, ``sigmoid_score``,
    ``score_clipping_thresh``, ``reverse_output_order``, ``x_scale``, ``y_scale``,
    ``w_scale``, ``h_scale``, ``apply_exponential_on_box_size``,
    ``min_score_thresh``), plus ``min_suppression_threshold`` (weighted NMS,
    default 0.3) and ``max_results`` (-1: no limit).

    ``max_results`` keeps the best detections after NMS; MediaPipe's
    calculator instead stops at the first ``max_results`` boxes in anchor order
    before NMS, which drops good detections for no reason.
    """

    KEY = "mediapipe_ssd"

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        super().__init__(params, input_spec, output_specs)
        p = ParamReader(self.KEY, params)
        input_hw = input_spec.image_hw if len(input_spec.shape) == 4 else None
        anchor_options = SsdAnchorOptions.from_params(p, input_hw)
        self.num_classes = p.integer("num_classes", min_value=1)
        self.num_boxes = p.integer("num_boxes", min_value=1)
        self.num_coords = p.integer("num_coords", min_value=4)
        self.box_coord_offset = p.integer("box_coord_offset", 0, min_value=0)
        self.keypoint_coord_offset = p.integer("keypoint_coord_offset", 0, min_value=0)
        self.num_keypoints = p.integer("num_keypoints", 0, min_value=0)
        num_values_per_keypoint = p.integer("num_values_per_keypoint", 2)
        self.sigmoid_score = p.flag("sigmoid_score", False)
        self.score_clipping_thresh: float | None = (
            p.number("score_clipping_thresh", positive=True) if p.has("score_clipping_thresh") else None
        )
        self.reverse_output_order = p.flag("reverse_output_order", False)
        self.x_scale = p.number("x_scale", positive=True)
        self.y_scale = p.number("y_scale", positive=True)
        self.w_scale = p.number("w_scale", positive=True)
        self.h_scale = p.number("h_scale", positive=True)
        self.apply_exponential_on_box_size = p.flag("apply_exponential_on_box_size", False)
        self.min_score_thresh: float | None = (
            p.number("min_score_thresh", min_value=0.0, max_value=1.0 if self.sigmoid_score else None)
            if p.has("min_score_thresh")
            else None
        )
        self.min_suppression_threshold = p.number("min_suppression_threshold", 0.3, min_value=0.0, max_value=1.0)
        self.max_results = p.integer("max_results", -1, min_value=-1)
        if self.max_results == 0:
            raise p.fail("max_results", "must be -1 (no limit) or positive, got 0")
        p.finish()

        # MediaPipe supports only 2D keypoints and CHECK-fails otherwise.
        if num_values_per_keypoint != 2:
            raise p.fail("num_values_per_keypoint", f"only 2 (x, y) is supported, got {num_values_per_keypoint}")
        if self.box_coord_offset + 4 > self.num_coords:
            raise p.fail(
                "box_coord_offset", f"{self.box_coord_offset} + 4 box values exceed num_coords {self.num_coords}"
            )
        if self.num_keypoints and self.keypoint_coord_offset + 2 * self.num_keypoints > self.num_coords:
            raise p.fail(
                "num_keypoints",
                f"keypoint_coord_offset {self.keypoint_coord_offset} + {self.num_keypoints} keypoints x 2 "
                f"exceed num_coords {self.num_coords}",
            )

        anchors = ssd_anchors(anchor_options)
        if anchors.shape[0] != self.num_boxes:
            raise ModelError(
                f"{self.KEY}: the anchor options give {anchors.shape[0]} anchors but num_boxes is {self.num_boxes}"
            )
        self._box_index, self._score_index = self._find_outputs(output_specs)
        box_spec, score_spec = output_specs[self._box_index], output_specs[self._score_index]
        self._box_spec, self._score_spec = box_spec, score_spec

        # reverse_output_order means x, y, w, h (MediaPipe's XYWH box format) instead of y, x, h, w.
        o = self.box_coord_offset
        cx, cy, w, h = (o, o + 1, o + 2, o + 3) if self.reverse_output_order else (o + 1, o, o + 3, o + 2)
        ko = self.keypoint_coord_offset
        kp_cols = np.arange(ko, ko + 2 * self.num_keypoints).reshape(-1, 2)
        if not self.reverse_output_order:
            kp_cols = kp_cols[:, ::-1]  # y, x pairs
        # Decoding is one affine map per anchor and column: the regressor columns, gathered into
        # the order x_center, y_center, w, h, kx0, ky0, ..., times ``_gain`` plus ``_offset``
        # (MediaPipe's value / scale * anchor size + anchor centre). Two table lookups and two
        # numpy calls decode every candidate's box and keypoints at once.
        self._columns = np.array([cx, cy, w, h, *kp_cols.reshape(-1)], np.intp)
        ax, ay, aw, ah = (anchors[:, i : i + 1].astype(np.float32) for i in range(4))
        x_gain, y_gain = aw / np.float32(self.x_scale), ah / np.float32(self.y_scale)
        one = np.ones_like(aw)
        # With apply_exponential_on_box_size the sizes are exp(value / scale) * anchor size: the
        # anchor size is applied after the exp.
        w_gain = (one if self.apply_exponential_on_box_size else aw) / np.float32(self.w_scale)
        h_gain = (one if self.apply_exponential_on_box_size else ah) / np.float32(self.h_scale)
        self._gain = np.hstack([x_gain, y_gain, w_gain, h_gain] + [x_gain, y_gain] * self.num_keypoints)
        zero = np.zeros_like(aw)
        self._offset = np.hstack([ax, ay, zero, zero] + [ax, ay] * self.num_keypoints)
        self._anchor_size = np.hstack([aw, ah]).astype(np.float32)  # for apply_exponential_on_box_size

        self._raw_threshold = self._prefilter_threshold()
        # Per-frame scratch, made once: dequantised scores, best score per box, candidate mask.
        self._score_buf = np.empty((self.num_boxes, self.num_classes), np.float32) if score_spec.quantised else None
        self._best_buf = np.empty((self.num_boxes,), np.float32) if self.num_classes > 1 else None
        self._mask_buf = np.empty((self.num_boxes,), np.bool_)

    def _find_outputs(self, specs: list[TensorSpec]) -> tuple[int, int]:
        """Indices of the regressor and score outputs, told apart by shape (converters reorder them)."""
        box_size = self.num_boxes * self.num_coords
        score_size = self.num_boxes * self.num_classes
        boxes = [i for i, s in enumerate(specs) if s.shape and s.shape[-1] == self.num_coords]
        if not boxes:
            raise ModelError(
                f"{self.KEY}: expected a regressor output with last dim {self.num_coords} (num_coords), "
                f"got shapes {_shapes(specs)}"
            )
        scores = [i for i, s in enumerate(specs) if s.shape and s.shape[-1] == self.num_classes]
        if self.num_coords == self.num_classes:
            # Same last dim: fall back to MediaPipe's fixed order, regressors first.
            if len(boxes) < 2:
                raise ModelError(
                    f"{self.KEY}: expected regressor and score outputs with last dim {self.num_coords}, "
                    f"got shapes {_shapes(specs)}"
                )
            box_index, score_index = boxes[0], boxes[1]
        else:
            if not scores:
                raise ModelError(
                    f"{self.KEY}: expected a score output with last dim {self.num_classes} (num_classes), "
                    f"got shapes {_shapes(specs)}"
                )
            box_index, score_index = boxes[0], scores[0]
        box_spec, score_spec = specs[box_index], specs[score_index]
        if _size(box_spec) != box_size:
            raise ModelError(
                f"{self.KEY}: regressor output {tuple(box_spec.shape)} holds {_size(box_spec) // self.num_coords} "
                f"boxes but num_boxes is {self.num_boxes}"
            )
        if _size(score_spec) != score_size:
            raise ModelError(
                f"{self.KEY}: score output {tuple(score_spec.shape)} holds {_size(score_spec) // self.num_classes} "
                f"boxes but num_boxes is {self.num_boxes}"
            )
        return box_index, score_index

    def _prefilter_threshold(self) -> float:
        """The raw-score threshold that lets through every box whose final score can pass."""
        t = self.min_score_thresh
        if t is None:
            return -math.inf
        if not self.sigmoid_score:
            return t
        if t <= 0.0:
            return -math.inf
        logit = math.inf if t >= 1.0 else math.log(t / (1.0 - t))
        if self.score_clipping_thresh is not None:
            logit = min(logit, self.score_clipping_thresh)
        return logit - _LOGIT_MARGIN

    def decode(self, outputs: list[np.ndarray]) -> Detections:
        raw_boxes = outputs[self._box_index].reshape(self.num_boxes, self.num_coords)
        raw_scores = outputs[self._score_index].reshape(self.num_boxes, self.num_classes)
        if self._score_buf is not None:
            spec = self._score_spec
            np.subtract(raw_scores, np.float32(spec.zero_point), out=self._score_buf, casting="unsafe")
            self._score_buf *= np.float32(spec.scale)
            raw_scores = self._score_buf

        if self._best_buf is None:
            best = raw_scores[:, 0]
        else:
            best = np.max(raw_scores, axis=1, out=self._best_buf)
        candidates = np.flatnonzero(np.greater_equal(best, self._raw_threshold, out=self._mask_buf))
        if candidates.size == 0:
            return Detections.empty(self.num_keypoints)

        # Exact MediaPipe scoring on the candidates only: clip, sigmoid, best allowed class.
        cand_scores = raw_scores[candidates].astype(np.float32, copy=False)
        if self.sigmoid_score:
            if self.score_clipping_thresh is not None:
                c = np.float32(self.score_clipping_thresh)
                np.clip(cand_scores, -c, c, out=cand_scores)
            cand_scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-cand_scores))
        if self.num_classes == 1:
            scores = cand_scores[:, 0]
            class_ids = np.zeros(candidates.size, np.int32)
        else:
            class_ids = np.argmax(cand_scores, axis=1).astype(np.int32)
            scores = cand_scores[np.arange(candidates.size), class_ids]
        if self.min_score_thresh is not None:
            passed = scores >= np.float32(self.min_score_thresh)
            if not passed.all():
                candidates, scores, class_ids = candidates[passed], scores[passed], class_ids[passed]
                if candidates.size == 0:
                    return Detections.empty(self.num_keypoints)

        # x_center, y_center, w, h, keypoints for every candidate (see _gain in __init__).
        rows = self._box_spec.dequantise(raw_boxes[candidates[:, None], self._columns]).astype(np.float32, copy=False)
        rows *= self._gain[candidates]
        rows += self._offset[candidates]
        sizes = rows[:, 2:4]
        if self.apply_exponential_on_box_size:
            np.exp(sizes, out=sizes)
            sizes *= self._anchor_size[candidates]
        # MediaPipe drops boxes the model predicts with negative or NaN size (b/171391719).
        valid = (sizes >= 0.0).all(axis=1)
        if not valid.all():
            rows, scores, class_ids = rows[valid], scores[valid], class_ids[valid]
            sizes = rows[:, 2:4]
        # Centre and size -> corners, in place: x1 = cx - w/2, x2 = cx + w/2.
        half = sizes * np.float32(0.5)
        np.add(rows[:, 0:2], half, out=sizes)
        rows[:, 0:2] -= half

        rows, scores, top = weighted_nms_rows(rows, scores, self.min_suppression_threshold, self.max_results)
        kept = scores.shape[0]
        boxes = np.ascontiguousarray(rows[:, :4])
        keypoints = np.ascontiguousarray(rows[:, 4:]).reshape(kept, -1, 2) if self.num_keypoints else None
        return Detections(boxes=boxes, scores=scores, class_ids=class_ids[top], keypoints=keypoints)

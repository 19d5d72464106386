"""Raw YOLOv5 and YOLOv8 detection heads (exports without built-in NMS).

YOLOv5 (and v7) emit ``[1, N, 5 + C]`` rows of ``cx, cy, w, h, objectness,
class scores``; YOLOv8 (and v9/v11) emit ``[1, 4 + C, N]``, channels first, with
no objectness. Both are thresholded on a view of the raw output (for quantised
outputs in the integer domain, since dequantisation is monotonic), so only the
candidates are gathered and dequantised, then go through class-aware NMS.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from edgerun.decoders.base import Decoder, describe_tensor
from edgerun.decoders.nms import hard_nms
from edgerun.decoders.params import ParamReader
from edgerun.engines.base import TensorSpec
from edgerun.errors import ModelError
from edgerun.types import Detections

# Coordinates whose largest value is at most this are taken as normalised
# (0..1, with room for boxes that spill over the edge), otherwise as input pixels.
NORMALIZED_AUTO_LIMIT = 1.5

# Output strides of the heads YOLOv5 and Ultralytics build: P3-P5 (the usual), P3-P6 ("-p6"), P2-P5 ("-p2").
STRIDE_SETS = ((8, 16, 32), (8, 16, 32, 64), (4, 8, 16, 32))

# An end-to-end head's rows: x1, y1, x2, y2, score, class, after the model's own NMS.
END_TO_END_VALUES = 6


def _shapes(specs: list[TensorSpec]) -> str:
    return "[" + ", ".join(str(tuple(s.shape)) for s in specs) + "]"


def grid_boxes(height: int, width: int, strides: tuple[int, ...]) -> int:
    """Grid cells over all output strides: the boxes a YOLO head predicts per anchor."""
    return sum(math.ceil(height / s) * math.ceil(width / s) for s in strides)


class _YoloDecoder(Decoder):
    """What YOLOv5 and YOLOv8 share: params, tensor checks, box conversion and NMS.

    Params: ``min_score_thresh`` (0.25), ``iou_thresh`` (0.45), ``max_results``
    (100), ``normalized`` ("auto": coordinates are normalised when the largest
    is <= 1.5, else input pixels; or true/false), ``num_classes`` (optional, to
    check the model), ``max_candidates`` (3000: the best-scoring boxes kept
    before NMS, which bounds the cost of a frame full of low-confidence boxes).
    """

    # Values per box ahead of the class scores: 5 for v5 (with objectness), 4 for v8.
    HEAD: ClassVar[int]
    # Boxes per grid cell: YOLOv5/v7 have 3 anchors, anchor-free heads (YOLOX, YOLOv8/11) one.
    ANCHORS_PER_CELL: ClassVar[tuple[int, ...]]
    FAMILY: ClassVar[str]

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        super().__init__(params, input_spec, output_specs)
        p = ParamReader(self.KEY, params)
        self.min_score_thresh = p.number("min_score_thresh", 0.25, min_value=0.0)
        self.iou_thresh = p.number("iou_thresh", 0.45, min_value=0.0, max_value=1.0)
        self.max_results = p.integer("max_results", 100, min_value=1)
        self.max_candidates = p.integer("max_candidates", 3000, min_value=1)
        normalized = p.value("normalized", "auto")
        if not (normalized == "auto" or isinstance(normalized, bool)):
            raise p.fail("normalized", f'expected true, false or "auto", got {normalized!r}')
        self.normalized: bool | None = None if normalized == "auto" else bool(normalized)
        expected_classes = p.integer("num_classes", 0, min_value=0)
        p.finish()

        if len(input_spec.shape) != 4:
            raise ModelError(f"{self.KEY}: expected an image input [1, H, W, 3], got {tuple(input_spec.shape)}")
        self.input_h, self.input_w = input_spec.image_hw
        self.grid_sizes = {
            m * grid_boxes(self.input_h, self.input_w, strides)
            for m in self.ANCHORS_PER_CELL
            for strides in STRIDE_SETS
        }

        heads = [i for i, s in enumerate(output_specs) if len(s.shape) == 3 and s.shape[0] == 1]
        if not heads:
            raise ModelError(
                f"{self.KEY}: expected a [1, ...] head output of rank 3, got shapes {_shapes(output_specs)}"
            )
        # Segmentation (mask prototypes, rank 4) and a second head carry more than boxes and classes. Rank-5
        # outputs are the per-level feature maps older YOLOv5 exports list beside the head: ignored.
        others = [s for i, s in enumerate(output_specs) if i != heads[0] and len(s.shape) != 5]
        if others:
            named = ", ".join(describe_tensor(s) for s in output_specs)
            raise ModelError(f"{self.KEY}: expected one head output, got {len(output_specs)}: {named}")
        self._index = heads[0]
        self._spec = output_specs[self._index]
        rows, values = self._layout(self._spec.shape, expected_classes)
        self.num_boxes = rows
        self.num_classes = values - self.HEAD
        if self.num_classes < 1:
            raise ModelError(
                f"{self.KEY}: head output {tuple(self._spec.shape)} has {values} values per box, "
                f"need at least {self.HEAD + 1} ({self.HEAD} + one class)"
            )
        if expected_classes and expected_classes != self.num_classes:
            raise ModelError(
                f"{self.KEY}: head output {tuple(self._spec.shape)} has {self.num_classes} classes "
                f"but num_classes is {expected_classes}"
            )
        if rows not in self.grid_sizes:
            raise ModelError(self._not_a_grid(rows, values))
        self.label_count = self.num_classes
        self.classes_from = describe_tensor(self._spec)
        self._raw_threshold = self._threshold_in_raw_domain(self.min_score_thresh)
        self._mask = np.empty((self.num_boxes,), np.bool_)

    def _layout(self, shape: tuple[int, ...], expected_classes: int) -> tuple[int, int]:
        """(boxes, values per box) of the head output."""
        raise NotImplementedError

    def _not_a_grid(self, rows: int, values: int) -> str:
        """Why a head whose box count fits no grid of this input is refused, naming what it looks like."""
        usual = self.ANCHORS_PER_CELL[0] * grid_boxes(self.input_h, self.input_w, STRIDE_SETS[0])
        text = (
            f"{self.KEY}: head output {describe_tensor(self._spec)} has {rows} boxes, not a {self.FAMILY} grid "
            f"of a {self.input_w}x{self.input_h} input ({usual} with strides 8, 16, 32)"
        )
        if values == END_TO_END_VALUES:
            return (
                text
                + "; [1, N, 6] is an end-to-end head (YOLOv10, YOLO26: boxes after NMS): use decoder kind yolo_end2end"
            )
        if rows % 3 == 0 and rows // 3 in grid_sizes_v8(self.input_h, self.input_w):
            return text + "; 3 boxes per cell is a YOLOv5 head: use decoder kind yolov5"
        return text

    def _threshold_in_raw_domain(self, threshold: float) -> float:
        """The raw value a score must reach; for quantised outputs, the smallest passing integer."""
        spec = self._spec
        if not spec.quantised:
            return threshold
        info = np.iinfo(spec.dtype)
        # Dequantisation (q - zp) * scale is increasing in q when scale > 0.
        q = math.ceil(threshold / spec.scale + spec.zero_point - 1e-6)
        return float(min(max(q, info.min), info.max + 1))

    def _candidates(self, best: np.ndarray) -> np.ndarray:
        """Indices whose raw score passes, capped to the ``max_candidates`` best."""
        index = np.flatnonzero(np.greater_equal(best, self._raw_threshold, out=self._mask))
        if index.size > self.max_candidates:
            part = np.argpartition(-best[index].astype(np.float32), self.max_candidates - 1)
            index = np.sort(index[part[: self.max_candidates]])
        return index

    def _finish(self, xywh: np.ndarray, scores: np.ndarray, class_ids: np.ndarray) -> Detections:
        """Threshold exactly, convert centre boxes to normalised corners, class-aware NMS."""
        keep = scores >= np.float32(self.min_score_thresh)
        if not keep.all():
            xywh, scores, class_ids = xywh[keep], scores[keep], class_ids[keep]
        if scores.size == 0:
            return Detections.empty()
        normalized = self.normalized
        if normalized is None:
            normalized = float(np.abs(xywh).max()) <= NORMALIZED_AUTO_LIMIT
        sx = np.float32(1.0) if normalized else np.float32(1.0 / self.input_w)
        sy = np.float32(1.0) if normalized else np.float32(1.0 / self.input_h)
        half_w = xywh[:, 2] * np.float32(0.5)
        half_h = xywh[:, 3] * np.float32(0.5)
        boxes = np.empty((scores.size, 4), np.float32)
        boxes[:, 0] = (xywh[:, 0] - half_w) * sx
        boxes[:, 1] = (xywh[:, 1] - half_h) * sy
        boxes[:, 2] = (xywh[:, 0] + half_w) * sx
        boxes[:, 3] = (xywh[:, 1] + half_h) * sy
        kept = hard_nms(boxes, scores, self.iou_thresh, class_ids, self.max_results)
        return Detections(boxes=boxes[kept], scores=scores[kept].astype(np.float32), class_ids=class_ids[kept])


class YOLOv5Decoder(_YoloDecoder):
    """``[1, N, 5 + C]``: score = objectness x best class score, as YOLOv5's own NMS does."""

    KEY = "yolov5"
    HEAD = 5
    ANCHORS_PER_CELL = (3, 1)
    FAMILY = "YOLOv5"

    def _layout(self, shape: tuple[int, ...], expected_classes: int) -> tuple[int, int]:
        rows, values = int(shape[1]), int(shape[2])
        if rows not in self.grid_sizes and values in grid_sizes_v8(self.input_h, self.input_w):
            # [1, 4 + C, N]: decoding it as rows would read box coordinates as class scores.
            raise ModelError(
                f"{self.KEY}: head output {describe_tensor(self._spec)} is [1, 4 + C, N] with {values} boxes, "
                f"a YOLOv8/11 head: use decoder kind yolov8"
            )
        return rows, values

    def decode(self, outputs: list[np.ndarray]) -> Detections:
        head = outputs[self._index].reshape(self.num_boxes, self.HEAD + self.num_classes)
        # Class scores are <= 1, so objectness below the threshold can never pass.
        candidates = self._candidates(head[:, 4])
        if candidates.size == 0:
            return Detections.empty()
        rows = self._spec.dequantise(head[candidates]).astype(np.float32, copy=False)
        class_scores = rows[:, 5:] * rows[:, 4:5]
        class_ids = np.argmax(class_scores, axis=1).astype(np.int32)
        scores = class_scores[np.arange(candidates.size), class_ids]
        return self._finish(rows[:, :4], scores, class_ids)


class YOLOv8Decoder(_YoloDecoder):
    """``[1, 4 + C, N]`` (channels first, as exported); ``[1, N, 4 + C]`` is accepted too.

    Which axis holds the boxes is read from ``num_classes`` when given,
    otherwise the longer axis is taken as the boxes (8400 boxes vs 84 values).
    """

    KEY = "yolov8"
    HEAD = 4
    ANCHORS_PER_CELL = (1,)
    FAMILY = "YOLOv8"

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        self._channels_first = True  # set by _layout during the base class's checks
        super().__init__(params, input_spec, output_specs)
        # Best class score per box, in the output's own dtype (integers for quantised heads).
        self._best = np.empty((self.num_boxes,), self._spec.dtype)

    def _layout(self, shape: tuple[int, ...], expected_classes: int) -> tuple[int, int]:
        a, b = int(shape[1]), int(shape[2])
        if expected_classes:
            values = self.HEAD + expected_classes
            self._channels_first = a == values or b != values
        elif (a in self.grid_sizes) != (b in self.grid_sizes):
            self._channels_first = b in self.grid_sizes  # the axis whose length is a grid holds the boxes
        else:
            self._channels_first = a <= b
        return (b, a) if self._channels_first else (a, b)

    def _best_class(self, head: np.ndarray) -> np.ndarray:
        if self._channels_first:
            return np.max(head[self.HEAD :], axis=0, out=self._best)
        return np.max(head[:, self.HEAD :], axis=1, out=self._best)

    def decode(self, outputs: list[np.ndarray]) -> Detections:
        values = self.HEAD + self.num_classes
        raw = outputs[self._index]
        head = raw.reshape(values, self.num_boxes) if self._channels_first else raw.reshape(self.num_boxes, values)
        candidates = self._candidates(self._best_class(head))
        if candidates.size == 0:
            return Detections.empty()
        gathered = head[:, candidates].T if self._channels_first else head[candidates]
        rows = self._spec.dequantise(np.ascontiguousarray(gathered)).astype(np.float32, copy=False)
        class_ids = np.argmax(rows[:, self.HEAD :], axis=1).astype(np.int32)
        scores = rows[np.arange(candidates.size), self.HEAD + class_ids]
        return self._finish(rows[:, :4], scores, class_ids)


def grid_sizes_v8(height: int, width: int) -> set[int]:
    """Box counts of anchor-free heads (YOLOv8/11) for an input of ``height`` x ``width``."""
    return {grid_boxes(height, width, strides) for strides in STRIDE_SETS}

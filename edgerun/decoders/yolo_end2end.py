"""End-to-end YOLO heads: ``[1, K, 6]`` rows after the model's own selection (YOLOv10, YOLO26).

Ultralytics' end-to-end ``Detect`` head (``end2end`` in the export metadata)
ends in a top-K over the one-to-one branch's class scores, so each row is
``x1, y1, x2, y2, score, class`` with K = min(max_det, grid cells), 300 for
the usual sizes; rows are not thresholded (the tail holds near-zero scores)
and need no NMS. ONNX exports give corners in input pixels, TFLite exports
(``ultralytics/utils/export/tensorflow.py``) corners normalised to the input;
``normalized`` says which, or "auto" tells them apart by magnitude. The class
column is a float index, so the class count comes from ``num_classes`` (the
importer writes the count of the file's names), not from the tensor.

YOLO26's head (``reg_max`` 1, no DFL) regresses each side's distance with no
floor, so a row can come out with ``x2 < x1`` or ``y2 < y1`` (an untrained
export gives many, and nothing in the head stops a trained one). Such a row is no
box: it is dropped and counted under ``inverted_box`` in ``Decoder.dropped``,
and the frame's other rows are kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgerun.decoders.base import Decoder, describe_tensor
from edgerun.decoders.params import ParamReader
from edgerun.decoders.yolo import NORMALIZED_AUTO_LIMIT, grid_sizes_v8
from edgerun.engines.base import TensorSpec
from edgerun.errors import ModelError
from edgerun.types import Detections

ROW_VALUES = 6  # x1, y1, x2, y2, score, class


class YOLOEnd2EndDecoder(Decoder):
    """Params: ``num_classes`` (required: the class column indexes the labels), ``min_score_thresh``
    (0.25), ``max_results`` (300), ``normalized`` ("auto", true or false)."""

    KEY = "yolo_end2end"

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        super().__init__(params, input_spec, output_specs)
        p = ParamReader(self.KEY, params)
        self.num_classes = p.integer("num_classes", min_value=1)
        self.min_score_thresh = p.number("min_score_thresh", 0.25, min_value=0.0)
        self.max_results = p.integer("max_results", 300, min_value=1)
        normalized = p.value("normalized", "auto")
        if not (normalized == "auto" or isinstance(normalized, bool)):
            raise p.fail("normalized", f'expected true, false or "auto", got {normalized!r}')
        self.normalized: bool | None = None if normalized == "auto" else bool(normalized)
        p.finish()
        if len(input_spec.shape) != 4:
            raise ModelError(f"{self.KEY}: expected an image input [1, H, W, 3], got {tuple(input_spec.shape)}")
        self.input_h, self.input_w = input_spec.image_hw
        if len(output_specs) != 1:
            named = ", ".join(describe_tensor(s) for s in output_specs)
            raise ModelError(f"{self.KEY}: expected one output [1, K, 6], got {len(output_specs)}: {named}")
        spec = output_specs[0]
        shape = tuple(int(d) for d in spec.shape)
        if len(shape) != 3 or shape[0] != 1 or shape[2] != ROW_VALUES:
            hint = ""
            if len(shape) == 3 and shape[0] == 1 and shape[2] in grid_sizes_v8(self.input_h, self.input_w):
                hint = "; [1, 4 + C, N] is a raw YOLOv8/11 head: use decoder kind yolov8"
            raise ModelError(
                f"{self.KEY}: output {describe_tensor(spec)} is not [1, K, 6] "
                f"(x1, y1, x2, y2, score, class after the model's own selection){hint}"
            )
        if not np.issubdtype(spec.dtype, np.floating) and not spec.quantised:
            raise ModelError(f"{self.KEY}: output {describe_tensor(spec)} is {np.dtype(spec.dtype)}, not float")
        self._spec = spec
        self.rows = shape[1]
        self.label_count = self.num_classes
        self.classes_from = f"{describe_tensor(spec)} (num_classes {self.num_classes})"

    def decode(self, outputs: list[np.ndarray]) -> Detections:
        rows = self._spec.dequantise(outputs[0].reshape(self.rows, ROW_VALUES)).astype(np.float32, copy=False)
        scores = rows[:, 4]
        confident = scores >= np.float32(self.min_score_thresh)
        # NaN corners compare False, so they stay for output_fault to refuse the whole frame.
        inverted = confident & ((rows[:, 2] < rows[:, 0]) | (rows[:, 3] < rows[:, 1]))
        if inverted.any():
            self.dropped["inverted_box"] += int(np.count_nonzero(inverted))
            confident &= ~inverted
        keep = np.flatnonzero(confident)
        if keep.size == 0:
            return Detections.empty()
        if keep.size > self.max_results:  # rows come best first, but a quantised copy may tie: keep the best
            keep = keep[np.argsort(-scores[keep], kind="stable")[: self.max_results]]
        picked = rows[keep]
        normalized = self.normalized
        if normalized is None:
            normalized = float(np.abs(picked[:, :4]).max()) <= NORMALIZED_AUTO_LIMIT
        boxes = np.ascontiguousarray(picked[:, :4])
        if not normalized:
            boxes *= np.array([1 / self.input_w, 1 / self.input_h] * 2, np.float32)
        # The class column is a float index; rint so that 1.9999 (a float16 or quantised copy) reads 2.
        class_ids = np.rint(picked[:, 5]).astype(np.int32)
        return Detections(boxes=boxes, scores=picked[:, 4].copy(), class_ids=class_ids)

"""Models with TFLite's built-in ``TFLite_Detection_PostProcess`` (SSD MobileNet, EfficientDet-Lite).

The model has already decoded anchors and run NMS; it outputs up to N boxes
``[1, N, 4]`` (``ymin, xmin, ymax, xmax``, normalised), classes ``[1, N]``,
scores ``[1, N]`` and the valid count ``[1]``. Only the score threshold, the
label offset and the change to ``x1, y1, x2, y2`` are left to do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgerun.decoders.base import Decoder
from edgerun.decoders.params import ParamReader
from edgerun.engines.base import TensorSpec
from edgerun.errors import ModelError
from edgerun.types import Detections


def _shapes(specs: list[TensorSpec]) -> str:
    return "[" + ", ".join(str(tuple(s.shape)) for s in specs) + "]"


class TFLiteSSDDecoder(Decoder):
    """The four post-processed outputs -> detections.

    Params: ``min_score_thresh`` (default 0.5), ``label_offset`` (default 0,
    added to every class id: 1 for label files that start with "background").

    The outputs are told apart by shape: boxes are the ``[1, N, 4]`` tensor,
    count the one-element tensor. Classes and scores have the same shape, and
    TF1 and TF2 converters emit them in different orders, so the tensor names
    decide when they say (``...class...``/``...score...``); otherwise the values
    do, on the first frame with detections (classes are whole numbers, scores
    are not), and until then the TF1 order (classes first) is assumed.
    """

    KEY = "tflite_ssd"

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        super().__init__(params, input_spec, output_specs)
        p = ParamReader(self.KEY, params)
        self.min_score_thresh = p.number("min_score_thresh", 0.5, min_value=0.0)
        self.label_offset = p.integer("label_offset", 0)
        p.finish()

        if len(output_specs) != 4:
            raise ModelError(
                f"{self.KEY}: expected 4 outputs (boxes, classes, scores, count), got {len(output_specs)} "
                f"with shapes {_shapes(output_specs)}"
            )
        boxes = [i for i, s in enumerate(output_specs) if len(s.shape) == 3 and s.shape[-1] == 4]
        counts = [i for i, s in enumerate(output_specs) if len(s.shape) <= 1 and int(np.prod(s.shape)) == 1]
        if len(boxes) != 1 or len(counts) != 1:
            raise ModelError(
                f"{self.KEY}: expected one boxes output [1, N, 4] and one count output [1], "
                f"got shapes {_shapes(output_specs)}"
            )
        self._boxes_index, self._count_index = boxes[0], counts[0]
        self.max_detections = int(output_specs[self._boxes_index].shape[1])
        pair = [i for i in range(4) if i not in (self._boxes_index, self._count_index)]
        for i in pair:
            if int(np.prod(output_specs[i].shape)) != self.max_detections:
                raise ModelError(
                    f"{self.KEY}: classes and scores outputs must hold {self.max_detections} values "
                    f"(the boxes output's N), got shapes {_shapes(output_specs)}"
                )
        names = [output_specs[i].name.lower() for i in pair]
        self._resolved = False
        if "score" in names[1] or "class" in names[0]:
            self._classes_index, self._scores_index = pair
            self._resolved = True
        elif "score" in names[0] or "class" in names[1]:
            self._scores_index, self._classes_index = pair
            self._resolved = True
        else:
            self._classes_index, self._scores_index = pair

    def _resolve_by_values(self, first: np.ndarray, second: np.ndarray) -> None:
        """Settle which of the two ``[1, N]`` outputs holds scores, once there is evidence."""
        first_whole = bool(np.all(first == np.round(first)))
        second_whole = bool(np.all(second == np.round(second)))
        if first_whole == second_whole:
            return
        a, b = (i for i in range(4) if i not in (self._boxes_index, self._count_index))
        self._classes_index, self._scores_index = (a, b) if first_whole else (b, a)
        self._resolved = True

    def decode(self, outputs: list[np.ndarray]) -> Detections:
        specs = self.output_specs
        count_raw = specs[self._count_index].dequantise(outputs[self._count_index])
        count = int(np.clip(np.asarray(count_raw).reshape(-1)[0], 0, self.max_detections))
        if count == 0:
            return Detections.empty()
        if not self._resolved:
            a, b = (i for i in range(4) if i not in (self._boxes_index, self._count_index))
            self._resolve_by_values(
                specs[a].dequantise(outputs[a].reshape(-1)[:count]),
                specs[b].dequantise(outputs[b].reshape(-1)[:count]),
            )
        scores = specs[self._scores_index].dequantise(outputs[self._scores_index].reshape(-1)[:count])
        keep = np.flatnonzero(scores >= self.min_score_thresh)
        if keep.size == 0:
            return Detections.empty()
        classes = specs[self._classes_index].dequantise(outputs[self._classes_index].reshape(-1)[:count])
        raw_boxes = specs[self._boxes_index].dequantise(
            outputs[self._boxes_index].reshape(self.max_detections, 4)[:count][keep]
        )
        boxes = np.ascontiguousarray(raw_boxes[:, [1, 0, 3, 2]], dtype=np.float32)
        class_ids = np.rint(classes[keep]).astype(np.int32) + np.int32(self.label_offset)
        order = np.argsort(-scores[keep], kind="stable")
        return Detections(
            boxes=boxes[order],
            scores=scores[keep][order].astype(np.float32),
            class_ids=class_ids[order],
        )

"""Image classification heads: one ``[1, C]`` vector of probabilities or logits -> top-k.

Classification results travel through the same ``Detections`` path as boxes so
sinks, dedup and the payload schema need no second shape: each class is a
"detection" covering the whole input, box ``[0, 0, 1, 1]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgerun.decoders.base import Decoder, describe_tensor
from edgerun.decoders.params import ParamReader
from edgerun.engines.base import TensorSpec
from edgerun.errors import ModelError
from edgerun.types import Detections


class ClassifyDecoder(Decoder):
    """Top-k classes of a ``[1, C]`` (or ``[C]``, ``[1, 1, 1, C]``) output, best first.

    Params: ``top_k`` (5), ``min_score_thresh`` (0.0), ``softmax`` (false:
    the model already outputs probabilities; true for logits) and
    ``label_offset`` (0; -1 drops the "background" entry of 1001-class
    ImageNet models so ids match a 1000-label file, and class 0 is then skipped).
    """

    KEY = "classify"

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        super().__init__(params, input_spec, output_specs)
        p = ParamReader(self.KEY, params)
        self.top_k = p.integer("top_k", 5, min_value=1)
        self.min_score_thresh = p.number("min_score_thresh", 0.0)
        self.softmax = p.flag("softmax", False)
        self.label_offset = p.integer("label_offset", 0)
        p.finish()

        if len(output_specs) != 1:
            shapes = ", ".join(str(tuple(s.shape)) for s in output_specs)
            raise ModelError(f"{self.KEY}: expected one output [1, C], got {len(output_specs)}: [{shapes}]")
        spec = output_specs[0]
        self.num_classes = int(np.prod(spec.shape)) if spec.shape else 0
        if self.num_classes < 1 or any(d != 1 for d in spec.shape[:-1]):
            raise ModelError(f"{self.KEY}: expected an output of shape [1, C], got {tuple(spec.shape)}")
        self._spec = spec
        self._k = min(self.top_k, self.num_classes)
        # Skip ids that would become negative with a negative label_offset (the background class).
        self._first_class = max(0, -self.label_offset)
        if self._first_class >= self.num_classes:
            raise ModelError(
                f"{self.KEY}: label_offset {self.label_offset} leaves no class of the {self.num_classes} outputs"
            )
        self._k = min(self._k, self.num_classes - self._first_class)
        # Ids run from max(0, label_offset) to num_classes - 1 + label_offset.
        self.label_count = self.num_classes + self.label_offset
        self.classes_from = describe_tensor(spec)
        self._probs = np.empty((self.num_classes,), np.float32)

    def decode(self, outputs: list[np.ndarray]) -> Detections:
        raw = outputs[0].reshape(-1)
        probs = self._probs
        spec = self._spec
        if spec.quantised:
            np.subtract(raw, np.float32(spec.zero_point), out=probs, casting="unsafe")
            probs *= np.float32(spec.scale)
        else:
            np.copyto(probs, raw, casting="unsafe")
        if self.softmax:
            probs -= probs.max()
            np.exp(probs, out=probs)
            probs /= probs.sum()
        usable = probs[self._first_class :]
        # Quantised scores tie often: every class scoring at least the k-th best, in id order, then a stable
        # sort, so ties go to the lower class id on every run and machine (argpartition alone picks any).
        k = self._k
        kth_best = np.partition(usable, usable.shape[0] - k)[usable.shape[0] - k]
        candidates = np.flatnonzero(usable >= kth_best)
        top = candidates[np.argsort(-usable[candidates], kind="stable")][:k]
        scores = usable[top]
        keep = scores >= np.float32(self.min_score_thresh)
        top, scores = top[keep], scores[keep]
        n = int(top.shape[0])
        boxes = np.zeros((n, 4), np.float32)
        boxes[:, 2:] = 1.0
        class_ids = (top + self._first_class + self.label_offset).astype(np.int32)
        return Detections(boxes=boxes, scores=scores.astype(np.float32), class_ids=class_ids)

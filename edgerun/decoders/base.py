"""The contract between a model's raw outputs and ``Detections``.

A decoder sees only output tensors: it returns boxes normalised to the model
input (0..1, ``x1, y1, x2, y2``). Undoing the letterbox to source pixels is the
preprocessor's job (``Letterbox.to_source``), so decoders never know frame sizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from edgerun.engines.base import TensorSpec
from edgerun.errors import ModelError
from edgerun.types import Detections

# Quantised scores dequantise a hair past 1 ((255 - 0) * 0.0039216 = 1.00000...): within this they are clipped,
# beyond it the model is not producing probabilities.
SCORE_TOLERANCE = 1e-3


def output_fault(detections: Detections, label_count: int) -> str | None:
    """Why these detections cannot be published, or None: scores outside [0, 1], class ids outside the labels.

    A decoder built on the right head gives neither by construction; a model
    that produces them anyway (a head without its sigmoid, a class column past
    the labels) is a per-frame error, counted, never a payload. Scores within
    ``SCORE_TOLERANCE`` of the range are clipped into it in place.
    """
    if len(detections) == 0:
        return None
    scores = detections.scores
    low, high = float(np.min(scores)), float(np.max(scores))
    if not (low >= -SCORE_TOLERANCE and high <= 1.0 + SCORE_TOLERANCE):  # NaN fails both
        return f"score {high if high > 1.0 or high != high else low:.4g} outside [0, 1]"
    if low < 0.0 or high > 1.0:
        np.clip(scores, 0.0, 1.0, out=scores)
    ids = detections.class_ids
    if label_count > 0:
        low_id, high_id = int(np.min(ids)), int(np.max(ids))
        if low_id < 0 or high_id >= label_count:
            return f"class id {high_id if high_id >= label_count else low_id} outside the {label_count} labels"
    if not np.isfinite(detections.boxes).all():
        return "box coordinates not finite"
    return None


def describe_tensor(spec: TensorSpec) -> str:
    """How errors name a tensor: its name and shape, e.g. ``'output0' [1, 84, 8400]``."""
    return f"{spec.name!r} [{', '.join(str(d) for d in spec.shape)}]"


class Decoder(ABC):
    """Turns one frame's output tensors into detections. Vectorised, no per-box Python loop."""

    KEY: ClassVar[str]
    # How many labels the class ids index into, and the tensor that says so; None where the
    # decoder cannot tell from the tensors (the model's post-process op decides the ids).
    label_count: int | None = None
    classes_from: str = ""

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        self.params = params
        self.input_spec = input_spec
        self.output_specs = output_specs
        # Rows a decoder refused as no detection (reason -> count), where the rest of the frame stays good; one
        # decoder per worker thread, so whoever runs it reads and sums them (``model inspect`` prints them).
        self.dropped: Counter[str] = Counter()

    def clone(self) -> Decoder:
        """An independent decoder for another worker thread (decoders keep per-call scratch buffers)."""
        return type(self)(self.params, self.input_spec, self.output_specs)

    def check_labels(self, labels: Sequence[str]) -> None:
        """Refuse labels that do not match the model's classes: one label too few shifts every class."""
        if labels and self.label_count is not None and len(labels) != self.label_count:
            raise ModelError(
                f"labels: {len(labels)} labels for the {self.label_count} classes of {self.KEY} "
                f"output {self.classes_from}"
            )

    @abstractmethod
    def decode(self, outputs: list[np.ndarray]) -> Detections:
        """Detections in normalised model-input coordinates."""

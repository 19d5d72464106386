"""The contract between a model's raw outputs and ``Detections``.

A decoder sees only output tensors: it returns boxes normalised to the model
input (0..1, ``x1, y1, x2, y2``). Undoing the letterbox to source pixels is the
preprocessor's job (``Letterbox.to_source``), so decoders never know frame sizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from edgerun.engines.base import TensorSpec
from edgerun.types import Detections


class Decoder(ABC):
    """Turns one frame's output tensors into detections. Vectorised, no per-box Python loop."""

    KEY: ClassVar[str]

    def __init__(self, params: dict[str, Any], input_spec: TensorSpec, output_specs: list[TensorSpec]) -> None:
        self.params = params
        self.input_spec = input_spec
        self.output_specs = output_specs

    def clone(self) -> Decoder:
        """An independent decoder for another worker thread (decoders keep per-call scratch buffers)."""
        return type(self)(self.params, self.input_spec, self.output_specs)

    @abstractmethod
    def decode(self, outputs: list[np.ndarray]) -> Detections:
        """Detections in normalised model-input coordinates."""

"""Model output decoders, found by key with ``decoder_class``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from edgerun.errors import ModelError

if TYPE_CHECKING:
    from edgerun.decoders.base import Decoder

# key -> "module:Class"; imported on first use so loading one decoder never pays for the others.
DECODER_MODULES: dict[str, str] = {
    "mediapipe_ssd": "edgerun.decoders.mediapipe_ssd:MediaPipeSSDDecoder",
    "tflite_ssd": "edgerun.decoders.tflite_ssd:TFLiteSSDDecoder",
    "yolov5": "edgerun.decoders.yolo:YOLOv5Decoder",
    "yolov8": "edgerun.decoders.yolo:YOLOv8Decoder",
    "classify": "edgerun.decoders.classify:ClassifyDecoder",
}


def decoder_class(key: str) -> type[Decoder]:
    """The Decoder subclass registered under ``key`` (the ``decoder.kind`` of a model bundle)."""
    try:
        target = DECODER_MODULES[key]
    except (KeyError, TypeError):
        known = ", ".join(sorted(DECODER_MODULES))
        raise ModelError(f"unknown decoder {key!r} (known: {known})") from None
    module_name, class_name = target.split(":")
    module = importlib.import_module(module_name)
    cls: type[Decoder] = getattr(module, class_name)
    return cls

"""Model output decoders, found by key with ``decoder_class``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerun.errors import ModelError
from edgerun.registry import resolve

if TYPE_CHECKING:
    from edgerun.decoders.base import Decoder

# key -> "module:Class"; imported on first use so loading one decoder never pays for the others.
DECODER_MODULES: dict[str, str] = {
    "mediapipe_ssd": "edgerun.decoders.mediapipe_ssd:MediaPipeSSDDecoder",
    "tflite_ssd": "edgerun.decoders.tflite_ssd:TFLiteSSDDecoder",
    "yolov5": "edgerun.decoders.yolo:YOLOv5Decoder",
    "yolov8": "edgerun.decoders.yolo:YOLOv8Decoder",
    "yolo_end2end": "edgerun.decoders.yolo_end2end:YOLOEnd2EndDecoder",
    "classify": "edgerun.decoders.classify:ClassifyDecoder",
}


def decoder_class(key: str) -> type[Decoder]:
    """The Decoder subclass registered under ``key`` (the ``decoder.kind`` of a model bundle)."""
    cls: type[Decoder] = resolve(DECODER_MODULES, key, "unknown decoder", ModelError)
    return cls

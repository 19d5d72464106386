"""MediaPipe's anchor (SSD) detectors as MediaPipe runs them: known layouts, their decoder params, their input.

A MediaPipe detector's ``.tflite`` holds raw heads: a regressor tensor
``[1, N, 4 + 2K]`` (box and K keypoints per anchor) and a score tensor
``[1, N, 1]``, decoded against anchors that MediaPipe computes from options
in the detector's graph (``.pbtxt``), not stored in the file. The file does not
say those options; its TFLite Model Metadata, where it has any, names the model
and its tensors but is copied between models (MediaPipe's pose detector calls
itself "Full Range Face Detection"), so the importer recognises a detector by
its input size and tensor layout, which pin the anchor options, and uses the
metadata only to say what the file calls itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgerun.decoders import mediapipe_ssd
from edgerun.engines.base import TensorSpec

# MediaPipe feeds its face and pose detectors letterboxed RGB scaled to [-1, 1]
# (ImageToTensorCalculator with output_tensor_float_range -1..1, keep_aspect_ratio, zero border).
PREPROCESS: dict[str, Any] = {
    "resize": "letterbox",
    "color": "rgb",
    "mean": [127.5, 127.5, 127.5],
    "std": [127.5, 127.5, 127.5],
    "pad_value": 0,
}
# ... and its palm detector the same letterbox scaled to [0, 1] (palm_detection_cpu.pbtxt: output_tensor_float_range
# 0..1; the full model's TFLite Model Metadata says mean 0, std 255 too).
PREPROCESS_0_1: dict[str, Any] = {**PREPROCESS, "mean": [0.0, 0.0, 0.0], "std": [255.0, 255.0, 255.0]}

# MediaPipe's face_detection_full_range.pbtxt over face_detection.pbtxt (FaceDetectionOptions): one layer of
# 48x48 anchors at stride 4, no interpolated anchor, 192x192 input, score 0.6.
BLAZEFACE_FULL_RANGE_PARAMS: dict[str, Any] = {
    **mediapipe_ssd.BLAZEFACE_SHORT_PARAMS,
    "num_layers": 1,
    "input_size_height": 192,
    "input_size_width": 192,
    "strides": [4],
    "interpolated_scale_aspect_ratio": 0.0,
    "num_boxes": 2304,
    "x_scale": 192.0,
    "y_scale": 192.0,
    "w_scale": 192.0,
    "h_scale": 192.0,
    "min_score_thresh": 0.6,
}
# MediaPipe's palm_detection_cpu.pbtxt (SsdAnchorsCalculator, TensorsToDetectionsCalculator, NMS at 0.3), the same
# for palm_detection_lite.tflite and palm_detection_full.tflite.
PALM_PARAMS: dict[str, Any] = {
    "num_layers": 4,
    "min_scale": 0.1484375,
    "max_scale": 0.75,
    "input_size_height": 192,
    "input_size_width": 192,
    "anchor_offset_x": 0.5,
    "anchor_offset_y": 0.5,
    "strides": [8, 16, 16, 16],
    "aspect_ratios": [1.0],
    "fixed_anchor_size": True,
    "interpolated_scale_aspect_ratio": 1.0,
    "reduce_boxes_in_lowest_layer": False,
    "num_classes": 1,
    "num_boxes": 2016,
    "num_coords": 18,
    "box_coord_offset": 0,
    "keypoint_coord_offset": 4,
    "num_keypoints": 7,
    "num_values_per_keypoint": 2,
    "sigmoid_score": True,
    "score_clipping_thresh": 100.0,
    "reverse_output_order": True,
    "x_scale": 192.0,
    "y_scale": 192.0,
    "w_scale": 192.0,
    "h_scale": 192.0,
    "min_score_thresh": 0.5,
    "min_suppression_threshold": 0.3,
}


@dataclass(frozen=True)
class KnownDetector:
    """One MediaPipe detector, identified by its input (height, width) and its anchors and coordinates."""

    title: str
    input_hw: tuple[int, int]
    num_boxes: int
    num_coords: int
    labels: tuple[str, ...]
    params: dict[str, Any]
    graph: str  # the MediaPipe graph the params come from
    preprocess: dict[str, Any] = field(default_factory=lambda: dict(PREPROCESS))  # its ImageToTensorCalculator


KNOWN: tuple[KnownDetector, ...] = (
    KnownDetector(
        title="MediaPipe BlazeFace short range",
        input_hw=(128, 128),
        num_boxes=896,
        num_coords=16,
        labels=("face",),
        params=mediapipe_ssd.BLAZEFACE_SHORT_PARAMS,
        graph="face_detection_short_range.pbtxt",
    ),
    KnownDetector(
        title="MediaPipe pose detector",
        input_hw=(224, 224),
        num_boxes=2254,
        num_coords=12,
        labels=("person",),
        params=mediapipe_ssd.POSE_DETECTOR_PARAMS,
        graph="pose_detection_cpu.pbtxt",
    ),
    KnownDetector(
        title="MediaPipe BlazeFace full range",
        input_hw=(192, 192),
        num_boxes=2304,
        num_coords=16,
        labels=("face",),
        params=BLAZEFACE_FULL_RANGE_PARAMS,
        graph="face_detection_full_range.pbtxt",
    ),
    KnownDetector(
        title="MediaPipe palm detector",
        input_hw=(192, 192),
        num_boxes=2016,
        num_coords=18,
        labels=("palm",),
        params=PALM_PARAMS,
        graph="palm_detection_cpu.pbtxt",
        preprocess=PREPROCESS_0_1,
    ),
)


@dataclass(frozen=True)
class AnchorHead:
    """The two raw outputs of an anchor head, by index into the model's outputs."""

    regressors: int
    scores: int
    num_boxes: int
    num_coords: int


def anchor_head(outputs: list[TensorSpec]) -> AnchorHead | None:
    """The regressor and score outputs when ``outputs`` are a MediaPipe-style anchor head, else None.

    Two float outputs ``[1, N, C]`` and ``[1, N, 1]`` with C = 4 + 2K: box plus
    keypoints per anchor, one score per anchor. (A ``[1, N, 4]`` boxes tensor
    among four outputs is the TFLite SSD post-process instead, decoded already.)
    """
    if len(outputs) != 2 or any(len(o.shape) != 3 or int(o.shape[0]) != 1 for o in outputs):
        return None
    (_, n0, c0), (_, n1, c1) = (tuple(int(d) for d in o.shape) for o in outputs)
    if n0 != n1 or n0 < 1:
        return None
    for reg, score, coords in ((0, 1, c0), (1, 0, c1)):
        if (c1 if reg == 0 else c0) == 1 and coords >= 4 and coords % 2 == 0:
            return AnchorHead(regressors=reg, scores=score, num_boxes=n0, num_coords=coords)
    return None


def known_detector(input_hw: tuple[int, int], head: AnchorHead) -> KnownDetector | None:
    """The known MediaPipe detector with this input size and head, if any."""
    for known in KNOWN:
        if (known.input_hw, known.num_boxes, known.num_coords) == (input_hw, head.num_boxes, head.num_coords):
            return known
    return None


def describe_known() -> str:
    return "; ".join(
        f"{k.title}: input {k.input_hw[1]}x{k.input_hw[0]}, [1, {k.num_boxes}, {k.num_coords}]" for k in KNOWN
    )

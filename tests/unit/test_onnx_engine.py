"""The ONNX Runtime engine on the real BlazeFace model, converted from the bundle's TFLite model.

The ONNX model is made here by ``edgerun.models.build_trt.onnx_variant``
(tflite2onnx): the same weights, in NCHW. Both back ends see the same photo,
each preprocessed for its own layout, and must agree on the raw outputs and
on the decoded faces.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install edgerun[onnx])")
pytest.importorskip("tflite2onnx", reason="tflite2onnx not installed (pip install edgerun[onnx])")

from edgerun.engines.base import ENGINE_MODULES, EngineOptions, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.engines.onnx import OnnxEngine, choose_providers, image_layout
from edgerun.errors import EngineError, ModelError
from edgerun.models.build_trt import onnx_variant
from edgerun.models.bundle import load_bundle


def bundle_with_onnx(bundle, dest: Path) -> Path:
    """A copy of ``bundle`` with a ``model.onnx`` variant converted from its TFLite model."""
    root = dest / bundle.name
    if not (root / "model.onnx").is_file():
        shutil.copytree(bundle.root, root, dirs_exist_ok=True)
        onnx_variant(root)
    return root


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory, blazeface_bundle):
    return load_bundle(bundle_with_onnx(blazeface_bundle, tmp_path_factory.mktemp("onnx")))


def test_registered_lazily():
    assert ENGINE_MODULES["onnx"] == "edgerun.engines.onnx:OnnxEngine"
    assert ENGINE_MODULES["tensorrt"] == "edgerun.engines.tensorrt:TensorRTEngine"
    assert engine_class("onnx") is OnnxEngine


def test_bundle_gets_an_onnx_variant(onnx_bundle):
    assert onnx_bundle.variant_path("onnx").name == "model.onnx"
    assert onnx_variant(onnx_bundle.root) == onnx_bundle.variant_path("onnx")  # converted once


def test_onnx_engine_specs_and_buffers(onnx_bundle):
    engine = OnnxEngine(onnx_bundle.variant_path("onnx"), EngineOptions(num_threads=1))
    assert engine.provider == "CPUExecutionProvider"
    assert engine.input_spec.shape == (1, 3, 128, 128) and engine.input_spec.layout == "NCHW"
    assert [s.shape for s in engine.output_specs] == [(1, 896, 16), (1, 896, 1)]
    tensor = engine.allocate_input()
    outputs = engine.allocate_outputs()
    tensor[...] = 0.0
    assert engine.infer(tensor, outputs) is outputs  # written into the caller's buffers
    before = outputs[1].copy()
    tensor[...] = 0.5  # same buffers, new contents: the binding reads them afresh
    engine.infer(tensor, outputs)
    assert not np.array_equal(before, outputs[1])
    engine.close()


def test_onnx_agrees_with_tflite_on_a_real_photo(onnx_bundle, astronaut_rgb):
    photo = cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR)
    size = (photo.shape[1], photo.shape[0])
    options = EngineOptions(num_threads=1)
    results = {}
    for key in ("tflite", "onnx"):
        engine = engine_class(key)(onnx_bundle.variant_path(key), options)
        runtime = build_runtime(onnx_bundle, engine, size)
        tensor = engine.allocate_input()
        outputs = engine.allocate_outputs()
        runtime.preprocessor(photo, tensor)
        engine.infer(tensor, outputs)
        raw = [o.copy() for o in outputs]
        detections = runtime.decoder.decode(outputs)
        runtime.preprocessor.letterbox.boxes_to_source(detections.boxes)
        results[key] = (tensor.copy(), raw, detections)
        engine.close()
    (t_tfl, raw_tfl, det_tfl), (t_onnx, raw_onnx, det_onnx) = results["tflite"], results["onnx"]
    np.testing.assert_allclose(t_onnx[0], t_tfl[0].transpose(2, 0, 1), atol=1e-6)  # same input, NCHW
    np.testing.assert_allclose(raw_onnx[0], raw_tfl[0], atol=2e-3)
    np.testing.assert_allclose(raw_onnx[1], raw_tfl[1], atol=2e-3)
    assert len(det_tfl) >= 1 and len(det_onnx) == len(det_tfl)  # the astronaut's face
    np.testing.assert_allclose(det_onnx.boxes, det_tfl.boxes, atol=1.0)  # within a pixel
    np.testing.assert_allclose(det_onnx.scores, det_tfl.scores, atol=1e-3)


def test_corrupt_onnx_is_a_model_error_naming_the_file(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07not an onnx model" * 10)
    with pytest.raises(ModelError, match=r"model.onnx: not a loadable ONNX model \(.*[Pp]rotobuf"):
        OnnxEngine(bad, EngineOptions())
    with pytest.raises(ModelError, match="not found"):
        OnnxEngine(tmp_path / "missing.onnx", EngineOptions())


def test_missing_onnxruntime_is_an_engine_error_at_open(tmp_path, monkeypatch):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with pytest.raises(EngineError, match=r"onnxruntime is not installed: pip install edgerun\[onnx\]"):
        OnnxEngine(model, EngineOptions())


def test_missing_tensorrt_is_an_engine_error_at_open(tmp_path, monkeypatch):
    model = tmp_path / "model.engine"
    model.write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(EngineError, match="TensorRT Python bindings not importable"):
        engine_class("tensorrt")(model, EngineOptions())


def test_provider_choice_follows_preference_and_device():
    available = ["CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider", "AzureExecutionProvider"]
    assert choose_providers(available, "cuda:1") == [
        ("TensorrtExecutionProvider", {"device_id": 1}),
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert choose_providers(["OpenVINOExecutionProvider", "CPUExecutionProvider"], "") == [
        "OpenVINOExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert choose_providers(available, "cpu") == ["CPUExecutionProvider"]
    cached = choose_providers(available, "cuda:0", Path("/var/lib/edgerun/onnx-trt-cache"))
    assert cached[0] == (
        "TensorrtExecutionProvider",
        {"device_id": 0, "trt_engine_cache_enable": True, "trt_engine_cache_path": "/var/lib/edgerun/onnx-trt-cache"},
    )
    assert cached[1] == ("CUDAExecutionProvider", {"device_id": 0})  # the cache is TensorRT's alone
    with pytest.raises(EngineError, match="expected cuda:N"):
        choose_providers(available, "cuda:x")


def test_image_layout_from_shape():
    assert image_layout((1, 3, 224, 224)) == "NCHW"
    assert image_layout((1, 224, 224, 3)) == "NHWC"
    assert image_layout((1, 896, 16)) == ""


def test_the_tensorrt_engine_cache_lives_under_the_state_directory(tmp_path, monkeypatch):
    from edgerun.engines.base import EngineOptions
    from edgerun.engines.onnx import trt_cache_dir

    assert trt_cache_dir(EngineOptions(extra={"state_dir": str(tmp_path / "state")})) == (
        tmp_path / "state" / "onnx-trt-cache"
    )
    assert (tmp_path / "state" / "onnx-trt-cache").is_dir()
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "systemd-state"))  # systemd's StateDirectory=
    assert trt_cache_dir(EngineOptions()) == tmp_path / "systemd-state" / "onnx-trt-cache"
    (tmp_path / "file").write_text("")
    assert trt_cache_dir(EngineOptions(extra={"state_dir": str(tmp_path / "file")})) is None  # not a directory


def test_the_node_hands_its_state_directory_to_accelerator_engines(onnx_bundle, tmp_path):
    from edgerun.config import parse_config
    from edgerun.engines.factory import open_failover

    state = tmp_path / "state"
    cfg = parse_config({"engine": {"order": ["onnx"], "state_dir": str(state)}})
    failover = open_failover(cfg, onnx_bundle, (640, 480))
    try:
        runtime = failover.start()
        assert runtime.engine.KEY == "onnx"
        assert runtime.engine.options.extra["state_dir"] == str(state)  # the TensorRT cache goes under it
    finally:
        failover.close()

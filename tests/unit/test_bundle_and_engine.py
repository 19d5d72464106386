from __future__ import annotations

import io
import shutil
import tarfile
import threading

import cv2
import numpy as np
import pytest

from edgerun.engines.base import EngineOptions, engine_class
from edgerun.errors import EngineError, ModelError
from edgerun.models.bundle import load_bundle


def test_demo_bundle_loads_and_names_its_variant(blazeface_bundle):
    assert blazeface_bundle.name == "blazeface_short"
    assert blazeface_bundle.labels == ("face",)
    assert blazeface_bundle.variant_path("tflite").is_file()
    assert blazeface_bundle.variant_path("onnx") is None


def test_bundle_tar_round_trip(tmp_path, blazeface_bundle):
    archive = tmp_path / "face.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(blazeface_bundle.root, arcname="face")
    bundle = load_bundle(archive, extract_dir=tmp_path / "x")
    assert bundle.name == "blazeface_short"
    assert bundle.variant_path("tflite").read_bytes() == blazeface_bundle.variant_path("tflite").read_bytes()


@pytest.mark.parametrize("name", ["../evil.tflite", "/etc/evil"])
def test_bundle_tar_with_escaping_paths_is_refused(tmp_path, name):
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        data = b"x"
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ModelError, match="points outside the bundle"):
        load_bundle(archive, extract_dir=tmp_path / "x")
    assert not (tmp_path / "evil.tflite").exists()


def test_bundle_tar_with_a_link_is_refused(tmp_path):
    archive = tmp_path / "link.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("model.tflite")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ModelError, match="is a link or device"):
        load_bundle(archive, extract_dir=tmp_path / "x")


def test_bundle_errors_are_specific(tmp_path, blazeface_bundle):
    with pytest.raises(ModelError, match="not found"):
        load_bundle(tmp_path / "nope")
    copy = tmp_path / "b"
    shutil.copytree(blazeface_bundle.root, copy)
    (copy / "model.tflite").unlink()
    with pytest.raises(ModelError, match="variants.tflite: file 'model.tflite' is missing"):
        load_bundle(copy)
    text = (copy / "model.toml").read_text().replace('tflite = "model.tflite"', 'onnx = "model.onnx"')
    (copy / "model.toml").write_text(text)
    with pytest.raises(ModelError, match="variants.onnx: file 'model.onnx' is missing"):
        load_bundle(copy)  # an onnx variant is a CPU fallback too
    text = (copy / "model.toml").read_text().replace('onnx = "model.onnx"', 'edgetpu = "model_edgetpu.tflite"')
    (copy / "model.toml").write_text(text)
    with pytest.raises(ModelError, match=r"variants needs tflite or onnx \(the CPU fallback\)"):
        load_bundle(copy)
    (copy / "model.toml").write_text('name = "x"\nversion = -1\n[decoder]\nkind = "k"\n[variants]\n')
    with pytest.raises(ModelError, match="version: expected int >= 0, got -1"):
        load_bundle(copy)


def test_tflite_engine_specs_and_inference(pose_tflite):
    engine = engine_class("tflite")(pose_tflite, EngineOptions(num_threads=1))
    assert engine.input_spec.shape == (1, 224, 224, 3)
    assert engine.input_spec.image_hw == (224, 224)
    assert [s.shape for s in engine.output_specs] == [(1, 2254, 12), (1, 2254, 1)]
    tensor = engine.allocate_input()
    assert tensor.ctypes.data % 64 == 0  # aligned for SIMD/DMA
    tensor[...] = 0
    outputs = engine.allocate_outputs()
    result = engine.infer(tensor, outputs)
    assert result is outputs and all(np.isfinite(o).all() for o in outputs)
    # The copied-out buffers equal what the interpreter returns itself.
    fresh = engine.infer(tensor)
    for a, b in zip(outputs, fresh):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("threads", "replicas", "want"),
    [(0, 0, (4, 1)), (2, 0, (2, 1)), (0, 2, (2, 2)), (0, 3, (1, 3)), (2, 3, (2, 3))],
)
def test_tflite_engine_cpu_layout(pose_tflite, monkeypatch, threads, replicas, want):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    engine = engine_class("tflite")(pose_tflite, EngineOptions(num_threads=threads, replicas=replicas))
    assert (engine.num_threads, engine.replicas) == want
    assert engine.cpu_threads == want[0] * want[1]
    assert engine.concurrent_calls == want[1]


def test_tflite_replicas_answer_concurrent_calls_like_one_interpreter(blazeface_tflite, astronaut_rgb):
    """Two threads hammer a two-replica engine with different inputs; every answer matches the serial one."""
    single = engine_class("tflite")(blazeface_tflite, EngineOptions(num_threads=1, replicas=1))
    double = engine_class("tflite")(blazeface_tflite, EngineOptions(num_threads=1, replicas=2))
    h, w = single.input_spec.image_hw
    photo = cv2.resize(astronaut_rgb, (w, h)).astype(np.float32) / 127.5 - 1.0
    inputs = [photo[None], np.zeros_like(photo)[None]]  # a face, and nothing
    expected = [single.infer(x) for x in inputs]
    mismatches: list[int] = []

    def hammer(which: int) -> None:
        outputs = double.allocate_outputs()
        for _ in range(100):
            double.infer(inputs[which], outputs)
            if not all(np.array_equal(a, b) for a, b in zip(outputs, expected[which])):
                mismatches.append(which)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not mismatches
    assert not all(np.array_equal(a, b) for a, b in zip(expected[0], expected[1]))  # the inputs differ


def test_corrupt_and_missing_models_are_model_errors(tmp_path):
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelError, match="not a loadable TFLite model"):
        engine_class("tflite")(bad, EngineOptions())
    with pytest.raises(ModelError, match="not found"):
        engine_class("tflite")(tmp_path / "missing.tflite", EngineOptions())


def test_edgetpu_without_libedgetpu_names_the_library(pose_tflite):
    with pytest.raises(EngineError) as info:
        engine_class("edgetpu")(pose_tflite, EngineOptions(device="usb:0"))
    assert "libedgetpu.so.1" in str(info.value) and "usb:0" in str(info.value)


def test_unknown_engine_key():
    with pytest.raises(EngineError, match="unknown engine 'cuda'"):
        engine_class("cuda")

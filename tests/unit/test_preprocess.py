from __future__ import annotations

import numpy as np
import pytest

from edgerun.engines.base import TensorSpec
from edgerun.models.bundle import PreprocessSpec
from edgerun.preprocess import Letterbox, Preprocessor


@pytest.mark.parametrize(
    ("src", "dst"), [((640, 480), (128, 128)), ((480, 640), (224, 224)), ((1920, 1080), (320, 192))]
)
@pytest.mark.parametrize("mode", ["letterbox", "stretch"])
def test_letterbox_round_trip(src, dst, mode):
    lb = Letterbox(*src, *dst, mode=mode)
    rng = np.random.default_rng(0)
    pts = rng.uniform(0, 1, (50, 4)).astype(np.float32) * np.array([src[0], src[1], src[0], src[1]], np.float32)
    back = lb.to_source(lb.to_model(pts))
    np.testing.assert_allclose(back, pts, atol=1e-2)


def test_letterbox_maps_strided_views_in_place_like_contiguous_arrays():
    lb = Letterbox(640, 480, 128, 128)
    rng = np.random.default_rng(2)
    rows = rng.uniform(0, 1, (5, 16)).astype(np.float32)
    expected = lb.to_source(rows[:, 4:].copy())
    view = rows[:, 4:]  # keypoint columns of decoder rows: not contiguous
    assert not view.flags.c_contiguous
    lb.to_source(view)
    np.testing.assert_allclose(rows[:, 4:], expected, rtol=1e-6)


def test_letterbox_pads_the_short_side_symmetrically():
    lb = Letterbox(640, 480, 128, 128)
    assert (lb.new_w, lb.new_h) == (128, 96)
    assert (lb.pad_x, lb.pad_y) == (0, 16)
    # The top-left of the image content is at (0, 16/128) in model coordinates.
    corner = lb.to_source(np.array([[0.0, 16 / 128]], np.float32))
    np.testing.assert_allclose(corner, [[0.0, 0.0]], atol=1e-4)
    boxes = lb.boxes_to_source(np.array([[-0.1, 0.0, 1.2, 1.0]], np.float32))
    np.testing.assert_allclose(boxes, [[0, 0, 640, 480]], atol=1e-3)  # clipped to the frame


def _image() -> np.ndarray:
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)


def test_float_normalisation_matches_the_formula():
    spec = PreprocessSpec(resize="stretch", color="rgb", mean=[127.5] * 3, std=[127.5] * 3)
    tensor_spec = TensorSpec("in", (1, 48, 64, 3), np.dtype(np.float32))
    pre = Preprocessor(spec, tensor_spec, 640, 480)
    image = np.zeros((480, 640, 3), np.uint8)
    image[..., 0] = 255  # blue in BGR
    tensor = np.empty(tensor_spec.shape, np.float32)
    pre(image, tensor)
    # RGB order: red and green are -1, blue is +1.
    np.testing.assert_allclose(tensor[0, ..., 0], -1.0, atol=1e-6)
    np.testing.assert_allclose(tensor[0, ..., 1], -1.0, atol=1e-6)
    np.testing.assert_allclose(tensor[0, ..., 2], 1.0, atol=1e-6)


def test_letterbox_padding_value_in_tensor():
    spec = PreprocessSpec(resize="letterbox", color="bgr", mean=[0.0] * 3, std=[1.0] * 3, pad_value=0)
    tensor_spec = TensorSpec("in", (1, 128, 128, 3), np.dtype(np.float32))
    pre = Preprocessor(spec, tensor_spec, 640, 480)
    tensor = np.empty(tensor_spec.shape, np.float32)
    pre(np.full((480, 640, 3), 200, np.uint8), tensor)
    assert np.all(tensor[0, :16] == 0) and np.all(tensor[0, -16:] == 0)
    assert np.all(tensor[0, 16:112] == 200)


@pytest.mark.parametrize(
    ("dtype", "scale", "zero_point"), [(np.uint8, 1 / 255, 0), (np.int8, 1 / 255, -128), (np.uint8, 2 / 255, 128)]
)
def test_quantised_input_matches_float_then_quantise(dtype, scale, zero_point):
    spec = PreprocessSpec(resize="letterbox", color="rgb", mean=[0.0] * 3, std=[255.0] * 3)
    fspec = TensorSpec("in", (1, 96, 96, 3), np.dtype(np.float32))
    qspec = TensorSpec("in", (1, 96, 96, 3), np.dtype(dtype), scale=scale, zero_point=zero_point)
    image = _image()
    ftensor = np.empty(fspec.shape, np.float32)
    Preprocessor(spec, fspec, 640, 480)(image, ftensor)
    qtensor = np.empty(qspec.shape, dtype)
    Preprocessor(spec, qspec, 640, 480)(image, qtensor)
    info = np.iinfo(dtype)
    expected = np.clip(np.rint(ftensor / scale + zero_point), info.min, info.max).astype(dtype)
    assert np.abs(qtensor.astype(int) - expected.astype(int)).max() <= 1
    # Dequantised values land within one step of the float input.
    np.testing.assert_allclose(qspec.dequantise(qtensor), ftensor, atol=scale * 1.01)


def test_identity_uint8_is_a_plain_copy():
    spec = PreprocessSpec(resize="stretch", color="bgr", mean=[0.0] * 3, std=[1.0] * 3)
    qspec = TensorSpec("in", (1, 480, 640, 3), np.dtype(np.uint8), scale=1.0, zero_point=0)
    image = _image()
    tensor = np.empty(qspec.shape, np.uint8)
    Preprocessor(spec, qspec, 640, 480)(image, tensor)
    np.testing.assert_array_equal(tensor[0], image)


def test_nchw_layout():
    spec = PreprocessSpec(resize="stretch", color="rgb", mean=[0.0] * 3, std=[1.0] * 3)
    nchw = TensorSpec("in", (1, 3, 32, 32), np.dtype(np.float32), layout="NCHW")
    nhwc = TensorSpec("in", (1, 32, 32, 3), np.dtype(np.float32))
    image = _image()
    a = np.empty(nchw.shape, np.float32)
    b = np.empty(nhwc.shape, np.float32)
    Preprocessor(spec, nchw, 640, 480)(image, a)
    Preprocessor(spec, nhwc, 640, 480)(image, b)
    np.testing.assert_array_equal(a[0], b[0].transpose(2, 0, 1))


def test_preprocess_writes_in_place_without_new_buffers():
    import tracemalloc

    spec = PreprocessSpec(resize="letterbox", color="rgb", mean=[127.5] * 3, std=[127.5] * 3)
    tspec = TensorSpec("in", (1, 224, 224, 3), np.dtype(np.float32))
    pre = Preprocessor(spec, tspec, 640, 480)
    image = _image()
    tensor = np.empty(tspec.shape, np.float32)
    pre(image, tensor)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(5):
            pre(image, tensor)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 64 * 1024

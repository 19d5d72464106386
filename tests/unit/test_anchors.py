"""SSD anchors against counts and values worked out by hand from MediaPipe's algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgerun.decoders.anchors import SsdAnchorOptions, ssd_anchors
from edgerun.decoders.mediapipe_ssd import BLAZEFACE_SHORT_PARAMS, POSE_DETECTOR_PARAMS
from edgerun.decoders.params import ParamReader
from edgerun.errors import ModelError


def options_from(params: dict, **overrides) -> SsdAnchorOptions:
    merged = {**params, **overrides}
    keys = SsdAnchorOptions.__dataclass_fields__.keys()
    return SsdAnchorOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in merged.items() if k in keys})


def assert_f32(actual: np.ndarray, expected) -> None:
    """Equal up to float32 rounding: the anchors are computed in float32 as in MediaPipe."""
    np.testing.assert_allclose(actual, np.asarray(expected, np.float64), rtol=2e-7, atol=0)


def blazeface(**overrides) -> np.ndarray:
    return ssd_anchors(options_from(BLAZEFACE_SHORT_PARAMS, **overrides))


def pose(**overrides) -> np.ndarray:
    return ssd_anchors(options_from(POSE_DETECTOR_PARAMS, **overrides))


# MediaPipe's SSD MobileNet example (ssd_anchors_calculator.cc usage comment), 1917 anchors.
SSD_MOBILENET = SsdAnchorOptions(
    num_layers=6,
    min_scale=0.2,
    max_scale=0.95,
    input_size_height=300,
    input_size_width=300,
    strides=(16, 32, 64, 128, 256, 512),
    aspect_ratios=(1.0, 2.0, 0.5, 3.0, 0.3333),
    reduce_boxes_in_lowest_layer=True,
)


def test_blazeface_short_range_has_896_anchors_in_mediapipe_order():
    a = blazeface()
    assert a.shape == (896, 4) and a.dtype == np.float32
    # Stride 8 on 128 px: a 16x16 grid, 2 anchors per cell (aspect 1.0 + interpolated).
    np.testing.assert_array_equal(a[0], [0.5 / 16, 0.5 / 16, 1.0, 1.0])
    np.testing.assert_array_equal(a[1], a[0])
    np.testing.assert_array_equal(a[2], [1.5 / 16, 0.5 / 16, 1.0, 1.0])  # next column, same row
    np.testing.assert_array_equal(a[32], [0.5 / 16, 1.5 / 16, 1.0, 1.0])  # next row
    np.testing.assert_array_equal(a[511], [15.5 / 16, 15.5 / 16, 1.0, 1.0])
    # The three stride-16 layers merge into one 8x8 grid with 6 anchors per cell.
    np.testing.assert_array_equal(a[512:518], np.tile([0.5 / 8, 0.5 / 8, 1.0, 1.0], (6, 1)))
    np.testing.assert_array_equal(a[518], [1.5 / 8, 0.5 / 8, 1.0, 1.0])
    np.testing.assert_array_equal(a[-1], [7.5 / 8, 7.5 / 8, 1.0, 1.0])


def test_pose_detector_has_2254_anchors():
    a = pose()
    assert a.shape == (2254, 4)
    # 28x28x2 = 1568 at stride 8, 14x14x2 = 392 at stride 16, then 7x7x6 at stride 32.
    assert_f32(a[1567], [27.5 / 28, 27.5 / 28, 1.0, 1.0])
    assert_f32(a[1568], [0.5 / 14, 0.5 / 14, 1.0, 1.0])
    assert_f32(a[1959], [13.5 / 14, 13.5 / 14, 1.0, 1.0])
    assert_f32(a[1960:1966], np.tile([0.5 / 7, 0.5 / 7, 1.0, 1.0], (6, 1)))
    assert_f32(a[-1], [6.5 / 7, 6.5 / 7, 1.0, 1.0])


def test_anchor_sizes_follow_scales_of_merged_layers():
    a = blazeface(fixed_anchor_size=False)
    s = [0.1484375 + (0.75 - 0.1484375) * i / 3 for i in range(4)]
    # Layer 0: its scale, then the interpolated sqrt(s0 * s1).
    np.testing.assert_allclose(a[0, 2:], [s[0], s[0]], rtol=1e-6)
    np.testing.assert_allclose(a[1, 2:], [math.sqrt(s[0] * s[1])] * 2, rtol=1e-6)
    # Stride-16 cell: layers 1, 2, 3 each give (scale, interpolated); the last layer interpolates with 1.0.
    expected = [s[1], math.sqrt(s[1] * s[2]), s[2], math.sqrt(s[2] * s[3]), s[3], math.sqrt(s[3] * 1.0)]
    np.testing.assert_allclose(a[512:518, 2], expected, rtol=1e-6)
    np.testing.assert_allclose(a[512:518, 3], expected, rtol=1e-6)


def test_reduced_lowest_layer_and_aspect_ratios():
    a = ssd_anchors(SSD_MOBILENET)
    # 19x19x3 + 10x10x6 + 5x5x6 + 3x3x6 + 2x2x6 + 1x1x6
    assert a.shape == (1917, 4)
    c = 0.5 / 19
    r2 = math.sqrt(2.0)
    # Lowest layer: fixed (1.0, 0.1), (2.0, s0), (0.5, s0) with s0 = 0.2.
    np.testing.assert_allclose(a[0], [c, c, 0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(a[1], [c, c, 0.2 * r2, 0.2 / r2], rtol=1e-6)
    np.testing.assert_allclose(a[2], [c, c, 0.2 / r2, 0.2 * r2], rtol=1e-6)
    # Layer 1 (stride 32 -> ceil(300/32) = 10): scale 0.35, interpolated sqrt(0.35 * 0.5).
    np.testing.assert_allclose(a[1083], [0.05, 0.05, 0.35, 0.35], rtol=1e-6)
    np.testing.assert_allclose(a[1088, 2:], [math.sqrt(0.35 * 0.5)] * 2, rtol=1e-6)
    # Last layer (1x1): scale 0.95 with each ratio, then sqrt(0.95 * 1.0).
    last = a[-6:]
    np.testing.assert_allclose(last[:, :2], 0.5)
    widths = [0.95, 0.95 * r2, 0.95 / r2, 0.95 * math.sqrt(3.0), 0.95 * math.sqrt(0.3333), math.sqrt(0.95)]
    heights = [0.95, 0.95 / r2, 0.95 * r2, 0.95 / math.sqrt(3.0), 0.95 / math.sqrt(0.3333), math.sqrt(0.95)]
    np.testing.assert_allclose(last[:, 2], widths, rtol=1e-5)
    np.testing.assert_allclose(last[:, 3], heights, rtol=1e-5)


def test_no_interpolated_anchor_when_ratio_is_zero():
    a = blazeface(interpolated_scale_aspect_ratio=0.0)
    assert a.shape == (448, 4)  # 16*16*1 + 8*8*3
    np.testing.assert_array_equal(a[1], [1.5 / 16, 0.5 / 16, 1.0, 1.0])


def test_anchor_offset_and_explicit_feature_maps():
    a = ssd_anchors(
        SsdAnchorOptions(
            num_layers=1,
            min_scale=0.2,
            max_scale=0.8,
            input_size_height=64,
            input_size_width=64,
            strides=(8,),
            anchor_offset_x=0.0,
            anchor_offset_y=0.0,
            feature_map_height=(2,),
            feature_map_width=(3,),
            fixed_anchor_size=True,
        )
    )
    assert a.shape == (2 * 3 * 2, 4)  # the explicit 2x3 map wins over 64/8 = 8x8
    np.testing.assert_allclose(a[::2, 0], [0, 1 / 3, 2 / 3, 0, 1 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(a[::2, 1], [0, 0, 0, 0.5, 0.5, 0.5], rtol=1e-6)


def test_one_stride_uses_mean_scale():
    a = ssd_anchors(
        SsdAnchorOptions(
            num_layers=1, min_scale=0.2, max_scale=0.6, input_size_height=32, input_size_width=32, strides=(16,)
        )
    )
    np.testing.assert_allclose(a[0, 2:], [0.4, 0.4], rtol=1e-6)
    np.testing.assert_allclose(a[1, 2:], [math.sqrt(0.4 * 1.0)] * 2, rtol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strides": (8, 16)}, "strides has 2 values but num_layers is 4"),
        ({"strides": (8, 16, 0, 16)}, "strides must be >= 1"),
        ({"feature_map_height": (8,), "feature_map_width": (8, 8)}, "feature_map_height and feature_map_width"),
        ({"aspect_ratios": (), "interpolated_scale_aspect_ratio": 0.0}, "zero anchors per cell"),
    ],
)
def test_inconsistent_options_raise_model_error(overrides, message):
    with pytest.raises(ModelError, match=message):
        blazeface(**overrides)


def test_from_params_defaults_input_size_to_the_model_and_names_bad_keys():
    params = {k: v for k, v in BLAZEFACE_SHORT_PARAMS.items() if k not in ("input_size_height", "input_size_width")}
    reader = ParamReader("mediapipe_ssd", params)
    opts = SsdAnchorOptions.from_params(reader, (128, 128))
    assert (opts.input_size_height, opts.input_size_width) == (128, 128)
    assert ssd_anchors(opts).shape == (896, 4)

    with pytest.raises(ModelError, match=r"mediapipe_ssd: decoder.params.strides: expected a list of integers"):
        SsdAnchorOptions.from_params(ParamReader("mediapipe_ssd", {**params, "strides": "8,16"}), (128, 128))
    with pytest.raises(ModelError, match=r"decoder.params.input_size_height: is required"):
        SsdAnchorOptions.from_params(ParamReader("mediapipe_ssd", params), None)

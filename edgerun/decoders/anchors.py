"""SSD anchor generation, a port of MediaPipe's ``SsdAnchorsCalculator``.

MediaPipe's anchor-based detectors (BlazeFace, the pose and palm detectors)
predict offsets from a fixed grid of anchors that is not stored in the model:
it is rebuilt from the graph options. Any deviation from MediaPipe's order or
arithmetic shifts every box, so this follows
``mediapipe/calculators/tflite/ssd_anchors_calculator.cc`` step by step,
including its float32 arithmetic and the merging of consecutive layers with the
same stride. Only the non-multiscale generator is ported (the one every
MediaPipe detection graph uses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgerun.decoders.params import REQUIRED, ParamReader
from edgerun.errors import ModelError

_F32 = np.float32


@dataclass(frozen=True, slots=True)
class SsdAnchorOptions:
    """``SsdAnchorsCalculatorOptions`` with MediaPipe's defaults (snake_case names kept)."""

    num_layers: int
    min_scale: float
    max_scale: float
    input_size_height: int
    input_size_width: int
    strides: tuple[int, ...]
    aspect_ratios: tuple[float, ...] = (1.0,)
    anchor_offset_x: float = 0.5
    anchor_offset_y: float = 0.5
    fixed_anchor_size: bool = False
    interpolated_scale_aspect_ratio: float = 1.0
    reduce_boxes_in_lowest_layer: bool = False
    # Explicit feature map sizes override ceil(input / stride), as in MediaPipe.
    feature_map_height: tuple[int, ...] = ()
    feature_map_width: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ModelError(f"ssd anchors: num_layers must be >= 1, got {self.num_layers}")
        # MediaPipe CHECK-fails (or loops forever) when these disagree; fail with a message instead.
        if len(self.strides) != self.num_layers:
            raise ModelError(f"ssd anchors: strides has {len(self.strides)} values but num_layers is {self.num_layers}")
        if any(s < 1 for s in self.strides):
            raise ModelError(f"ssd anchors: strides must be >= 1, got {list(self.strides)}")
        explicit_maps = bool(self.feature_map_height or self.feature_map_width)
        if explicit_maps and not (len(self.feature_map_height) == len(self.feature_map_width) == self.num_layers):
            raise ModelError(
                "ssd anchors: feature_map_height and feature_map_width need num_layers "
                f"({self.num_layers}) values each, got {len(self.feature_map_height)} "
                f"and {len(self.feature_map_width)}"
            )
        if self.input_size_height < 1 or self.input_size_width < 1:
            raise ModelError(
                f"ssd anchors: input size must be positive, got {self.input_size_height}x{self.input_size_width}"
            )
        no_ratios = not self.aspect_ratios and not self.reduce_boxes_in_lowest_layer
        if no_ratios and self.interpolated_scale_aspect_ratio <= 0:
            raise ModelError("ssd anchors: no aspect_ratios and no interpolated anchor: zero anchors per cell")
        if any(a <= 0 for a in self.aspect_ratios):
            raise ModelError(f"ssd anchors: aspect_ratios must be > 0, got {list(self.aspect_ratios)}")

    @classmethod
    def from_params(cls, reader: ParamReader, default_input_hw: tuple[int, int] | None = None) -> SsdAnchorOptions:
        """Read the anchor options from a decoder's params; the input size defaults to the model's."""
        default_h = default_input_hw[0] if default_input_hw else REQUIRED
        default_w = default_input_hw[1] if default_input_hw else REQUIRED
        kwargs: dict[str, Any] = {  # each value is typed by its reader call
            "num_layers": reader.integer("num_layers", min_value=1),
            "min_scale": reader.number("min_scale"),
            "max_scale": reader.number("max_scale"),
            "input_size_height": reader.integer("input_size_height", default_h, min_value=1),
            "input_size_width": reader.integer("input_size_width", default_w, min_value=1),
            "strides": reader.integers("strides", min_value=1),
            "aspect_ratios": reader.numbers("aspect_ratios", [1.0]),
            "anchor_offset_x": reader.number("anchor_offset_x", 0.5),
            "anchor_offset_y": reader.number("anchor_offset_y", 0.5),
            "fixed_anchor_size": reader.flag("fixed_anchor_size", False),
            "interpolated_scale_aspect_ratio": reader.number("interpolated_scale_aspect_ratio", 1.0),
            "reduce_boxes_in_lowest_layer": reader.flag("reduce_boxes_in_lowest_layer", False),
            "feature_map_height": reader.integers("feature_map_height", [], min_value=1),
            "feature_map_width": reader.integers("feature_map_width", [], min_value=1),
        }
        try:
            return cls(**kwargs)
        except ModelError as err:
            raise ModelError(f"{reader.decoder_key}: decoder.params: {err}") from None


def _calculate_scale(min_scale: float, max_scale: float, stride_index: int, num_strides: int) -> np.float32:
    """MediaPipe's CalculateScale: float inputs, a double intermediate, a float result."""
    lo, hi = _F32(min_scale), _F32(max_scale)
    if num_strides == 1:
        return _F32((lo + hi) * _F32(0.5))
    return _F32(float(lo) + float(hi - lo) * 1.0 * stride_index / float(num_strides - _F32(1.0)))


def ssd_anchors(options: SsdAnchorOptions) -> np.ndarray:
    """All anchors as an ``(N, 4)`` float32 array of ``x_center, y_center, w, h`` (normalised).

    The order is MediaPipe's: layer groups, then rows, then columns, then the
    anchors of one cell, which is the order of the model's output rows.
    """
    o = options
    blocks: list[np.ndarray] = []
    num_strides = len(o.strides)
    layer_id = 0
    while layer_id < o.num_layers:
        aspect_ratios: list[np.float32] = []
        scales: list[np.float32] = []
        # Consecutive layers with the same stride share one grid; their anchors interleave per cell.
        last_same_stride_layer = layer_id
        while last_same_stride_layer < num_strides and o.strides[last_same_stride_layer] == o.strides[layer_id]:
            scale = _calculate_scale(o.min_scale, o.max_scale, last_same_stride_layer, num_strides)
            if last_same_stride_layer == 0 and o.reduce_boxes_in_lowest_layer:
                aspect_ratios += [_F32(1.0), _F32(2.0), _F32(0.5)]
                scales += [_F32(0.1), scale, scale]
            else:
                for aspect_ratio in o.aspect_ratios:
                    aspect_ratios.append(_F32(aspect_ratio))
                    scales.append(scale)
                if o.interpolated_scale_aspect_ratio > 0.0:
                    scale_next = (
                        _F32(1.0)
                        if last_same_stride_layer == num_strides - 1
                        else _calculate_scale(o.min_scale, o.max_scale, last_same_stride_layer + 1, num_strides)
                    )
                    scales.append(_F32(math.sqrt(float(_F32(scale * scale_next)))))
                    aspect_ratios.append(_F32(o.interpolated_scale_aspect_ratio))
            last_same_stride_layer += 1

        ratio_sqrts = np.sqrt(np.array(aspect_ratios, dtype=_F32))
        scale_arr = np.array(scales, dtype=_F32)
        anchor_h = scale_arr / ratio_sqrts
        anchor_w = scale_arr * ratio_sqrts

        if o.feature_map_height:
            fm_h, fm_w = o.feature_map_height[layer_id], o.feature_map_width[layer_id]
        else:
            stride = o.strides[layer_id]
            fm_h = math.ceil(float(_F32(1.0) * _F32(o.input_size_height) / _F32(stride)))
            fm_w = math.ceil(float(_F32(1.0) * _F32(o.input_size_width) / _F32(stride)))

        num_per_cell = len(scales)
        x_center = (np.arange(fm_w, dtype=_F32) + _F32(o.anchor_offset_x)) * _F32(1.0) / _F32(fm_w)
        y_center = (np.arange(fm_h, dtype=_F32) + _F32(o.anchor_offset_y)) * _F32(1.0) / _F32(fm_h)
        block = np.empty((fm_h, fm_w, num_per_cell, 4), dtype=_F32)
        block[..., 0] = x_center[None, :, None]
        block[..., 1] = y_center[:, None, None]
        if o.fixed_anchor_size:
            block[..., 2:] = 1.0
        else:
            block[..., 2] = anchor_w[None, None, :]
            block[..., 3] = anchor_h[None, None, :]
        blocks.append(block.reshape(-1, 4))
        layer_id = last_same_stride_layer
    return np.concatenate(blocks, axis=0)

"""``edgerun model import``: a complete bundle from what a model file says about itself.

A user arrives with a detector exported elsewhere, most often by Ultralytics.
The file already says what it is: Ultralytics writes ``names``, ``imgsz``,
``stride``, ``task`` and ``end2end`` into the ONNX ``metadata_props`` (values
are Python literals, read here with ``ast.literal_eval``), and the output
shapes tell the head apart (YOLOv5 ``[1, N, 5 + C]``, YOLOv8/11
``[1, 4 + C, N]``, SSD post-process, MediaPipe's raw anchor heads,
classification). The importer reads all
of that, fixes dynamic input dimensions to the stated size with onnx's own
tools, builds the decoder on the real tensors (so a bundle it writes is one
the node accepts), and reports each setting with where it came from.

What it cannot decode it refuses in one line naming the tensor and its shape.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.decoders import decoder_class
from edgerun.decoders.base import describe_tensor
from edgerun.decoders.yolo import grid_sizes_v8
from edgerun.decoders.yolo_end2end import ROW_VALUES as END_TO_END_VALUES
from edgerun.engines.base import EngineOptions, TensorSpec
from edgerun.errors import ModelError
from edgerun.models import mediapipe
from edgerun.models.bundle import MANIFEST, ModelBundle, file_sha256, load_bundle, write_manifest
from edgerun.models.tflite_model_metadata import ModelMetadata, TensorMetadata

# Ultralytics trains and predicts on letterboxed RGB scaled to [0, 1], padded with grey 114
# (ultralytics/data/augment.py LetterBox), and its predictor keeps boxes at conf >= 0.25, NMS IoU 0.7,
# at most 300 detections (ultralytics/cfg/default.yaml).
ULTRALYTICS_PAD = 114
ULTRALYTICS_CONF = 0.25
ULTRALYTICS_IOU = 0.7
ULTRALYTICS_MAX_DET = 300
# YOLOv5's own export (the yolov5 repository and its PyPI package) writes only ``stride`` and ``names``; its
# detect.py letterboxes the same way and keeps conf >= 0.25 with NMS IoU 0.45.
YOLOV5_IOU = 0.45
YOLOV5_MAX_DET = 1000

ONNX_VARIANT = "model.onnx"


@dataclass(frozen=True)
class Setting:
    """One inferred bundle setting and where it came from, as ``model import`` prints it."""

    key: str
    value: Any
    source: str


@dataclass
class ImportResult:
    bundle: ModelBundle
    settings: list[Setting] = field(default_factory=list)

    def format(self) -> str:
        width = max((len(s.key) for s in self.settings), default=0)
        lines = [f"  {s.key:<{width}}  {_show(s.value)}  ({s.source})" for s in self.settings]
        lines.append(f"bundle {self.bundle.name} v{self.bundle.version} written to {self.bundle.root}")
        return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:
        return f"[{', '.join(repr(v) for v in value[:4])}, ... ({len(value)} in all)]"
    return str(value)


@dataclass
class UltralyticsMetadata:
    """The keys of Ultralytics' export metadata that decide how to feed and read the model."""

    names: list[str] | None = None
    imgsz: tuple[int, int] | None = None  # (height, width)
    stride: int | None = None
    task: str | None = None
    end2end: bool = False
    exporter: str = "Ultralytics"  # or "YOLOv5" (the yolov5 repository's export: stride and names only)
    description: str = ""
    version: str = ""
    license: str = ""


def parse_ultralytics_metadata(props: dict[str, Any]) -> UltralyticsMetadata | None:
    """Ultralytics metadata from ONNX ``metadata_props`` or a TFLite file's ``metadata.json`` (None when absent).

    In ONNX the exporter writes ``str(value)`` for each key, so ``names`` is a dict
    literal ``{0: 'person', ...}`` and ``imgsz`` a list literal ``[640, 640]``; in
    TFLite the values are JSON (``names`` keyed by strings ``"0"``), taken as they are.
    """
    yolov5 = props.get("author") != "Ultralytics" and {"names", "stride"} <= props.keys() and "imgsz" not in props
    if props.get("author") != "Ultralytics" and not {"names", "imgsz"} <= props.keys() and not yolov5:
        return None
    meta = UltralyticsMetadata(
        exporter="YOLOv5" if yolov5 else "Ultralytics",
        description=str(props.get("description", "")),
        version=str(props.get("version", "")),
        license=str(props.get("license", "")),
        task=str(props.get("task") or "") or None,
    )
    if "names" in props:
        meta.names = _names(_literal(props, "names"))
    if "imgsz" in props:
        imgsz = _literal(props, "imgsz")
        if isinstance(imgsz, int) and not isinstance(imgsz, bool):
            imgsz = [imgsz, imgsz]
        if not (isinstance(imgsz, list | tuple) and len(imgsz) == 2 and all(isinstance(v, int) for v in imgsz)):
            raise ModelError(f"metadata imgsz: expected [height, width], got {props['imgsz']!r}")
        meta.imgsz = (int(imgsz[0]), int(imgsz[1]))
    if "stride" in props:
        stride = _literal(props, "stride")
        if not isinstance(stride, int):
            raise ModelError(f"metadata stride: expected an integer, got {props['stride']!r}")
        meta.stride = stride
    if "end2end" in props:
        meta.end2end = _literal(props, "end2end") is True
    return meta


def _literal(props: dict[str, Any], key: str) -> Any:
    if not isinstance(props[key], str):
        return props[key]  # already a value (JSON metadata)
    try:
        return ast.literal_eval(props[key])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ModelError(f"metadata {key}: not a Python literal: {props[key][:80]!r}") from None


def _names(value: Any) -> list[str]:
    """Class names indexed 0..C-1 from a ``{index: name}`` dict or a list."""
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, dict) and all(isinstance(k, str) and k.isdigit() for k in value):
        value = {int(k): v for k, v in value.items()}  # JSON object keys are strings
    if isinstance(value, dict) and all(isinstance(k, int) and isinstance(v, str) for k, v in value.items()):
        if sorted(value) != list(range(len(value))):
            raise ModelError(f"metadata names: class indices must be 0..{len(value) - 1}, got {sorted(value)[:8]}")
        return [value[i] for i in range(len(value))]
    raise ModelError(f"metadata names: expected {{index: name}} or a list of names, got {str(value)[:80]}")


def parse_size(text: str) -> tuple[int, int]:
    """``--input WxH`` (or one number for a square) -> (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    if not match:
        raise ModelError(f"--input: expected WxH such as 640x480, got {text!r}")
    w = int(match.group(1))
    h = int(match.group(2) or w)
    if w < 1 or h < 1:
        raise ModelError(f"--input: width and height must be positive, got {text!r}")
    return h, w


def read_labels(path: Path) -> list[str]:
    """One label a line; blank lines at the end are ignored, blank lines inside are an error."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ModelError(f"--labels: cannot read {path} ({err})") from None
    while lines and not lines[-1].strip():
        lines.pop()
    labels = [line.strip() for line in lines]
    if not labels:
        raise ModelError(f"--labels: {path} has no labels")
    if "" in labels:
        raise ModelError(f"--labels: {path} line {labels.index('') + 1} is blank (one label a line)")
    return labels


# -- ONNX --------------------------------------------------------------------------------------


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ModelError("model import needs the onnx package: pip install edgerun[onnx]") from None
    return onnx


def _dims(value_info: Any) -> list[int | str]:
    """A graph input's or output's dimensions: ints where fixed, the symbol's name (or "?") where not."""
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in value_info.type.tensor_type.shape.dim
    ]


def _show_dims(dims: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def fix_onnx_input(model: Any, input_hw: tuple[int, int], path: Path) -> tuple[Any, list[str]]:
    """The model with its one image input fixed to ``[1, C, H, W]`` (or NHWC) and its outputs' dims resolved.

    Input dims are set with ``onnx.tools.update_model_dims``; the output dims
    then follow from running the fixed graph once in ONNX Runtime on the CPU (the
    engine that will run it), are written the same way, and the result must
    pass ``onnx.checker`` with strict shape inference. Returns the model and what
    was changed (empty when nothing was dynamic).
    """
    onnx = _onnx()
    from onnx.tools import update_model_dims

    graph_input = _graph_inputs(model, path)[0]
    dims = _dims(graph_input)
    if len(dims) != 4:
        raise ModelError(f"{path}: input {graph_input.name!r} {_show_dims(dims)} is not an image input [1, 3, H, W]")
    nchw = _is_nchw(dims)
    channels = dims[1] if nchw else dims[3]
    channels = channels if isinstance(channels, int) else 3
    h, w = input_hw
    fixed = [1, channels, h, w] if nchw else [1, h, w, channels]
    for i, (have, want) in enumerate(zip(dims, fixed)):
        if isinstance(have, int) and have != want and i != 0:
            raise ModelError(
                f"{path}: input {graph_input.name!r} is fixed at {_show_dims(dims)}; it cannot take "
                f"{_show_dims(fixed)} (re-export at that size, or leave --input out)"
            )
    changed = [f"input {graph_input.name!r} {_show_dims(dims)} -> {_show_dims(fixed)}"] if dims != fixed else []
    outputs = {o.name: _dims(o) for o in model.graph.output}
    if not changed and all(isinstance(d, int) for dims_ in outputs.values() for d in dims_):
        return model, []
    try:
        model = update_model_dims.update_inputs_outputs_dims(model, {graph_input.name: fixed}, outputs)
        actual = _run_once(model, graph_input.name, fixed, path)
        concrete = {name: list(actual[name]) for name in outputs}
        for name, dims_ in outputs.items():
            if dims_ != concrete[name]:
                changed.append(f"output {name!r} {_show_dims(dims_)} -> {_show_dims(concrete[name])}")
        model = update_model_dims.update_inputs_outputs_dims(model, {graph_input.name: fixed}, concrete)
        # Intermediate shapes recorded for the dynamic graph would keep its symbols: infer them afresh.
        del model.graph.value_info[:]
        model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        onnx.checker.check_model(model)
    except ModelError:
        raise
    except Exception as err:  # onnx raises its own error types (some from C++), and KeyError/ValueError
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{path}: fixing the dimensions with onnx failed ({type(err).__name__}: {first})") from None
    return model, changed


def _is_nchw(dims: Sequence[int | str]) -> bool:
    """Channels first (PyTorch exports) unless axis 3, and not axis 1, is 1 or 3 wide (TensorFlow's NHWC)."""
    if dims[1] in (1, 3):
        return True
    return dims[3] not in (1, 3)


def _graph_inputs(model: Any, path: Path) -> list[Any]:
    """The graph's real inputs (older exporters list initializers as inputs too)."""
    weights = {init.name for init in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in weights]
    if len(inputs) != 1:
        names = ", ".join(repr(i.name) for i in inputs)
        raise ModelError(f"{path}: expected one input tensor, found {len(inputs)} ({names})")
    return inputs


def _run_once(model: Any, input_name: str, shape: list[int], path: Path) -> dict[str, tuple[int, ...]]:
    """Output shapes of one inference on zeros, on ONNX Runtime's CPU provider."""
    from edgerun.engines.onnx import onnxruntime_module

    ort = onnxruntime_module()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        elem_type = session.get_inputs()[0].type
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8}.get(
            elem_type, np.float32
        )
        results = session.run(None, {input_name: np.zeros(shape, dtype)})
    except Exception as err:  # onnxruntime raises its own pybind exception types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{path}: does not run at input {_show_dims(shape)} ({first})") from None
    names = [o.name for o in session.get_outputs()]
    return {name: tuple(int(d) for d in np.shape(r)) for name, r in zip(names, results)}


# -- decoder and preprocessing from the tensors and the metadata --------------------------------


@dataclass
class DecoderChoice:
    kind: str
    params: dict[str, Any]
    source: str


def choose_decoder(
    outputs: list[TensorSpec],
    meta: UltralyticsMetadata | None,
    num_names: int | None,
    path: Path,
    coords: BoxCoords | None = None,
    input_hw: tuple[int, int] | None = None,
) -> DecoderChoice:
    """The decoder kind for these outputs, from their shapes and the file's metadata; refuses the rest.

    ``num_names`` is the count of the labels (the file's names or ``--labels``);
    ``coords`` says how the exporter scales box coordinates (None: ONNX pixels).
    """
    coords = coords or BoxCoords(raw=False, end2end=False, source="ONNX exports of YOLO heads give input pixels")
    task = meta.task if meta else None
    if task and task not in ("detect", "classify"):
        shapes = ", ".join(describe_tensor(o) for o in outputs)
        raise ModelError(f"{path}: task {task!r} (outputs {shapes}): edgerun decodes detect and classify models so far")
    if len(outputs) == 4 and any(len(o.shape) == 3 and o.shape[-1] == 4 for o in outputs):
        return DecoderChoice("tflite_ssd", {}, "4 outputs with a [1, N, 4] boxes tensor: SSD post-process")
    if len(outputs) != 1:
        shapes = ", ".join(describe_tensor(o) for o in outputs)
        raise ModelError(f"{path}: cannot tell a decoder from {len(outputs)} outputs {shapes}; pass --decoder")
    out = outputs[0]
    shape = tuple(int(d) for d in out.shape)
    if meta is not None and meta.end2end:
        return _end2end(out, meta, num_names, path, coords, "end2end in the file's metadata")
    yolo_params = ultralytics_yolo_params(meta, coords.raw)
    if task == "classify" or (len(shape) >= 1 and all(d == 1 for d in shape[:-1]) and len(shape) <= 2):
        source = "task 'classify' in the file's metadata" if task == "classify" else f"output {describe_tensor(out)}"
        return DecoderChoice("classify", {}, source)
    if len(shape) != 3 or shape[0] != 1:
        raise ModelError(f"{path}: output {describe_tensor(out)} is no head edgerun decodes; pass --decoder")
    a, b = shape[1], shape[2]
    yolov5_rows = {3 * n for n in grid_sizes_v8(*input_hw)} if input_hw else set()
    if b == END_TO_END_VALUES and meta is None and a not in yolov5_rows and (not num_names or a != 4 + num_names):
        return _end2end(out, meta, num_names, path, coords, "[1, K, 6] rows: x1, y1, x2, y2, score, class")
    if num_names:
        params = dict(yolo_params, num_classes=num_names)
        where = f"output {describe_tensor(out)} with {num_names} classes"
        if a == 4 + num_names:
            return DecoderChoice("yolov8", params, f"{where}: [1, 4 + C, N], YOLOv8/11")
        if b == 4 + num_names:
            return DecoderChoice("yolov8", params, f"{where}: [1, N, 4 + C], YOLOv8/11 transposed")
        if b == 5 + num_names:
            return DecoderChoice("yolov5", params, f"{where}: [1, N, 5 + C], YOLOv5")
        raise ModelError(
            f"{path}: output {describe_tensor(out)} fits no head of {num_names} classes "
            f"(YOLOv8 [1, {4 + num_names}, N], YOLOv5 [1, N, {5 + num_names}], end-to-end [1, K, 6])"
        )
    if a < b:
        return DecoderChoice("yolov8", yolo_params, f"output {describe_tensor(out)}: [1, 4 + C, N], YOLOv8/11")
    return DecoderChoice("yolov5", yolo_params, f"output {describe_tensor(out)}: [1, N, 5 + C], YOLOv5")


@dataclass(frozen=True)
class BoxCoords:
    """How an exporter scales box coordinates: normalised to the input (True) or input pixels (False)."""

    raw: bool  # raw heads ([1, 4 + C, N], [1, N, 5 + C])
    end2end: bool | str  # end-to-end heads ([1, K, 6]); "auto" where the exporter's scale is not known
    source: str


def _end2end(
    out: TensorSpec, meta: UltralyticsMetadata | None, num_names: int | None, path: Path, coords: BoxCoords, why: str
) -> DecoderChoice:
    shape = tuple(int(d) for d in out.shape)
    if len(shape) != 3 or shape[0] != 1 or shape[2] != END_TO_END_VALUES:
        raise ModelError(
            f"{path}: output {describe_tensor(out)} is not the [1, K, 6] rows of an end-to-end head ({why})"
        )
    if not num_names:
        raise ModelError(
            f"{path}: output {describe_tensor(out)} is an end-to-end head whose class count is not in the tensor "
            "and the file names no classes: pass --labels FILE"
        )
    params: dict[str, Any] = {"num_classes": num_names}
    if meta is not None:
        params.update(
            min_score_thresh=ULTRALYTICS_CONF, max_results=min(ULTRALYTICS_MAX_DET, shape[1]), normalized=coords.end2end
        )
    return DecoderChoice("yolo_end2end", params, f"output {describe_tensor(out)}: end-to-end head ({why})")


def ultralytics_yolo_params(meta: UltralyticsMetadata | None, normalized: bool = False) -> dict[str, Any]:
    """YOLO decoder params that match Ultralytics' own predictor, for its exports; none otherwise."""
    if meta is None:
        return {}
    return {
        "min_score_thresh": ULTRALYTICS_CONF,
        "iou_thresh": YOLOV5_IOU if meta.exporter == "YOLOv5" else ULTRALYTICS_IOU,
        "max_results": YOLOV5_MAX_DET if meta.exporter == "YOLOv5" else ULTRALYTICS_MAX_DET,
        "normalized": normalized,
    }


def _preprocess(
    input_spec: TensorSpec, meta: UltralyticsMetadata | None, model_metadata: ModelMetadata | None = None
) -> tuple[dict[str, Any], str]:
    """The bundle's ``[preprocess]`` and where it came from.

    mean/std describe the float values the model was trained on; a quantised input
    adds its own scale and zero point on top (the preprocessor folds both together).
    """
    normalisation = _metadata_normalisation(model_metadata)
    if meta is None and normalisation is not None:
        return _task_library_preprocess(input_spec, normalisation)
    if np.issubdtype(input_spec.dtype, np.integer) and not input_spec.quantised:
        spec = {"resize": "letterbox", "color": "rgb", "mean": [0.0] * 3, "std": [1.0] * 3, "pad_value": 0}
        return spec, f"{np.dtype(input_spec.dtype)} input without quantisation: raw pixels"
    spec = {"resize": "letterbox", "color": "rgb", "mean": [0.0] * 3, "std": [255.0] * 3, "pad_value": 0}
    quantised = ""
    if input_spec.quantised:
        quantised = (
            f"; {np.dtype(input_spec.dtype)} input: the tensor's scale {input_spec.scale:.6g} and zero point "
            f"{input_spec.zero_point} on top"
        )
    if meta is not None:
        spec["pad_value"] = ULTRALYTICS_PAD
        return spec, f"{meta.exporter} convention: letterbox, RGB, /255, pad 114{quantised}"
    return (
        spec,
        f"default (the file does not say): letterbox, RGB, /255; check it against how it was trained{quantised}",
    )


def _metadata_normalisation(model_metadata: ModelMetadata | None) -> TensorMetadata | None:
    """The image input's metadata when it states NormalizationOptions (one value, or one per channel)."""
    if model_metadata is None or len(model_metadata.inputs) != 1:
        return None
    tensor = model_metadata.inputs[0]
    if not tensor.mean or not tensor.std or len(tensor.mean) not in (1, 3) or len(tensor.std) not in (1, 3):
        return None
    if any(s == 0 for s in tensor.std):
        return None
    return tensor


def _per_channel(values: list[float]) -> list[float]:
    return [float(v) for v in values] * 3 if len(values) == 1 else [float(v) for v in values]


def _task_library_preprocess(input_spec: TensorSpec, tensor: TensorMetadata) -> tuple[dict[str, Any], str]:
    """``[preprocess]`` as the TFLite Task Library feeds a model with TFLite Model Metadata.

    Its ImagePreprocessor resizes the whole frame to the input (no letterbox) and
    applies NormalizationOptions to a float input only: a uint8 input takes the raw
    pixels (its Stats then say [0, 255]), the quantisation standing for the
    normalisation. Raw pixels are written as mean = zero point, std = 1 / scale, so
    the preprocessor's quantisation step gives back the pixel itself.
    """
    mean, std = _per_channel(tensor.mean or []), _per_channel(tensor.std or [])
    stated = f"NormalizationOptions mean {_show_floats(tensor.mean)} std {_show_floats(tensor.std)}"
    stats = ""
    if tensor.stats_min and tensor.stats_max:
        stats = f", Stats [{_show_floats(tensor.stats_min)}, {_show_floats(tensor.stats_max)}]"
    where = f"input {tensor.name!r} in the file's TFLite Model Metadata"
    spec: dict[str, Any] = {"resize": "stretch", "color": "rgb", "pad_value": 0}
    if np.issubdtype(input_spec.dtype, np.integer):
        if input_spec.quantised:
            spec.update(mean=[float(input_spec.zero_point)] * 3, std=[1.0 / input_spec.scale] * 3)
        else:
            spec.update(mean=[0.0] * 3, std=[1.0] * 3)
        return spec, (
            f"{np.dtype(input_spec.dtype)} input: raw pixels, stretched, as the TFLite Task Library feeds it "
            f"({stated}{stats} of {where} are the float model's)"
        )
    spec.update(mean=mean, std=std)
    return spec, f"{stated}{stats} of {where}; stretched, as the TFLite Task Library feeds it"


def _mediapipe_preprocess(
    known: mediapipe.KnownDetector | None, model_metadata: ModelMetadata | None
) -> tuple[dict[str, Any], str]:
    """A MediaPipe detector's input: its graph's ImageToTensorCalculator, else its metadata's normalisation."""
    tensor = _metadata_normalisation(model_metadata)
    if known is not None:
        spec = dict(known.preprocess)
        low, high = -spec["mean"][0] / spec["std"][0], (255.0 - spec["mean"][0]) / spec["std"][0]
        where = f"MediaPipe's {known.graph} (ImageToTensorCalculator): letterbox, RGB, [{low:g}, {high:g}], pad 0"
        if tensor is not None:
            same = _per_channel(tensor.mean or []) == spec["mean"] and _per_channel(tensor.std or []) == spec["std"]
            where += (
                "; the file's TFLite Model Metadata says the same"
                if same
                else (
                    f"; the file's TFLite Model Metadata says mean {_show_floats(tensor.mean)} std "
                    f"{_show_floats(tensor.std)}, not used (MediaPipe copies metadata between models)"
                )
            )
        return spec, where
    if tensor is not None:
        spec = {**mediapipe.PREPROCESS, "mean": _per_channel(tensor.mean or []), "std": _per_channel(tensor.std or [])}
        return spec, (
            f"NormalizationOptions mean {_show_floats(tensor.mean)} std {_show_floats(tensor.std)} of input "
            f"{tensor.name!r} in the file's TFLite Model Metadata; letterbox, RGB, pad 0 as MediaPipe feeds detectors"
        )
    return dict(
        mediapipe.PREPROCESS
    ), "MediaPipe's convention (ImageToTensorCalculator): letterbox, RGB, [-1, 1], pad 0"


def _describe_model_metadata(metadata: ModelMetadata) -> str:
    parts = [repr(metadata.name) if metadata.name else "unnamed"]
    if metadata.version:
        parts.append(metadata.version)
    for tensor in metadata.inputs:
        said = [f"input {tensor.name!r}"]
        if tensor.color_space:
            said.append(tensor.color_space)
        if tensor.mean and tensor.std:
            said.append(f"mean {_show_floats(tensor.mean)} std {_show_floats(tensor.std)}")
        if tensor.stats_min and tensor.stats_max:
            said.append(f"range [{_show_floats(tensor.stats_min)}, {_show_floats(tensor.stats_max)}]")
        parts.append(" ".join(said))
    for tensor in metadata.outputs:
        label_file = tensor.label_file()
        if label_file:
            parts.append(f"output {tensor.name!r} labels {label_file}")
    return "; ".join(parts)


def _show_floats(values: list[float] | None) -> str:
    if not values:
        return "-"
    shown = [f"{v:g}" for v in values]
    return shown[0] if len(set(shown)) == 1 else "[" + ", ".join(shown) + "]"


# -- the import ------------------------------------------------------------------------------


@dataclass
class _Source:
    """What one model file gave: the variants to write, its metadata and how its heads scale boxes."""

    variants: dict[str, str]  # engine key -> file name in the bundle
    write: dict[str, Any]  # file name -> callable(path) that writes it
    cpu_key: str  # the variant the decoder is built on (its tensors)
    meta: UltralyticsMetadata | None
    origin: str
    coords: BoxCoords
    labels: list[str] | None = None  # labels the file carries outside Ultralytics metadata
    labels_source: str = ""
    model_name: str | None = None  # the name in its TFLite Model Metadata
    model_metadata: ModelMetadata | None = None  # its TFLite Model Metadata


def import_model(
    model_file: str | Path,
    out_dir: str | Path,
    *,
    labels_file: str | Path | None = None,
    decoder: str | None = None,
    input_size: str | None = None,
    name: str | None = None,
    version: int | None = None,
    cpu_model: str | Path | None = None,
    decoder_params: str | Path | None = None,
) -> ImportResult:
    """Write a bundle for ``model_file`` into ``out_dir`` and say what was inferred from where.

    ``cpu_model`` is the CPU .tflite beside an Edge TPU-compiled ``model_file``
    (the node's fallback when the TPU is gone). ``decoder_params`` is a TOML file
    of decoder params laid over the inferred ones (what a MediaPipe detector of
    an unknown layout needs: the anchor options of its graph).
    """
    path = Path(model_file)
    out = Path(out_dir)
    if not path.is_file():
        raise ModelError(f"{path}: not found")
    suffix = path.suffix.lower()
    if suffix not in (".onnx", ".tflite"):
        raise ModelError(f"{path}: model import reads .onnx and .tflite files")
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ModelError(f"--out {out}: exists and is not a bundle; give an empty or new directory")
    if cpu_model is not None and suffix != ".tflite":
        raise ModelError(f"--cpu-model is for an Edge TPU-compiled .tflite; {path} is {suffix}")
    settings: list[Setting] = []
    extra_params = _read_decoder_params(Path(decoder_params)) if decoder_params is not None else None
    if suffix == ".onnx":
        source = _read_onnx(path, input_size, settings)
    else:
        if input_size:
            raise ModelError(f"--input: {path} is a TFLite file, whose input size is fixed; leave --input out")
        source = _read_tflite(path, None if cpu_model is None else Path(cpu_model), settings)
    meta, origin = source.meta, source.origin

    if labels_file is not None:
        labels = read_labels(Path(labels_file))
        labels_source = f"--labels {labels_file}"
    elif meta is not None and meta.names:
        labels, labels_source = meta.names, f"names in the {origin}"
    elif source.labels:
        labels, labels_source = source.labels, source.labels_source
    else:
        labels, labels_source = [], "none in the file; pass --labels FILE"

    bundle_name = name or re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem) or "model"
    tmp = out.with_name(f".{out.name}.import")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for file_name, write in source.write.items():
            write(tmp / file_name)
        from edgerun.engines.base import engine_class

        engine = engine_class(source.cpu_key)(tmp / source.variants[source.cpu_key], EngineOptions(device="cpu"))
        try:
            input_spec, output_specs = engine.input_spec, engine.output_specs
        finally:
            engine.close()
        # The class count: the file's own names where it has them (so --labels one short is caught), else the labels.
        if suffix == ".tflite":
            source.coords = _tflite_coords(meta, input_spec.layout)
        if suffix == ".tflite" and len(input_spec.shape) == 4:
            in_h, in_w = input_spec.image_hw
            dims = ", ".join(str(d) for d in input_spec.shape)
            settings.insert(
                0, Setting("input", f"{in_w}x{in_h}", f"input {input_spec.name!r} [{dims}], fixed in the file")
            )
        if source.model_metadata is not None:
            settings.insert(
                1, Setting("metadata", _describe_model_metadata(source.model_metadata), "TFLite Model Metadata")
            )
        num_names = len(meta.names) if meta is not None and meta.names else (len(labels) or None)
        head = mediapipe.anchor_head(output_specs) if meta is None else None
        mediapipe_known: mediapipe.KnownDetector | None = None
        if decoder == "mediapipe_ssd" or (decoder is None and head is not None):
            choice, mediapipe_known = _mediapipe_choice(
                input_spec, output_specs, head, path, source.model_name, extra_params, decoder
            )
            if not labels and mediapipe_known is not None:
                labels, labels_source = list(mediapipe_known.labels), f"the class of the {mediapipe_known.title}"
        elif decoder:
            params = ultralytics_yolo_params(meta, source.coords.raw) if decoder in ("yolov5", "yolov8") else {}
            if decoder == "yolo_end2end":
                params = _end2end(output_specs[0], meta, num_names, path, source.coords, "--decoder").params
            choice = DecoderChoice(decoder, params, "--decoder")
        else:
            hw = input_spec.image_hw if len(input_spec.shape) == 4 else None
            choice = choose_decoder(output_specs, meta, num_names, path, source.coords, hw)
        if extra_params and choice.kind != "mediapipe_ssd":
            choice.params = {**choice.params, **extra_params}
        # Build the decoder on the real tensors: a bundle written here is one the node accepts.
        built = decoder_class(choice.kind)(dict(choice.params), input_spec, output_specs)
        built.check_labels(labels)
        settings.append(Setting("decoder.kind", choice.kind, choice.source))
        if choice.kind == "mediapipe_ssd":
            if extra_params is not None:
                where = f"--decoder-params {decoder_params}"
            else:
                where = f"MediaPipe's {mediapipe_known.graph if mediapipe_known else 'graph'} options"
            settings.append(Setting("decoder.params", _mediapipe_summary(choice.params), where))
        for key, value in choice.params.items():
            if choice.kind == "mediapipe_ssd":
                break  # some 30 anchor options, summarised above; model.toml has them all
            if extra_params and key in extra_params:
                where = f"--decoder-params {decoder_params}"
            elif choice.source == "--decoder":
                where = "--decoder with Ultralytics' predictor defaults"
            elif key == "num_classes":
                where = "the count of the labels, which pins the head's layout"
            elif key == "normalized":
                where = source.coords.source
            elif meta is not None and meta.exporter == "YOLOv5":
                where = "YOLOv5's detect.py defaults"
            else:
                where = "Ultralytics' predictor defaults (ultralytics/cfg/default.yaml)"
            settings.append(Setting(f"decoder.params.{key}", value, where))
        task = "classification" if choice.kind == "classify" else "detection"
        settings.append(Setting("task", task, f"decoder {choice.kind}"))
        settings.append(Setting("labels", labels, labels_source))
        if choice.kind == "mediapipe_ssd" and np.issubdtype(input_spec.dtype, np.floating):
            preprocess, pre_source = _mediapipe_preprocess(mediapipe_known, source.model_metadata)
        else:
            preprocess, pre_source = _preprocess(input_spec, meta, source.model_metadata)
        settings.append(Setting("preprocess", _describe_preprocess(preprocess), pre_source))
        for key, file_name in source.variants.items():
            role = "the CPU fallback" if key == source.cpu_key else "the accelerator variant"
            settings.append(Setting(f"variants.{key}", file_name, f"{role}: {ENGINE_NAMES.get(key, key)}"))
        provenance = {"file": path.name, "sha256": file_sha256(path)}
        if mediapipe_known is not None:
            provenance["recognised"] = mediapipe_known.title
        if meta is not None:
            provenance["exporter"] = origin
            if meta.license:
                provenance["license"] = meta.license
        manifest: dict[str, Any] = {
            "name": bundle_name,
            "version": 1 if version is None else version,
            "task": task,
            "labels": labels,
            "description": (meta.description.strip() if meta else "")
            or (f"{mediapipe_known.title}, imported from {path.name}" if mediapipe_known else "")
            or f"imported from {path.name}",
            "preprocess": preprocess,
            "decoder": {"kind": choice.kind, "params": choice.params},
            "variants": source.variants,
            "provenance": provenance,
        }
        write_manifest(tmp, manifest)
        load_bundle(tmp)  # the same checks as the node's
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ImportResult(load_bundle(out), settings)


ENGINE_NAMES = {
    "onnx": "ONNX Runtime's CPU provider",
    "tflite": "LiteRT on the CPU",
    "edgetpu": "LiteRT with the Edge TPU delegate",
}


def _read_onnx(path: Path, input_size: str | None, settings: list[Setting]) -> _Source:
    onnx = _onnx()
    try:
        model = onnx.load(str(path))
    except Exception as err:  # protobuf's DecodeError and onnx's own
        raise ModelError(f"{path}: not an ONNX model ({type(err).__name__}: {str(err)[:80]})") from None
    props = {p.key: p.value for p in model.metadata_props}
    meta = parse_ultralytics_metadata(props)
    origin = " ".join(filter(None, [meta.exporter, meta.version, "metadata"])) if meta else ""

    graph_input = _graph_inputs(model, path)[0]
    in_dims = _dims(graph_input)
    if input_size:
        input_hw = parse_size(input_size)
        size_source = "--input"
    elif meta is not None and meta.imgsz:
        input_hw, size_source = meta.imgsz, f"imgsz in the {origin}"
    elif len(in_dims) == 4 and all(isinstance(d, int) for d in in_dims[1:]):
        nchw = _is_nchw(in_dims)
        input_hw = (int(in_dims[2]), int(in_dims[3])) if nchw else (int(in_dims[1]), int(in_dims[2]))
        size_source = f"input {graph_input.name!r} {_show_dims(in_dims)}"
    else:
        raise ModelError(
            f"{path}: input {graph_input.name!r} {_show_dims(in_dims)} has dynamic dimensions and the file "
            "states no size: pass --input WxH"
        )
    model, changed = fix_onnx_input(model, input_hw, path)
    settings.append(Setting("input", f"{input_hw[1]}x{input_hw[0]}", size_source))
    for change in changed:
        settings.append(Setting("fixed", change, "onnx.tools.update_model_dims, checked by onnx.checker"))
    coords = BoxCoords(raw=False, end2end=False, source="ONNX exports of YOLO heads give input pixels")
    return _Source(
        variants={"onnx": ONNX_VARIANT},
        write={ONNX_VARIANT: lambda target: onnx.save(model, str(target))},
        cpu_key="onnx",
        meta=meta,
        origin=origin,
        coords=coords,
    )


def _read_tflite(path: Path, cpu_model: Path | None, settings: list[Setting]) -> _Source:
    from edgerun.models import tflite_meta

    info = tflite_meta.read(path)
    cpu_info = info
    if info.edgetpu:
        if cpu_model is None:
            raise ModelError(
                f"{path}: compiled for the Edge TPU (it holds {tflite_meta.EDGETPU_OP}), which cannot run without "
                "one: give the CPU .tflite it was compiled from with --cpu-model FILE (the node's fallback)"
            )
        cpu_info = tflite_meta.read(cpu_model)
        if cpu_info.edgetpu:
            raise ModelError(f"--cpu-model {cpu_model}: is Edge TPU-compiled too; give the CPU .tflite")
        mismatch = tflite_meta.signature_mismatch(path, cpu_model)
        if mismatch is not None:
            raise ModelError(
                f"--cpu-model {cpu_model}: is not the model {path.name} was compiled from: it has {mismatch}"
            )
        variants = {"tflite": TFLITE_VARIANT, "edgetpu": EDGETPU_VARIANT}
        write = {TFLITE_VARIANT: _copier(cpu_model), EDGETPU_VARIANT: _copier(path)}
        settings.append(Setting("edgetpu", path.name, f"{tflite_meta.EDGETPU_OP} in the file"))
        # The compiled file's metadata is the exporter's; the CPU file's stands in when the compiler dropped it.
        props = info.ultralytics or cpu_info.ultralytics
        file_labels = info.labels or cpu_info.labels
        labels_where = info.labels_source if info.labels else cpu_info.labels_source
    else:
        if cpu_model is not None:
            raise ModelError(
                f"--cpu-model: {path} is not Edge TPU-compiled (no {tflite_meta.EDGETPU_OP}); leave it out"
            )
        variants = {"tflite": TFLITE_VARIANT}
        write = {TFLITE_VARIANT: _copier(path)}
        props, file_labels, labels_where = info.ultralytics, info.labels, info.labels_source
    meta = parse_ultralytics_metadata(props) if props else None
    origin = " ".join(filter(None, ["Ultralytics", meta.version, "metadata.json"])) if meta else ""
    coords = _tflite_coords(meta, "")  # settled once the engine has read the input's layout
    return _Source(
        variants=variants,
        write=write,
        cpu_key="tflite",
        meta=meta,
        origin=origin,
        coords=coords,
        labels=file_labels,
        labels_source=labels_where,
        model_name=info.model_name,
        model_metadata=info.metadata or (cpu_info.metadata if info.edgetpu else None),
    )


TFLITE_VARIANT = "model.tflite"
EDGETPU_VARIANT = "model_edgetpu.tflite"


def _tflite_coords(meta: UltralyticsMetadata | None, layout: str) -> BoxCoords:
    """How an Ultralytics TFLite export scales boxes, from the converter that wrote it.

    litert_torch (Ultralytics >= 8.4.83, ``format=litert``) keeps PyTorch's NCHW
    input; onnx2tf (older releases, and ``saved_model``/``edgetpu`` still) writes
    NHWC. Raw heads are normalised to the input by both (``_NormalizeCoords``,
    ``tf_wrapper``); litert_torch leaves end-to-end heads in input pixels
    (``ultralytics/utils/export/litert.py``). For onnx2tf's end-to-end heads the
    importer does not claim a scale and leaves ``normalized`` at "auto".
    """
    if meta is None:
        return BoxCoords(raw=True, end2end="auto", source="TFLite heads without metadata: decided by magnitude")
    litert = layout == "NCHW"
    path = "litert_torch: NCHW input" if litert else "onnx2tf: NHWC input"
    return BoxCoords(
        raw=True,
        end2end=False if litert else "auto",
        source=f"Ultralytics {meta.version or '?'} TFLite ({path}): raw heads normalised, end-to-end "
        + ("in input pixels" if litert else "decided by magnitude"),
    )


def _read_decoder_params(path: Path) -> dict[str, Any]:
    """``--decoder-params FILE``: a TOML table of decoder params (MediaPipe option names for mediapipe_ssd)."""
    from edgerun.tomlfile import load_toml

    table = load_toml(path, ModelError, "--decoder-params file")
    if not table:
        raise ModelError(f"--decoder-params {path}: holds no params")
    return table


def _mediapipe_choice(
    input_spec: TensorSpec,
    outputs: list[TensorSpec],
    head: mediapipe.AnchorHead | None,
    path: Path,
    model_name: str | None,
    extra_params: dict[str, Any] | None,
    decoder: str | None,
) -> tuple[DecoderChoice, mediapipe.KnownDetector | None]:
    """A MediaPipe anchor head: its known detector's params, or ``--decoder-params``; refused otherwise.

    The anchors are not in the file, so a layout that is not a known detector's
    cannot be guessed: the user gives the options of the model's MediaPipe graph.
    """
    shapes = " + ".join(describe_tensor(o) for o in outputs)
    if head is None:
        raise ModelError(
            f"{path}: outputs {shapes} are no MediaPipe anchor head (regressors [1, N, 4 + 2K] and scores [1, N, 1])"
        )
    hw = input_spec.image_hw if len(input_spec.shape) == 4 else (0, 0)
    known = mediapipe.known_detector(hw, head)
    named = f"; its metadata calls it {model_name!r}" if model_name else ""
    if extra_params is not None:
        params = {**(known.params if known else {}), **extra_params}
        return DecoderChoice("mediapipe_ssd", params, f"--decoder-params over outputs {shapes}{named}"), known
    if known is None:
        flag = "" if decoder else "--decoder mediapipe_ssd "
        raise ModelError(
            f"{path}: outputs {shapes} at input {hw[1]}x{hw[0]} are a MediaPipe-style anchor head of no known "
            f"detector ({mediapipe.describe_known()}); the anchors are not in the file: pass {flag}"
            "--decoder-params FILE with the SsdAnchorsCalculator and TensorsToDetectionsCalculator options of its "
            "MediaPipe graph"
        )
    why = f"{known.title}: input {hw[1]}x{hw[0]}, outputs {shapes}, the anchors of MediaPipe's {known.graph}" + named
    return DecoderChoice("mediapipe_ssd", dict(known.params), why), known


def _mediapipe_summary(params: dict[str, Any]) -> str:
    keys = ("num_boxes", "num_coords", "num_keypoints", "strides", "min_score_thresh", "min_suppression_threshold")
    return ", ".join(f"{k} {params[k]}" for k in keys if k in params) + f" ({len(params)} options in model.toml)"


def _copier(source: Path) -> Any:
    return lambda target: shutil.copyfile(source, target)


def _describe_preprocess(spec: dict[str, Any]) -> str:
    return f"{spec['resize']} {spec['color']} mean {spec['mean']} std {spec['std']} pad {spec['pad_value']}"

"""``edgerun model import``: a complete bundle from what a model file says about itself.

A user arrives with a detector exported elsewhere, most often by Ultralytics.
The file already says what it is: Ultralytics writes ``names``, ``imgsz``,
``stride``, ``task`` and ``end2end`` into the ONNX ``metadata_props`` (values
are Python literals, read here with ``ast.literal_eval``), and the output
shapes tell the head apart (YOLOv5 ``[1, N, 5 + C]``, YOLOv8/11
``[1, 4 + C, N]``, SSD post-process, classification). The importer reads all
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
from edgerun.engines.base import EngineOptions, TensorSpec
from edgerun.errors import ModelError
from edgerun.models.bundle import MANIFEST, ModelBundle, file_sha256, load_bundle, write_manifest

# Ultralytics trains and predicts on letterboxed RGB scaled to [0, 1], padded with grey 114
# (ultralytics/data/augment.py LetterBox), and its predictor keeps boxes at conf >= 0.25, NMS IoU 0.7,
# at most 300 detections (ultralytics/cfg/default.yaml).
ULTRALYTICS_PAD = 114
ULTRALYTICS_CONF = 0.25
ULTRALYTICS_IOU = 0.7
ULTRALYTICS_MAX_DET = 300

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
    description: str = ""
    version: str = ""
    license: str = ""


def parse_ultralytics_metadata(props: dict[str, str]) -> UltralyticsMetadata | None:
    """Ultralytics metadata from ONNX ``metadata_props`` (None when the file has none).

    The exporter writes ``str(value)`` for each key, so ``names`` is a dict literal
    ``{0: 'person', ...}`` and ``imgsz`` a list literal ``[640, 640]``.
    """
    if props.get("author") != "Ultralytics" and not {"names", "imgsz"} <= props.keys():
        return None
    meta = UltralyticsMetadata(
        description=props.get("description", ""),
        version=props.get("version", ""),
        license=props.get("license", ""),
        task=props.get("task") or None,
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


def _literal(props: dict[str, str], key: str) -> Any:
    try:
        return ast.literal_eval(props[key])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ModelError(f"metadata {key}: not a Python literal: {props[key][:80]!r}") from None


def _names(value: Any) -> list[str]:
    """Class names indexed 0..C-1 from a ``{index: name}`` dict or a list."""
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
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
    outputs: list[TensorSpec], meta: UltralyticsMetadata | None, num_names: int | None, path: Path
) -> DecoderChoice:
    """The decoder kind for these outputs, from their shapes and the file's metadata; refuses the rest."""
    task = meta.task if meta else None
    if task and task not in ("detect", "classify"):
        shapes = ", ".join(describe_tensor(o) for o in outputs)
        raise ModelError(f"{path}: task {task!r} (outputs {shapes}): edgerun decodes detect and classify models so far")
    if meta is not None and meta.end2end:
        raise ModelError(
            f"{path}: output {describe_tensor(outputs[0])} is an end-to-end head (end2end in the file's metadata: "
            "boxes after the model's own NMS), which no decoder reads yet; export the raw head (end2end=False)"
        )
    yolo_params = ultralytics_yolo_params(meta)
    if len(outputs) == 4 and any(len(o.shape) == 3 and o.shape[-1] == 4 for o in outputs):
        return DecoderChoice("tflite_ssd", {}, "4 outputs with a [1, N, 4] boxes tensor: SSD post-process")
    if len(outputs) != 1:
        shapes = ", ".join(describe_tensor(o) for o in outputs)
        raise ModelError(f"{path}: cannot tell a decoder from {len(outputs)} outputs {shapes}; pass --decoder")
    out = outputs[0]
    shape = tuple(int(d) for d in out.shape)
    if task == "classify" or (len(shape) >= 1 and all(d == 1 for d in shape[:-1]) and len(shape) <= 2):
        source = "task 'classify' in the file's metadata" if task == "classify" else f"output {describe_tensor(out)}"
        return DecoderChoice("classify", {}, source)
    if len(shape) != 3 or shape[0] != 1:
        raise ModelError(f"{path}: output {describe_tensor(out)} is no head edgerun decodes; pass --decoder")
    a, b = shape[1], shape[2]
    if num_names:
        params = dict(yolo_params, num_classes=num_names)
        where = f"output {describe_tensor(out)} with the {num_names} classes of the file's names"
        if a == 4 + num_names:
            return DecoderChoice("yolov8", params, f"{where}: [1, 4 + C, N], YOLOv8/11")
        if b == 4 + num_names:
            return DecoderChoice("yolov8", params, f"{where}: [1, N, 4 + C], YOLOv8/11 transposed")
        if b == 5 + num_names:
            return DecoderChoice("yolov5", params, f"{where}: [1, N, 5 + C], YOLOv5")
        raise ModelError(
            f"{path}: output {describe_tensor(out)} fits no head of {num_names} classes "
            f"(YOLOv8 [1, {4 + num_names}, N], YOLOv5 [1, N, {5 + num_names}])"
        )
    if b == 6 and a < b * 100:
        raise ModelError(
            f"{path}: output {describe_tensor(out)} looks like an end-to-end head (boxes, score, class after NMS), "
            "which no decoder reads yet"
        )
    if a < b:
        return DecoderChoice("yolov8", yolo_params, f"output {describe_tensor(out)}: [1, 4 + C, N], YOLOv8/11")
    return DecoderChoice("yolov5", yolo_params, f"output {describe_tensor(out)}: [1, N, 5 + C], YOLOv5")


def ultralytics_yolo_params(meta: UltralyticsMetadata | None) -> dict[str, Any]:
    """YOLO decoder params that match Ultralytics' own predictor, for its exports; none otherwise."""
    if meta is None:
        return {}
    return {
        "min_score_thresh": ULTRALYTICS_CONF,
        "iou_thresh": ULTRALYTICS_IOU,
        "max_results": ULTRALYTICS_MAX_DET,
        "normalized": False,  # Ultralytics' ONNX heads give boxes in input pixels
    }


def _preprocess(input_spec: TensorSpec, meta: UltralyticsMetadata | None) -> tuple[dict[str, Any], str]:
    """The bundle's ``[preprocess]`` and where it came from.

    mean/std describe the float values the model was trained on; a quantised input
    adds its own scale and zero point on top (the preprocessor folds both together).
    """
    if np.issubdtype(input_spec.dtype, np.integer) and not input_spec.quantised:
        spec = {"resize": "letterbox", "color": "rgb", "mean": [0.0] * 3, "std": [1.0] * 3, "pad_value": 0}
        return spec, f"{np.dtype(input_spec.dtype)} input without quantisation: raw pixels"
    spec = {"resize": "letterbox", "color": "rgb", "mean": [0.0] * 3, "std": [255.0] * 3, "pad_value": 0}
    if meta is not None:
        spec["pad_value"] = ULTRALYTICS_PAD
        return spec, "Ultralytics convention: letterbox, RGB, /255, pad 114"
    return spec, "default (the file does not say): letterbox, RGB, /255; check it against how it was trained"


# -- the import ------------------------------------------------------------------------------


def import_model(
    model_file: str | Path,
    out_dir: str | Path,
    *,
    labels_file: str | Path | None = None,
    decoder: str | None = None,
    input_size: str | None = None,
    name: str | None = None,
    version: int | None = None,
) -> ImportResult:
    """Write a bundle for ``model_file`` into ``out_dir`` and say what was inferred from where."""
    path = Path(model_file)
    out = Path(out_dir)
    if not path.is_file():
        raise ModelError(f"{path}: not found")
    if path.suffix.lower() != ".onnx":
        raise ModelError(f"{path}: model import reads .onnx files so far (TFLite import is still to come)")
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ModelError(f"--out {out}: exists and is not a bundle; give an empty or new directory")
    settings: list[Setting] = []
    onnx = _onnx()
    try:
        model = onnx.load(str(path))
    except Exception as err:  # protobuf's DecodeError and onnx's own
        raise ModelError(f"{path}: not an ONNX model ({type(err).__name__}: {str(err)[:80]})") from None
    props = {p.key: p.value for p in model.metadata_props}
    meta = parse_ultralytics_metadata(props)
    origin = " ".join(filter(None, ["Ultralytics", meta.version, "metadata"])) if meta else ""

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

    if labels_file is not None:
        labels = read_labels(Path(labels_file))
        labels_source = f"--labels {labels_file}"
    elif meta is not None and meta.names:
        labels, labels_source = meta.names, f"names in the {origin}"
    else:
        labels, labels_source = [], "none in the file; pass --labels FILE"

    bundle_name = name or re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem) or "model"
    tmp = out.with_name(f".{out.name}.import")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        onnx.save(model, str(tmp / ONNX_VARIANT))
        from edgerun.engines.onnx import OnnxEngine

        engine = OnnxEngine(tmp / ONNX_VARIANT, EngineOptions(device="cpu"))
        try:
            input_spec, output_specs = engine.input_spec, engine.output_specs
        finally:
            engine.close()
        num_names = len(meta.names) if meta is not None and meta.names else None
        if decoder:
            params = ultralytics_yolo_params(meta) if decoder in ("yolov5", "yolov8") else {}
            choice = DecoderChoice(decoder, params, "--decoder")
        else:
            choice = choose_decoder(output_specs, meta, num_names, path)
        # Build the decoder on the real tensors: a bundle written here is one the node accepts.
        built = decoder_class(choice.kind)(dict(choice.params), input_spec, output_specs)
        built.check_labels(labels)
        settings.append(Setting("decoder.kind", choice.kind, choice.source))
        for key, value in choice.params.items():
            if choice.source == "--decoder":
                where = "--decoder with Ultralytics' predictor defaults"
            elif key == "num_classes":
                where = "the count of names, which pins the head's layout"
            else:
                where = "Ultralytics' predictor defaults (ultralytics/cfg/default.yaml)"
            settings.append(Setting(f"decoder.params.{key}", value, where))
        task = "classification" if choice.kind == "classify" else "detection"
        settings.append(Setting("task", task, f"decoder {choice.kind}"))
        settings.append(Setting("labels", labels, labels_source))
        preprocess, pre_source = _preprocess(input_spec, meta)
        settings.append(Setting("preprocess", _describe_preprocess(preprocess), pre_source))
        settings.append(Setting("variants.onnx", ONNX_VARIANT, "the CPU fallback: ONNX Runtime's CPU provider"))
        provenance = {"file": path.name, "sha256": file_sha256(path)}
        if meta is not None:
            provenance["exporter"] = origin
            if meta.license:
                provenance["license"] = meta.license
        manifest: dict[str, Any] = {
            "name": bundle_name,
            "version": 1 if version is None else version,
            "task": task,
            "labels": labels,
            "description": (meta.description.strip() if meta else "") or f"imported from {path.name}",
            "preprocess": preprocess,
            "decoder": {"kind": choice.kind, "params": choice.params},
            "variants": {"onnx": ONNX_VARIANT},
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


def _describe_preprocess(spec: dict[str, Any]) -> str:
    return f"{spec['resize']} {spec['color']} mean {spec['mean']} std {spec['std']} pad {spec['pad_value']}"

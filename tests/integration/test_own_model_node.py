"""A real node (``edgerun run``, a subprocess) serving a bundle written by ``edgerun model import``.

The bundle is the real Ultralytics YOLOv8n export from a PyPI wheel, imported
with no flags; ONNX-only, so the node serves on ONNX Runtime's CPU provider as
its fallback. What the node publishes for scikit-image photos is compared box
by box with the independent reference of ``tests/unit/test_model_import.py``
(onnxruntime + the documented YOLOv8 decoding, no edgerun), and a bundle whose
labels do not match the head is refused at start with one line before
anything is published. A trained int8 classifier (TF Hub's EfficientNet-Lite0
from a pinned sdist, with TFLite Model Metadata) imported with no flags is
served too, its top five compared with LiteRT called directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import tomli_w

from edgerun.models.importer import import_model
from tests.integration.jsonl import read_records
from tests.unit.test_model_import import IMGSZ, iou, photo_rgb, reference_detect


def run_node(tmp_path: Path, bundle: Path, images: Path) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """``edgerun run`` over ``images`` once (a finite source ends the run); returns the process and its batches."""
    out = tmp_path / "detections.jsonl"
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        f"""[node]
id = "own-model"
[source]
kind = "images"
path = "{images}"
fps = 0
loop = false
[pipeline]
policy = "block"
[model]
bundle = "{bundle}"
[sinks.jsonl]
path = "{out}"
[service]
http_enabled = false
"""
    )
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(cfg)], capture_output=True, text=True, timeout=120
    )
    batches = [r for r in read_records(out) if r["schema"] == "edgerun.detections/1"]
    return proc, batches


def test_the_node_publishes_what_the_reference_decoder_finds(yolov8n_onnx, tmp_path):
    bundle = import_model(yolov8n_onnx, tmp_path / "bundle").bundle
    images = tmp_path / "images"
    images.mkdir()
    rgb = photo_rgb("composed_page")
    cv2.imwrite(str(images / "page.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, bundle.root, images)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(batches) == 1
    batch = batches[0]
    assert batch["frame"]["source"] == str(images / "page.png")
    assert (batch["frame"]["width"], batch["frame"]["height"]) == (rgb.shape[1], rgb.shape[0])
    assert batch["model"]["name"] == bundle.name
    published = batch["detections"]
    boxes, scores, classes = reference_detect(yolov8n_onnx, rgb, IMGSZ)
    assert len(published) == len(boxes) >= 3
    for box, score, cls in zip(boxes, scores, classes):
        same = [d for d in published if d["class_id"] == cls]
        best = max(same, key=lambda d: iou(box, np.array(d["box"])))
        assert best["label"] == bundle.labels[cls]
        assert iou(box, np.array(best["box"])) >= 0.99  # the payload rounds boxes to 0.1 px
        assert abs(best["score"] - float(score)) <= 1e-3


def test_labels_that_do_not_match_the_head_stop_the_node_before_it_publishes(yolov8n_onnx, tmp_path):
    import tomllib

    # Imported, then edited by hand to one label short, as a user might.
    bundle = import_model(yolov8n_onnx, tmp_path / "bundle").bundle
    manifest = tomllib.loads((bundle.root / "model.toml").read_text())
    manifest["labels"] = manifest["labels"][:-1]
    (bundle.root / "model.toml").write_text(tomli_w.dumps(manifest))
    images = tmp_path / "images"
    images.mkdir()
    cv2.imwrite(str(images / "coffee.png"), cv2.cvtColor(photo_rgb("coffee"), cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, bundle.root, images)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("edgerun: error: labels: 10 labels for the 11 classes of yolov8 output 'output0' [1, 15, 21504]"), (
        proc.stderr[-2000:]
    )
    assert "Traceback" not in proc.stderr
    assert batches == []


def scaled_end_to_end_onnx(path: Path, factor: float) -> Path:
    """A real ONNX model (input [1, 3, 32, 32]) whose [1, 300, 6] rows are its input pixels times ``factor``.

    With factor 10 its scores reach 10 and its class column 10: what a head
    without its sigmoid, or one exported for more classes, hands the node.
    """
    import onnx
    from onnx import TensorProto, helper

    inits = [
        helper.make_tensor("factor", TensorProto.FLOAT, [], [factor]),
        helper.make_tensor("start", TensorProto.INT64, [1], [0]),
        helper.make_tensor("end", TensorProto.INT64, [1], [1800]),
        helper.make_tensor("axis", TensorProto.INT64, [1], [1]),
        helper.make_tensor("shape", TensorProto.INT64, [3], [1, 300, 6]),
    ]
    nodes = [
        helper.make_node("Flatten", ["images"], ["flat"], axis=1),
        helper.make_node("Mul", ["flat", "factor"], ["scaled"]),
        helper.make_node("Slice", ["scaled", "start", "end", "axis"], ["rows"]),
        helper.make_node("Reshape", ["rows", "shape"], ["output0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scaled_end_to_end",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 300, 6])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_a_model_whose_output_is_no_valid_payload_is_counted_per_frame_and_never_published(tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("drone\nperson\n")
    model = scaled_end_to_end_onnx(tmp_path / "scaled.onnx", 10.0)
    bundle = import_model(model, tmp_path / "bundle", labels_file=labels).bundle
    assert bundle.manifest.decoder.kind == "yolo_end2end"
    images = tmp_path / "images"
    images.mkdir()
    for name in ("astronaut", "coffee"):
        cv2.imwrite(str(images / f"{name}.png"), cv2.cvtColor(photo_rgb(name), cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, bundle.root, images)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert batches == []  # neither frame became a payload
    assert proc.stderr.count("model output not publishable") == 1, proc.stderr[-2000:]  # logged once, counted twice
    assert "outside [0, 1]" in proc.stderr
    assert '"decode/bad_output": 2' in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("file", ["yolo26t_float32.tflite", "yolov8t_int8.tflite", "yolov5t.onnx"])
def test_the_node_publishes_what_the_reference_finds_on_the_exporters_own_files(file, tmp_path):
    """Ultralytics' LiteRT files (NCHW input; an end-to-end head, an int8 raw head) and YOLOv5's own ONNX
    head, imported with no flags and served by a real node, against tests/unit/test_model_exports.py's
    independent reference on the same photo."""
    from tests.unit.test_model_exports import EXPORTS, EXPORTS_DIR, small_photo
    from tests.unit.test_model_exports import iou as box_iou
    from tests.unit.test_model_exports import reference_detect as reference_export

    export = next(e for e in EXPORTS if e.file == file)
    bundle = import_model(EXPORTS_DIR / file, tmp_path / "bundle").bundle
    images = tmp_path / "images"
    images.mkdir()
    rgb = small_photo("coffee")
    cv2.imwrite(str(images / "coffee.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, bundle.root, images)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(batches) == 1 and batches[0]["model"]["engine"] == bundle.cpu_engine
    published = batches[0]["detections"]
    boxes, scores, classes = reference_export(export, rgb)
    assert len(published) == len(boxes) >= 1
    for box, score, cls in zip(boxes, scores, classes):
        same = [d for d in published if d["class_id"] == cls]
        best = max(same, key=lambda d: (round(box_iou(box, np.array(d["box"])), 2), -abs(d["score"] - score)))
        assert best["label"] == bundle.labels[cls]
        assert box_iou(box, np.array(best["box"])) >= 0.95, (file, box, best)  # the payload rounds to 0.1 px
        assert abs(best["score"] - float(score)) <= 1e-3


def test_rows_that_are_no_box_are_dropped_and_counted_and_the_frame_goes_on(tmp_path):
    """The untrained YOLO26 export's head gives rows with x2 < x1 on the astronaut (27 above 0.25): the node
    publishes the frame without them and counts them in its summary."""
    from tests.unit.test_model_exports import EXPORTS_DIR, small_photo

    bundle = import_model(EXPORTS_DIR / "yolo26t_float32.tflite", tmp_path / "bundle").bundle
    images = tmp_path / "images"
    images.mkdir()
    cv2.imwrite(str(images / "astronaut.png"), cv2.cvtColor(small_photo("astronaut"), cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, bundle.root, images)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stderr.split("stopped: ", 1)[1].splitlines()[0])
    assert summary["decoder_rows_dropped"].get("inverted_box", 0) >= 1, summary
    assert len(batches) == 1 and batches[0]["detections"], "the frame goes on with its other rows"
    for d in batches[0]["detections"]:
        x1, y1, x2, y2 = d["box"]
        assert x2 >= x1 and y2 >= y1, d


def test_the_node_classifies_photos_as_the_reference_does(efficientnet_lite0_tflite, tmp_path):
    """The int8 EfficientNet-Lite0 (an sdist's TF Hub file) imported with no flags, served by a real node."""
    from tests.unit.test_model_import_classify import PHOTOS, reference_classify

    bundle = import_model(efficientnet_lite0_tflite, tmp_path / "bundle").bundle
    images = tmp_path / "images"
    images.mkdir()
    # One size for every photo (the images source gives a folder's frames the first image's size), at which
    # the node's resize and the reference's are one bilinear resize each (shrunk by less than 2x on one axis).
    names = ["chelsea", "coffee", "rocket"]
    photos = {n: cv2.resize(photo_rgb(n), (450, 300), interpolation=cv2.INTER_AREA) for n in names}
    for name, rgb in photos.items():
        cv2.imwrite(str(images / f"{name}.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    proc, batches = run_node(tmp_path, bundle.root, images)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(Path(b["frame"]["source"]).stem for b in batches) == sorted(names)
    for batch in batches:
        name = Path(batch["frame"]["source"]).stem
        order, probs, labels = reference_classify(efficientnet_lite0_tflite, photos[name])
        published = batch["detections"]
        assert [d["label"] for d in published] == [labels[i] for i in order[:5]]
        assert published[0]["label"] == PHOTOS[name]
        for d, i in zip(published, order[:5]):
            assert d["class_id"] == i and abs(d["score"] - probs[i]) <= 1e-3
            assert d["box"] == [0.0, 0.0, 450.0, 300.0]  # a class covers the whole frame

"""Remake the small detector exports in this folder with the exporters themselves.

Each file is an UNTRAINED model built from a scaled-down copy of the
exporter's own YAML (tiny width and depth, 3 classes, 128x128 input) and
written by the exporter's own export code, so edgerun's importer and
decoders see the exact tensor layout and metadata each exporter writes.
The weights are random (seeded). An untrained network passes almost no
signal (every box scores 0.5 whatever the photo), so batch-norm statistics
are measured on scikit-image photos and the class biases shifted so that a
few dozen boxes a photo pass the 0.25 threshold (``wake_up``). The boxes mean
nothing; tests compare edgerun against an independent decoder on the same
input.

Run from the repository root, in a venv OUTSIDE the repository (never a
dependency of ``make test``), made like this on x86_64 Python 3.11:

    python3.11 -m venv /work/exporters-venv
    /work/exporters-venv/bin/pip install torch==2.14.1 torchvision==0.29.1
    /work/exporters-venv/bin/pip install ultralytics==8.4.190 onnx==1.22.0 onnxruntime==1.32.0 \
        onnxslim==0.1.98 scikit-image
    # LiteRT (.tflite): Ultralytics >= 8.4.83 converts PyTorch straight to LiteRT (no TensorFlow, no onnx2tf)
    /work/exporters-venv/bin/pip install litert-torch==0.10.0 ai-edge-quantizer==0.10.0
    # Ultralytics' onnx2tf path (format=saved_model), for yolo26t_onnx2tf_float32.tflite
    /work/exporters-venv/bin/pip install tensorflow-cpu==2.19.0 tf_keras==2.19.0 onnx2tf==1.28.8 \
        sng4onnx==2.0.1 onnx_graphsurgeon==0.6.1
    # YOLOv5's own [1, N, 5 + C] head; yolov5 7.0 still imports pkg_resources (setuptools < 70)
    /work/exporters-venv/bin/pip install --no-deps yolov5==7.0.14
    /work/exporters-venv/bin/pip install pandas seaborn gitpython thop fire
    /work/exporters-venv/bin/pip install --no-deps setuptools==69.5.1
    YOLO_OFFLINE=1 /work/exporters-venv/bin/python tests/data/exports/make_exports.py [--only NAME ...]

The versions that wrote the committed files are in ``EXPORTS.txt`` beside
this script (it rewrites the file on every run). Files differ byte for byte
between runs (Ultralytics stamps the export date into its metadata); the
weights do not (fixed seed, fixed photos).

Ultralytics 8.4.190 writes an end-to-end head ([1, 300, 6]) only with
``nms=False``; left at its default it exports the raw one-to-many head even
for YOLOv10 and YOLO26. Its LiteRT int8 export keeps float32 input and output
tensors (int8 inside), and refuses end-to-end heads in int8.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMGSZ = 128  # 16x16 + 8x8 + 4x4 = 336 grid cells: at least 300, so end-to-end heads keep all 300 rows
NAMES = {0: "drone", 1: "person", 2: "car"}
SEED = 0
# [depth, width, max_channels]: at most 8 channels, one repeat per block.
TINY_SCALE = [0.10, 0.03125, 256]


def tiny_yaml(source: Path, out: Path) -> Path:
    """The exporter's own model YAML with 3 classes and the tiny scale only."""
    import yaml

    spec = yaml.safe_load(source.read_text())
    spec["nc"] = len(NAMES)
    spec["scales"] = {"t": TINY_SCALE}
    # One box bin, as YOLO26's own YAML has: the 16-bin DFL box branch would be most of the file. The bins are
    # decoded inside the graph, so the output layout is the same either way.
    spec["reg_max"] = 1
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


CALIBRATION_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "page")
# After the shift below, this share of the class logits on the calibration photos scores above the
# predictor's 0.25 threshold: a few dozen boxes a photo, with scores spread from 0 to 1.
PASSING_SHARE = 0.02
THRESHOLD_LOGIT = -1.0986  # logit(0.25)
OBJECTNESS_LOGIT = 2.944  # logit(0.95)


def calibration_batch():
    """The calibration photos, squashed to IMGSZ (RGB, [0, 1], NCHW) as a float tensor."""
    import cv2
    import numpy as np
    import torch
    from skimage import data

    images = []
    for name in CALIBRATION_PHOTOS:
        rgb = getattr(data, name)()
        rgb = np.repeat(rgb[:, :, None], 3, axis=2) if rgb.ndim == 2 else rgb[:, :, :3]
        images.append(cv2.resize(rgb, (IMGSZ, IMGSZ), interpolation=cv2.INTER_AREA))
    return torch.from_numpy(np.stack(images).transpose(0, 3, 1, 2).astype(np.float32) / 255.0)


def wake_up(model, class_convs) -> None:
    """Give an untrained network signal, then place its class logits around the threshold.

    Freshly initialised, every layer shrinks the signal, so the head sees near
    zeros and scores every box 0.5 whatever the photo (boxes and scores that
    do not depend on the input test nothing). Batch-norm statistics measured on
    real photos (what training does first) restore unit-variance features;
    then each class conv's bias is shifted so that PASSING_SHARE of its logits
    on those photos pass the threshold. The weights stay random.
    """
    import torch

    batch = calibration_batch()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # a plain average over the calibration batch
    model.train()
    with torch.no_grad():
        model(batch)
    model.eval()
    for conv, channels in class_convs:
        seen = []
        hook = conv.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out.detach()))
        with torch.no_grad():
            model(batch)
        hook.remove()
        logits = seen[0].transpose(0, 1).reshape(conv.out_channels, -1)  # per output channel
        shift = torch.quantile(logits, 1 - PASSING_SHARE, dim=1) - THRESHOLD_LOGIT
        with torch.no_grad():
            for c, target in channels.items():
                # "class": the top PASSING_SHARE pass 0.25; "objectness": most boxes look like objects (0.95).
                conv.bias[c] -= shift[c] if target == "class" else torch.median(logits[c]) - OBJECTNESS_LOGIT


def ultralytics_class_convs(model) -> list:
    """The last conv of every class branch (one-to-many and one-to-one), all its channels class logits."""
    head = model.model[-1]
    convs = [branch[-1] for name in ("cv3", "one2one_cv3") for branch in (getattr(head, name, None) or [])]
    return [(conv, dict.fromkeys(range(conv.out_channels), "class")) for conv in convs]


def ultralytics_model(yaml_name: str, workdir: Path):
    import torch
    import ultralytics
    from ultralytics import YOLO

    root = Path(ultralytics.__file__).parent / "cfg" / "models"
    source = next(root.rglob(yaml_name))
    torch.manual_seed(SEED)
    # The scale letter is read from the file name (yolov8t.yaml -> scale 't').
    stem = source.stem + "t" if source.stem[-1].isdigit() else source.stem.rstrip("nsmlx") + "t"
    model = YOLO(str(tiny_yaml(source, workdir / f"{stem}.yaml")), task="detect")
    model.model.names = dict(NAMES)
    wake_up(model.model, ultralytics_class_convs(model.model))
    return model


def export_ultralytics(
    name: str, yaml_name: str, formats: list[str], workdir: Path, end2end: bool = False
) -> list[Path]:
    made = []
    for fmt in formats:
        model = ultralytics_model(yaml_name, workdir)
        kwargs = {"format": "onnx" if fmt == "onnx" else "litert", "imgsz": IMGSZ, "batch": 1}
        if end2end:
            kwargs["nms"] = False  # Ultralytics 8.4 keeps the one-to-one (NMS-free) branch only when asked
        if fmt == "onnx":
            kwargs.update(opset=17, simplify=True, dynamic=False)
        if fmt == "int8":
            kwargs.update(quantize=8, data=str(calibration_data(workdir)), fraction=1.0)
        written = Path(model.export(**kwargs))
        suffix = {"onnx": ".onnx", "float32": "_float32.tflite", "int8": "_int8.tflite"}[fmt]
        if written.is_dir():  # TFLite exports land in a *_saved_model folder
            pick = "_full_integer_quant.tflite" if fmt == "int8" else "_float32.tflite"
            written = next(p for p in written.glob("*.tflite") if p.name.endswith(pick))
        target = HERE / f"{name}{suffix}"
        shutil.copyfile(written, target)
        made.append(target)
    return made


def calibration_data(workdir: Path) -> Path:
    """A detection dataset of the calibration photos for int8 calibration (no downloads; the labels are dummies)."""
    import cv2
    import numpy as np
    from skimage import data

    root = workdir / "calib"
    if (root / "data.yaml").is_file():
        return root / "data.yaml"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for photo in CALIBRATION_PHOTOS:
            rgb = getattr(data, photo)()
            rgb = np.repeat(rgb[:, :, None], 3, axis=2) if rgb.ndim == 2 else rgb[:, :, :3]
            cv2.imwrite(str(root / "images" / split / f"{photo}.jpg"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
            (root / "labels" / split / f"{photo}.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    names = "\n".join(f"  {k}: {v}" for k, v in NAMES.items())
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return root / "data.yaml"


def export_yolov5(workdir: Path) -> list[Path]:
    """YOLOv5's own head ([1, N, 5 + C], 3 anchors a cell) through the yolov5 package's export_onnx."""
    import torch
    import yolov5
    from yolov5.export import export_onnx
    from yolov5.models.yolo import Detect, Model

    source = Path(yolov5.__file__).parent / "models" / "yolov5n.yaml"
    import yaml

    spec = yaml.safe_load(source.read_text())
    spec["nc"] = len(NAMES)
    spec["depth_multiple"], spec["width_multiple"] = TINY_SCALE[0], TINY_SCALE[1]
    torch.manual_seed(SEED)
    model = Model(spec, ch=3, nc=len(NAMES)).eval()
    model.names = [NAMES[i] for i in range(len(NAMES))]
    head = model.model[-1]
    assert isinstance(head, Detect)
    # Per anchor: x, y, w, h, objectness, class logits.
    roles = {4: "objectness"} | {5 + k: "class" for k in range(len(NAMES))}
    per_conv = {a * head.no + i: role for a in range(head.na) for i, role in roles.items()}
    wake_up(model, [(conv, per_conv) for conv in head.m])
    head.inplace, head.export = True, True
    model.stride = model.model[-1].stride
    im = torch.zeros(1, 3, IMGSZ, IMGSZ)
    for _ in range(2):
        model(im)  # dry runs, as yolov5's export does
    target = HERE / "yolov5t.onnx"
    # yolov5 7.0 was written for the TorchScript-based exporter (torch < 2.9's default); torch 2.14 would take
    # the dynamo exporter, which cannot write the opset 12 that yolov5 asks for.
    torch.onnx.export = functools.partial(torch.onnx.export, dynamo=False)
    f, _ = export_onnx(model, im, workdir / "yolov5t.pt", opset=12, dynamic=False, simplify=False)
    shutil.copyfile(f, target)
    return [target]


def export_onnx2tf(workdir: Path) -> list[Path]:
    """YOLO26's end-to-end head through Ultralytics' other TFLite path: ONNX -> onnx2tf -> TFLite (NHWC input).

    ``format=saved_model`` (and ``edgetpu``) still convert with onnx2tf, as every
    TFLite export before 8.4.83 did, and Ultralytics appends its metadata.json to
    the .tflite files it writes there. onnx2tf's int8 calibration sample is a
    download; this float32 export does not use it, so a placeholder stands in.
    """
    import numpy as np

    np.save(workdir / "calibration_image_sample_data_20x128x128x3_float32.npy", np.zeros((20, 128, 128, 3), np.float32))
    model = ultralytics_model("yolo26.yaml", workdir)
    folder = Path(model.export(format="saved_model", imgsz=IMGSZ, batch=1, nms=False))
    target = HERE / "yolo26t_onnx2tf_float32.tflite"
    shutil.copyfile(next(folder.glob("*_float32.tflite")), target)
    return [target]


def export_int8_io(workdir: Path) -> list[Path]:
    """yolov8t_float32.tflite with int8 input and output tensors, by ai-edge-quantizer (Ultralytics' quantizer).

    Ultralytics' own int8 export keeps float32 at the edges (it overrides the
    recipe's input and output to NO_QUANTIZE); this is the same static int8
    recipe without that override, so the file has the int8 input with a scale
    and zero point that a microcontroller or NPU export has. Its metadata.json
    is carried over from the float file.
    """
    import io
    import zipfile

    from ai_edge_quantizer import quantizer, recipe

    source = (HERE / "yolov8t_float32.tflite").read_bytes()
    flatbuffer = source[: source.rfind(b"PK\x03\x04")]  # the model without Ultralytics' appended zip
    metadata = zipfile.ZipFile(io.BytesIO(source)).read("metadata.json")
    plain = workdir / "yolov8t_float32_plain.tflite"
    plain.write_bytes(flatbuffer)
    qt = quantizer.Quantizer(str(plain))
    qt.load_quantization_recipe(recipe.static_wi8_ai8())
    batch = calibration_batch().numpy()
    result = qt.calibrate({"serving_default": [{"args_0": batch[i : i + 1]} for i in range(len(batch))]})
    target = HERE / "yolov8t_int8io.tflite"
    qt.quantize(calibration_result=result).export_model(str(target), overwrite=True)
    with zipfile.ZipFile(target, "a", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("metadata.json", metadata)
    return [target]


JOBS = {
    "yolov8t": lambda w: export_ultralytics("yolov8t", "yolov8.yaml", ["onnx", "float32", "int8"], w),
    "yolo11t": lambda w: export_ultralytics("yolo11t", "yolo11.yaml", ["onnx", "float32"], w),
    "yolov10t": lambda w: export_ultralytics("yolov10t", "yolov10n.yaml", ["onnx"], w, end2end=True),
    "yolo26t": lambda w: export_ultralytics("yolo26t", "yolo26.yaml", ["onnx", "float32"], w, end2end=True),
    "yolov5t": export_yolov5,
    "yolov8t_int8io": export_int8_io,  # after yolov8t: made from its float32 file
    "yolo26t_onnx2tf": export_onnx2tf,
}


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    lines = []
    dists = ("torch", "ultralytics", "onnx", "onnxruntime", "onnxslim", "litert-torch", "ai-edge-quantizer")
    for dist in (*dists, "ai-edge-litert", "tensorflow", "tensorflow-cpu", "tf_keras", "onnx2tf", "yolov5", "numpy"):
        try:
            lines.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            pass
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(JOBS), help="remake only these")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        import os

        os.chdir(workdir)  # exporters write beside the model file and into the working directory
        for name in args.only or JOBS:
            for path in JOBS[name](workdir):
                print(f"{path.relative_to(HERE)}  {path.stat().st_size} bytes")
    (HERE / "EXPORTS.txt").write_text(versions())
    return 0


if __name__ == "__main__":
    sys.exit(main())

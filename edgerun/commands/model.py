"""``edgerun model import | inspect | fetch-demo | fetch-sample | build-trt | check-mcu``: model bundles."""

from __future__ import annotations

import argparse
import json
from typing import Any

from edgerun.commands.options import log_level, setup_logging


def cmd_model_inspect(args: argparse.Namespace) -> int:
    from edgerun.models.inspect import inspect_bundle

    report = inspect_bundle(args.path, engine_key=args.engine, image=args.image)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from edgerun.models.inspect import format_report

        print(format_report(report))
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    from edgerun.models.importer import import_model

    result = import_model(
        args.model,
        args.out,
        labels_file=args.labels,
        decoder=args.decoder,
        input_size=args.input,
        name=args.name,
        version=args.version,
        cpu_model=args.cpu_model,
        decoder_params=args.decoder_params,
    )
    print(result.format())
    return 0


def cmd_model_check_mcu(args: argparse.Namespace) -> int:
    from edgerun.mcu.check import check_mcu_model, parse_size

    result = check_mcu_model(args.model, parse_size(args.arena))
    print(json.dumps(result.to_json(), indent=2) if args.json else result.format())
    return 0 if result.ok else 1


def cmd_model_fetch_demo(args: argparse.Namespace) -> int:
    from edgerun.models.demo import DEMO_MODELS, ensure_demo_bundle
    from edgerun.progress import phases

    names = args.names or list(DEMO_MODELS)
    with phases("fetch-demo", len(names)) as progress:
        for name in names:
            progress.step(f"{name} (download, verify, convert)")
            bundle = ensure_demo_bundle(name)
            print(f"{bundle.name} v{bundle.version}: {bundle.root}")
    return 0


def cmd_model_fetch_sample(args: argparse.Namespace) -> int:
    from edgerun.models.samples import SAMPLE_MODELS, ensure_sample_model
    from edgerun.progress import phases

    names = args.names or list(SAMPLE_MODELS)
    with phases("fetch-sample", len(names)) as progress:
        for name in names:
            progress.step(f"{name} (download, verify)")
            print(f"{name}: {ensure_sample_model(name)}")
    return 0


def cmd_model_build_trt(args: argparse.Namespace) -> int:

    setup_logging(log_level(args, "warning"))
    from edgerun.models.build_trt import build_trt_command

    result = build_trt_command(
        args.source,
        args.out,
        fp16=not args.no_fp16,
        calibration=args.int8,
        workspace_mb=args.workspace_mb,
        device=args.device,
    )
    print(json.dumps(result, indent=2))
    return 0


def add_model_parser(sub: Any) -> None:
    model = sub.add_parser("model", help="model bundles")
    msub = model.add_subparsers(dest="model_command", required=True)
    imp = msub.add_parser("import", help="write a bundle from what a model file says about itself (.onnx, .tflite)")
    imp.add_argument("model", help="the model file (an Ultralytics or other ONNX or TFLite export)")
    imp.add_argument("--out", required=True, help="the bundle directory to write")
    imp.add_argument("--labels", default=None, help="class names, one a line (default: from the file's metadata)")
    imp.add_argument(
        "--decoder",
        default=None,
        help="yolov5, yolov8, yolo_end2end, tflite_ssd, mediapipe_ssd, classify (default: from the outputs)",
    )
    imp.add_argument(
        "--cpu-model",
        default=None,
        metavar="FILE",
        help="the CPU .tflite an Edge TPU-compiled model was compiled from (its fallback)",
    )
    imp.add_argument(
        "--decoder-params",
        default=None,
        metavar="FILE",
        help="TOML table of decoder params over the inferred ones (a MediaPipe detector's anchor options)",
    )
    imp.add_argument("--input", default=None, metavar="WxH", help="input size for dynamic dims (default: imgsz)")
    imp.add_argument("--name", default=None, help="bundle name (default: the file's stem)")
    imp.add_argument("--version", type=int, default=None, help="bundle version (default 1)")
    imp.set_defaults(func=cmd_model_import)
    inspect = msub.add_parser("inspect", help="print tensors, quantisation, decoder and a warm-up timing")
    inspect.add_argument("path", help="bundle directory or .tar")
    inspect.add_argument("--engine", default=None, help="the variant to run (default: the CPU fallback)")
    inspect.add_argument("--image", default=None, help="a photo to run through the bundle, printing detections")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=cmd_model_inspect)
    fetch = msub.add_parser("fetch-demo", help="download and build the demo bundles into .cache/")
    fetch.add_argument("names", nargs="*", help="blazeface_short, pose_detector (default: both)")
    fetch.set_defaults(func=cmd_model_fetch_demo)
    sample = msub.add_parser("fetch-sample", help="download real model files others exported (for model import)")
    sample.add_argument(
        "names", nargs="*", help="yolov8n_doclaynet, blazeface_short_mediapipe, palm_detection_lite (default: all)"
    )
    sample.set_defaults(func=cmd_model_fetch_sample)
    build = msub.add_parser("build-trt", help="build a TensorRT engine from an ONNX model or a bundle (on the GPU)")
    build.add_argument("source", help="a .onnx file, or a bundle directory (gets model.engine as its tensorrt variant)")
    build.add_argument("--out", default=None, help="engine file (default: beside the ONNX model / in the bundle)")
    build.add_argument("--no-fp16", action="store_true", help="FP32 only")
    build.add_argument("--int8", metavar="CALIB", default=None, help="INT8 too, calibrated on a .npy or image folder")
    build.add_argument("--workspace-mb", type=int, default=1024, help="TensorRT builder workspace")
    build.add_argument("--device", default="", help="cuda:N (default cuda:0)")
    build.set_defaults(func=cmd_model_build_trt)
    check_mcu = msub.add_parser("check-mcu", help="run a .tflite in TFLite Micro: ops supported, arena, invoke time")
    check_mcu.add_argument("model", help="a .tflite model (int8 for most MCUs)")
    check_mcu.add_argument("--arena", default="64k", help="the MCU's tensor arena budget (default 64k)")
    check_mcu.add_argument("--json", action="store_true", help="print the result as JSON")
    check_mcu.set_defaults(func=cmd_model_check_mcu)

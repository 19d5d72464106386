"""``edgerun run | demo | bench | doctor | model | listen | ota``.

User-facing failures (``EdgerunError``) print one line and exit non-zero;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from edgerun import __version__
from edgerun.errors import EdgerunError


def _setup_logging(level: str) -> None:
    from edgerun.service.journal import JournalHandler, journal_stream_is

    if journal_stream_is(sys.stderr):  # under systemd: structured journal entries instead of plain lines
        logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[JournalHandler()])
        return
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_run(args: argparse.Namespace) -> int:
    from edgerun.config import load_config

    if args.test_control:  # HIL test mode: the control socket and its fault-injectable engine key
        from edgerun.testing.control import register_test_engines

        register_test_engines()
    cfg = load_config(args.config)  # before the heavy imports: a bad config fails fast
    if cfg.sinks.dds.enabled:
        from edgerun.sinks.dds import require_cyclonedds

        require_cyclonedds()  # an optional extra ([dds]): say so before any model is loaded
    _setup_logging(args.log_level or cfg.node.log_level)
    from edgerun.node import run_node

    return run_node(cfg, seconds=args.seconds, test_control=args.test_control)


def cmd_demo(args: argparse.Namespace) -> int:
    import asyncio

    from edgerun.demo import demo_config, format_summary, run_demo

    _setup_logging(args.log_level or "warning")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    live = sys.stderr.isatty() and not args.quiet
    with contextlib.ExitStack() as stack:
        mqtt = args.mqtt
        if args.local_broker and mqtt is None:
            mqtt = _start_local_broker(stack)
        if args.drones > 1:
            return _swarm_demo(args, out_dir, mqtt, live)
        cfg = demo_config(out_dir, model=args.model, mqtt=mqtt, dds=args.dds, http_port=args.http_port, fps=args.fps)
        try:
            import uvloop

            summary = uvloop.run(run_demo(cfg, args.seconds, out_dir, live))
        except ImportError:
            summary = asyncio.run(run_demo(cfg, args.seconds, out_dir, live))
    print(format_summary(summary))
    print(f"wrote {out_dir}/detections.jsonl, snapshot.png, contact_sheet.png, summary.json")
    return 0


def _swarm_demo(args: argparse.Namespace, out_dir: Path, mqtt: str | None, live: bool) -> int:
    from edgerun.demo_swarm import format_swarm_summary, run_swarm_demo

    summary = run_swarm_demo(
        out_dir, args.drones, args.seconds, model=args.model, mqtt=mqtt, dds=args.dds, fps=args.fps, live=live
    )
    print(format_swarm_summary(summary))
    print(f"wrote {out_dir}/drone-*/detections.jsonl, {out_dir}/snapshot.png, {out_dir}/summary.json")
    failed = {name: code for name, code in summary["exit_codes"].items() if code != 0}
    if failed:
        print(f"edgerun demo: drones exited with {failed}; see {out_dir}/drone-*/node.log", file=sys.stderr)
        return 1
    return 0


def _start_local_broker(stack: contextlib.ExitStack) -> str | None:
    """A private mosquitto on a free loopback port for the demo, or None (with a note) when there is none."""
    from edgerun.sinks.mosquitto import run_mosquitto

    try:
        broker = stack.enter_context(run_mosquitto())
    except Exception as err:  # the demo goes on without MQTT
        print(f"edgerun demo: no local MQTT broker ({err}); publishing to JSON Lines only", file=sys.stderr)
        return None
    print(f"edgerun demo: MQTT on 127.0.0.1:{broker.port} (edgerun listen --mqtt 127.0.0.1:{broker.port})")
    return f"127.0.0.1:{broker.port}"


def cmd_bench(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level or "warning")
    if args.sinks:
        from edgerun.bench.pipeline import run_sinks_bench_command

        return run_sinks_bench_command(args)
    if args.ota:
        from edgerun.bench.ota import run_ota_bench_command

        return run_ota_bench_command(args)
    if args.failover:
        from edgerun.bench.failover import run_failover_bench_command

        return run_failover_bench_command(args)
    from edgerun.bench.pipeline import run_bench_command

    return run_bench_command(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from edgerun.doctor import run_doctor

    return run_doctor(as_json=args.json)


def cmd_model_inspect(args: argparse.Namespace) -> int:
    from edgerun.models.inspect import inspect_bundle

    report = inspect_bundle(args.path, engine_key=args.engine)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from edgerun.models.inspect import format_report

        print(format_report(report))
    return 0


def cmd_model_check_mcu(args: argparse.Namespace) -> int:
    from edgerun.mcu.check import check_mcu_model, parse_size

    result = check_mcu_model(args.model, parse_size(args.arena))
    print(json.dumps(result.to_json(), indent=2) if args.json else result.format())
    return 0 if result.ok else 1


def cmd_model_fetch_demo(args: argparse.Namespace) -> int:
    from edgerun.models.demo import DEMO_MODELS, ensure_demo_bundle

    for name in args.names or list(DEMO_MODELS):
        bundle = ensure_demo_bundle(name)
        print(f"{bundle.name} v{bundle.version}: {bundle.root}")
    return 0


def cmd_model_build_trt(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level or "warning")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgerun", description="Edge inference runtime for devices and swarms.")
    parser.add_argument("--version", action="version", version=f"edgerun {__version__}")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the node from a config file")
    run.add_argument("-c", "--config", required=True, help="node TOML config (see deploy/node.example.toml)")
    run.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    run.add_argument(
        "--test-control", nargs="?", const="edgerun-control.sock", default=None, metavar="SOCKET",
        help="HIL test mode: fault-injection unix socket (default ./edgerun-control.sock); never in production",
    )
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="replayed flight with BlazeFace, scored against ground truth")
    demo.add_argument("--seconds", type=float, default=20.0)
    demo.add_argument("--out", default="out/demo", help="directory for detections.jsonl, snapshot.png, summary.json")
    demo.add_argument("--model", default=None, help="model bundle (default: BlazeFace short range)")
    demo.add_argument("--fps", type=float, default=None, help="replay rate (default 15; 0 = as fast as possible)")
    demo.add_argument("--mqtt", metavar="HOST:PORT", default=None, help="also publish to this MQTT broker")
    demo.add_argument("--dds", action="store_true", help="also publish on DDS (loopback only)")
    demo.add_argument(
        "--local-broker", action="store_true", help="publish to a private mosquitto started on a free loopback port"
    )
    demo.add_argument("--http-port", type=int, default=None, help="HTTP port (default: any free port)")
    demo.add_argument("--quiet", action="store_true", help="no live status line")
    demo.add_argument(
        "--drones", type=int, default=3, help="node processes flying the scene as a swarm (1: one node in-process)"
    )
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="measure throughput, latency and memory; writes JSON")
    bench.add_argument("--model", default=None, help="bundle path or demo name (default: blazeface_short)")
    bench.add_argument("--seconds", type=float, default=8.0, help="length of each timed phase")
    bench.add_argument("--soak-seconds", type=float, default=None, help="pipeline phase length for rss_growth_mb")
    bench.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    bench.add_argument("--table", nargs="*", default=None, metavar="JSON", help="print a table of result files")
    bench.add_argument(
        "--failover", action="store_true", help="measure failover instead: time to fallback detections, frames lost"
    )
    bench.add_argument(
        "--sinks", action="store_true", help="measure the sinks instead: MQTT/DDS throughput, latency, pipeline cost"
    )
    bench.add_argument("--repeats", type=int, default=10, help="--failover: injected faults of each kind")
    bench.add_argument(
        "--ota", action="store_true", help="measure OTA updates instead: delta sizes, apply time, swap gap"
    )
    bench.set_defaults(func=cmd_bench)

    doctor = sub.add_parser("doctor", help="list inference back ends and whether they work here")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=cmd_doctor)

    model = sub.add_parser("model", help="model bundles")
    msub = model.add_subparsers(dest="model_command", required=True)
    inspect = msub.add_parser("inspect", help="print tensors, quantisation, decoder and a warm-up timing")
    inspect.add_argument("path", help="bundle directory or .tar")
    inspect.add_argument("--engine", default="tflite")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=cmd_model_inspect)
    fetch = msub.add_parser("fetch-demo", help="download and build the demo bundles into .cache/")
    fetch.add_argument("names", nargs="*", help="blazeface_short, pose_detector (default: both)")
    fetch.set_defaults(func=cmd_model_fetch_demo)
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

    try:
        from edgerun.commands.listen import add_listen_parser
    except ImportError:
        pass
    else:
        add_listen_parser(sub)
    from edgerun.commands.ota import add_ota_parser

    add_ota_parser(sub)
    from edgerun.commands.station import add_station_parser

    add_station_parser(sub)
    from edgerun.commands.fleet import add_fleet_parser

    add_fleet_parser(sub)
    from edgerun.commands.swarm import add_swarm_parser

    add_swarm_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except EdgerunError as err:
        print(f"edgerun: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


def _entry() -> Any:
    sys.exit(main())


if __name__ == "__main__":
    _entry()

"""``edgerun demo``: a replayed flight with BlazeFace, one node or a swarm, scored against ground truth."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from edgerun.commands.options import log_level, setup_logging


def cmd_demo(args: argparse.Namespace) -> int:
    import asyncio

    from edgerun.demo import demo_config, format_summary, run_demo

    setup_logging(log_level(args, "warning"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # -q (the shared quiet option, either position) also drops the live status line
    live = sys.stderr.isatty() and not (getattr(args, "quiet", 0) or getattr(args, "quiet_after", 0))
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
        for name in failed:  # the reason, where the drone left one: its log's last line
            lines = (out_dir / name / "node.log").read_text(errors="replace").strip().splitlines()
            if lines:
                print(f"  {name}: {lines[-1]}", file=sys.stderr)
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


def add_demo_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="replayed flight with BlazeFace, scored against ground truth")
    demo.add_argument("--seconds", type=float, default=20.0, help="fly the scene this long, then print the summary")
    demo.add_argument("--out", default="out/demo", help="directory for detections.jsonl, snapshot.png, summary.json")
    demo.add_argument("--model", default=None, help="model bundle (default: BlazeFace short range)")
    demo.add_argument("--fps", type=float, default=None, help="replay rate (default 15; 0 = as fast as possible)")
    demo.add_argument("--mqtt", metavar="HOST:PORT", default=None, help="also publish to this MQTT broker")
    demo.add_argument("--dds", action="store_true", help="also publish on DDS (loopback only)")
    demo.add_argument(
        "--local-broker", action="store_true", help="publish to a private mosquitto started on a free loopback port"
    )
    demo.add_argument("--http-port", type=int, default=None, help="HTTP port (default: any free port)")
    demo.add_argument(
        "--drones", type=int, default=3, help="node processes flying the scene as a swarm (1: one node in-process)"
    )
    demo.set_defaults(func=cmd_demo)

"""``edgerun run``: the node from a config file."""

from __future__ import annotations

import argparse
from typing import Any

from edgerun.commands.options import log_level, setup_logging


def cmd_run(args: argparse.Namespace) -> int:
    from edgerun.config import load_config

    if args.test_control:  # HIL test mode: the control socket and its fault-injectable engine key
        from edgerun.testing.control import register_test_engines

        register_test_engines()
    cfg = load_config(args.config)  # before the heavy imports: a bad config fails fast
    if cfg.sinks.dds.enabled:
        from edgerun.sinks.dds import require_cyclonedds

        require_cyclonedds()  # an optional extra ([dds]): say so before any model is loaded
    setup_logging(log_level(args, cfg.node.log_level))
    from edgerun.node import run_node

    return run_node(cfg, seconds=args.seconds, test_control=args.test_control)


def add_run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run the node from a config file")
    run.add_argument("-c", "--config", required=True, help="node TOML config (see deploy/node.example.toml)")
    run.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    run.add_argument(
        "--test-control",
        nargs="?",
        const="edgerun-control.sock",
        default=None,
        metavar="SOCKET",
        help="HIL test mode: fault-injection unix socket (default ./edgerun-control.sock); never in production",
    )
    run.set_defaults(func=cmd_run)

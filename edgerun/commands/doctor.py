"""``edgerun doctor``: the inference back ends and cameras, whether they work here, and what a config reaches."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_doctor(args: argparse.Namespace) -> int:
    from edgerun.doctor import run_doctor

    return run_doctor(as_json=args.json, config_path=args.config, timeout_s=args.timeout)


def add_doctor_parser(sub: Any) -> None:
    doctor = sub.add_parser("doctor", help="list inference back ends and cameras, and whether they work here")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "-c",
        "--config",
        help="a node TOML config: also log in to its MQTT broker and open its camera as the node would "
        "(exit 1 when either fails)",
    )
    doctor.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for the broker (TCP connect, TLS, CONNACK)"
    )
    doctor.set_defaults(func=cmd_doctor)

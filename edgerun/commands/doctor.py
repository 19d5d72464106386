"""``edgerun doctor``: the inference back ends and whether they work here."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_doctor(args: argparse.Namespace) -> int:
    from edgerun.doctor import run_doctor

    return run_doctor(as_json=args.json)


def add_doctor_parser(sub: Any) -> None:
    doctor = sub.add_parser("doctor", help="list inference back ends and whether they work here")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(func=cmd_doctor)

"""``edgerun``: the top-level parser, built from one module per subcommand group (edgerun/commands/), and dispatch.

User-facing failures (``EdgerunError``) print one line and exit non-zero;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from edgerun import __version__
from edgerun.commands.bench import add_bench_parser
from edgerun.commands.demo import add_demo_parser
from edgerun.commands.doctor import add_doctor_parser
from edgerun.commands.fleet import add_fleet_parser
from edgerun.commands.model import add_model_parser
from edgerun.commands.ota import add_ota_parser
from edgerun.commands.run import add_run_parser
from edgerun.commands.station import add_station_parser
from edgerun.commands.swarm import add_swarm_parser
from edgerun.errors import EdgerunError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgerun", description="Edge inference runtime for devices and swarms.")
    parser.add_argument("--version", action="version", version=f"edgerun {__version__}")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    add_run_parser(sub)
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_doctor_parser(sub)
    add_model_parser(sub)
    try:
        from edgerun.commands.listen import add_listen_parser
    except ImportError:
        pass
    else:
        add_listen_parser(sub)
    add_ota_parser(sub)
    add_station_parser(sub)
    add_fleet_parser(sub)
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

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
from edgerun.commands.completion import add_completion_parser
from edgerun.commands.demo import add_demo_parser
from edgerun.commands.doctor import add_doctor_parser
from edgerun.commands.fleet import add_fleet_parser
from edgerun.commands.model import add_model_parser
from edgerun.commands.options import (
    DefaultsHelpFormatter,
    add_verbosity_options,
    log_level,
    missing_required,
    setup_logging,
    verbosity_given,
)
from edgerun.commands.ota import add_ota_parser
from edgerun.commands.run import add_run_parser
from edgerun.commands.station import add_station_parser
from edgerun.commands.swarm import add_swarm_parser
from edgerun.errors import EdgerunError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgerun", description="Edge inference runtime for devices and swarms.")
    parser.add_argument("--version", action="version", version=f"edgerun {__version__}")
    add_verbosity_options(parser, top=True)
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
    add_completion_parser(sub)
    parser.formatter_class = DefaultsHelpFormatter
    for command in subcommand_parsers(parser):
        add_verbosity_options(command, top=False)
        command.formatter_class = DefaultsHelpFormatter
    return parser


def subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser`` (``fleet``, ``fleet status``, ...), each once although aliases repeat them."""
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found.append(child)
                found.extend(subcommand_parsers(child))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = missing_required(args)
    if missing:
        args.command_parser.error(f"the following arguments are required: {missing}")
    func: Callable[[argparse.Namespace], int] = args.func
    if verbosity_given(args):  # commands with a default of their own (run, station) set their level again
        setup_logging(log_level(args, "warning"))
    if getattr(args, "quiet", 0) + getattr(args, "quiet_after", 0):
        from edgerun import progress

        progress.set_enabled(False)
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

"""``python -m hil``: HIL scenarios (``run``) and benchmarks (``swarm-bench``, ``offload-bench``) in network
namespaces."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hil")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("swarm-bench", help="N real swarm members in namespaces, side by side with serf")
    bench.add_argument("--nodes", type=int, default=20)
    bench.add_argument("--loss", type=float, default=0.1, help="share of packets each node drops on receive")
    bench.add_argument("--seconds", type=float, default=60.0, help="steady phase (bytes, CPU, false deaths)")
    bench.add_argument("-o", "--out", type=Path, default=None, metavar="FILE", help="write the result as JSON to FILE")
    bench.add_argument("--json", action="store_true", help="print the result as JSON on stdout instead of the table")
    bench.add_argument("--timing", default="{}", help="JSON overrides of swarm SwarmTiming for edgerun's members")
    bench.add_argument("--only", choices=("edgerun", "serf"), help="run one side only")
    bench.add_argument("--loopback", action="store_true", help="loopback even where namespaces can be made")
    bench.add_argument(
        "--starve",
        type=float,
        default=0.0,
        help="share of every second node n01 is SIGSTOPped after full membership (0.3: 300 ms)",
    )
    bench.add_argument("--join-timeout", type=float, default=60.0)
    bench.add_argument("--detect-timeout", type=float, default=60.0)
    offload = commands.add_parser(
        "offload-bench", help="a weak node borrows a strong neighbour's engine: local vs offload, loss, kill, steal"
    )
    offload.add_argument("--model", help="bundle path; default: the pose detector under .cache/models")
    offload.add_argument("--fps", type=float, default=10.0, help="every node's replay rate")
    offload.add_argument("--seconds", type=float, default=20.0, help="the weak node's run per case")
    offload.add_argument("--weak-share", type=float, default=0.15, help="CPU quota of the weak node (of one core)")
    offload.add_argument("--loss", type=float, nargs="+", default=[0.0, 0.1], help="loss shares, one pass each")
    offload.add_argument("--deadline-ms", type=float, default=500.0)
    offload.add_argument("--window", type=int, default=4)
    offload.add_argument(
        "--cases",
        nargs="+",
        default=["auto-jpeg", "always-jpeg", "always-zstd"],
        help="the offload cases (MODE-CODEC) beside local-only at each loss level",
    )
    offload.add_argument("--no-kill", action="store_true", help="skip the helper-SIGKILLed case")
    offload.add_argument("--no-steal", action="store_true", help="skip the two-busy-one-idle case")
    offload.add_argument("-o", "--out", type=Path, default=None, metavar="FILE", help="write the JSON to FILE")
    offload.add_argument("--json", action="store_true", help="print the result as JSON on stdout instead of the table")
    offload.add_argument("--keep", type=Path, help="a new directory for the nodes' configs, logs and detections")
    run = commands.add_parser("run", help="fly a scenario with its faults, score it, write report.json/report.html")
    run.add_argument("scenario", help="a scenario file, or the name of one in hil/scenarios/ (smoke, sar-5)")
    run.add_argument("-o", "--out", type=Path, required=True, help="run directory (report, observations, node logs)")
    run.add_argument("--loopback", action="store_true", help="loopback even where namespaces can be made")
    run.add_argument(
        "--ignore-control",
        action="append",
        default=[],
        metavar="NODE",
        help="(rig self-test) start NODE without --test-control behind a socket that ignores commands",
    )
    run.add_argument("--quiet", action="store_true", help="no progress line")
    return parser


def _run_scenario(args: argparse.Namespace) -> int:
    from hil.runner import run_scenario
    from hil.scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as err:
        print(f"hil run: error: {err}", file=sys.stderr)
        return err.exit_code
    unknown = [n for n in args.ignore_control if n not in {node.id for node in scenario.nodes}]
    if unknown:
        print(f"hil run: error: --ignore-control: no node {unknown[0]!r} in {scenario.name}", file=sys.stderr)
        return 2
    from edgerun.errors import EdgerunError
    from hil.netlab import NetLabError
    from hil.rig import RigError

    try:
        return run_scenario(
            scenario,
            args.out,
            force_loopback=args.loopback,
            ignore_control=frozenset(args.ignore_control),
            progress=not args.quiet,
        )
    except EdgerunError as err:
        print(f"hil run: error: {err}", file=sys.stderr)
        return err.exit_code
    except (RigError, NetLabError) as err:
        print(f"hil run: error: {err}", file=sys.stderr)
        return 1


def _offload_bench(args: argparse.Namespace) -> int:
    from hil.netlab import NetLabError
    from hil.offload_bench import OffloadBenchError, format_table, run_offload_bench

    cases = [tuple(case.split("-", 1)) for case in args.cases]
    if any(len(case) != 2 for case in cases):
        print(
            f"hil offload-bench: --cases: expected MODE-CODEC (auto-jpeg, always-zstd), got {args.cases}",
            file=sys.stderr,
        )
        return 2
    try:
        result = run_offload_bench(
            model=args.model,
            fps=args.fps,
            seconds=args.seconds,
            weak_share=args.weak_share,
            losses=tuple(args.loss),
            deadline_ms=args.deadline_ms,
            window=args.window,
            kill=not args.no_kill,
            steal=not args.no_steal,
            keep=args.keep,
            offload_cases=tuple((case[0], case[1]) for case in cases),
        )
    except (OffloadBenchError, NetLabError) as err:
        print(f"hil offload-bench: {err}", file=sys.stderr)
        return 1
    return _emit(result, format_table(result), args)


def _emit(result: dict[str, Any], table: str, args: argparse.Namespace) -> int:
    """A bench's result: the table (or with --json the JSON) on stdout, the JSON into -o FILE."""
    text = json.dumps(result, indent=2)
    print(text if args.json else table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["swarm-bench"]:
        from swarm.sim import old_json_file_spelling

        argv = old_json_file_spelling(argv)  # `--json FILE`, as the docs typed it, is `-o FILE`
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        return _run_scenario(args)
    if args.command == "offload-bench":
        return _offload_bench(args)
    from hil.swarm_bench import format_table, run_swarm_bench

    try:
        timing = json.loads(args.timing)
        if not isinstance(timing, dict):
            raise ValueError("--timing must be a JSON object")
        result = run_swarm_bench(
            args.nodes,
            args.loss,
            args.seconds,
            timing=timing,
            with_edgerun=args.only != "serf",
            with_serf=args.only != "edgerun",
            force_loopback=args.loopback,
            join_timeout_s=args.join_timeout,
            detect_timeout_s=args.detect_timeout,
            starve=args.starve,
        )
    except ValueError as exc:
        print(f"hil swarm-bench: {exc}", file=sys.stderr)
        return 2
    return _emit(result, format_table(result), args)


if __name__ == "__main__":
    sys.exit(main())

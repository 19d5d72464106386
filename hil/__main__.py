"""``python -m hil``: hardware-in-the-loop benchmarks over network namespaces."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hil")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("swarm-bench", help="N real swarm members in namespaces, side by side with serf")
    bench.add_argument("--nodes", type=int, default=20)
    bench.add_argument("--loss", type=float, default=0.1, help="share of packets each node drops on receive")
    bench.add_argument("--seconds", type=float, default=60.0, help="steady phase (bytes, CPU, false deaths)")
    bench.add_argument("--json", type=Path, help="write the result here")
    bench.add_argument("--timing", default="{}", help="JSON overrides of swarm SwarmTiming for edgerun's members")
    bench.add_argument("--only", choices=("edgerun", "serf"), help="run one side only")
    bench.add_argument("--loopback", action="store_true", help="loopback even where namespaces can be made")
    bench.add_argument("--starve", type=float, default=0.0,
                       help="share of every second node n01 is SIGSTOPped after full membership (0.3: 300 ms)")
    bench.add_argument("--join-timeout", type=float, default=60.0)
    bench.add_argument("--detect-timeout", type=float, default=60.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from hil.swarm_bench import format_table, run_swarm_bench

    try:
        timing = json.loads(args.timing)
        if not isinstance(timing, dict):
            raise ValueError("--timing must be a JSON object")
        result = run_swarm_bench(args.nodes, args.loss, args.seconds, timing=timing, with_edgerun=args.only != "serf",
                                 with_serf=args.only != "edgerun",
                                 force_loopback=args.loopback, join_timeout_s=args.join_timeout,
                                 detect_timeout_s=args.detect_timeout, starve=args.starve)
    except ValueError as exc:
        print(f"hil swarm-bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

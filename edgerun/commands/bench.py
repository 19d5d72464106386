"""``edgerun bench``: throughput, latency and memory (or failover, sinks, OTA), written as JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from edgerun.commands.options import log_level, setup_logging


def cmd_bench(args: argparse.Namespace) -> int:
    setup_logging(log_level(args, "warning"))
    args.json_stdout = args.json_file is True
    if args.sinks:
        from edgerun.bench.pipeline import run_sinks_bench_command

        return run_sinks_bench_command(args)
    if args.ota:
        from edgerun.bench.ota import run_ota_bench_command

        return run_ota_bench_command(args)
    if args.tracing:
        from edgerun.bench.tracing import run_tracing_bench_command

        return run_tracing_bench_command(args)
    if args.offload_codec:
        from edgerun.bench.offload_codec import run_offload_codec_bench_command

        return run_offload_codec_bench_command(args)
    if args.offload:
        return _offload_bench(args)
    if args.failover:
        from edgerun.bench.failover import run_failover_bench_command

        return run_failover_bench_command(args)
    from edgerun.bench.pipeline import run_bench_command

    return run_bench_command(args)


def _offload_bench(args: argparse.Namespace) -> int:
    """The offload bench (``hil/offload_bench.py``) with its defaults: root, network namespaces, two cores."""
    from edgerun.bench.pipeline import emit_result
    from hil.netlab import NetLabError
    from hil.offload_bench import OffloadBenchError, format_table, run_offload_bench

    try:
        result = run_offload_bench(model=args.model, seconds=args.seconds)
    except (OffloadBenchError, NetLabError) as err:
        print(f"edgerun: error: bench --offload: {err}", file=sys.stderr)
        return 1
    emit_result(result, args, summary=format_table(result))
    return 0


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="measure throughput, latency and memory; writes JSON")
    bench.add_argument("--model", default=None, help="bundle path or demo name (default: blazeface_short)")
    bench.add_argument("--seconds", type=float, default=8.0, help="length of each timed phase")
    bench.add_argument("--soak-seconds", type=float, default=None, help="pipeline phase length for rss_growth_mb")
    bench.add_argument("-o", "--out", default=None, metavar="FILE", help="write the result as JSON to FILE")
    # --json alone prints the JSON on stdout (the one spelling of "machine-readable" across commands);
    # `--json FILE`, the old spelling of -o FILE that the Makefile and docs typed, still writes the file.
    bench.add_argument(
        "--json",
        dest="json_file",
        nargs="?",
        const=True,
        default=None,
        metavar="FILE",
        help="print the result as JSON on stdout (with -o: a table on stdout otherwise)",
    )
    bench.add_argument("--table", nargs="*", default=None, metavar="JSON", help="print a table of result files")
    bench.add_argument(
        "--failover", action="store_true", help="measure failover instead: time to fallback detections, frames lost"
    )
    bench.add_argument(
        "--sinks", action="store_true", help="measure the sinks instead: MQTT/DDS throughput, latency, pipeline cost"
    )
    bench.add_argument(
        "--tracing",
        action="store_true",
        help="measure what tracing costs instead: node fps with tracing off, at 1 %% and at 100 %% sampling",
    )
    bench.add_argument(
        "--offload-codec",
        action="store_true",
        help="measure offload codecs instead: bytes per frame and encode+decode ms, jpeg vs zstd vs float32 zstd",
    )
    bench.add_argument(
        "--offload",
        action="store_true",
        help="measure offloading instead (root, network namespaces): a weak node local-only vs borrowing a strong "
        "neighbour's engine at 0 %% and 10 %% loss, the helper killed, two busy nodes and an idle one; --seconds "
        "per case (20 in `make bench-offload`)",
    )
    bench.add_argument("--repeats", type=int, default=10, help="--failover: injected faults of each kind")
    bench.add_argument(
        "--ota", action="store_true", help="measure OTA updates instead: delta sizes, apply time, swap gap"
    )
    bench.set_defaults(func=cmd_bench)

"""``python -m swarm.sim`` over many seeds: ``python -m swarm.sim_bench --seeds 1-20 --json out.json [SIM ARGS]``.

Every argument it does not know is passed to ``swarm.sim`` (``--nodes 20 --loss 0.1 --seconds 300 --starve 2``
...), once per seed, ``--jobs`` runs at a time. Written: each seed's figures (``runs``) and, for every numeric
figure, its min, mean and max over the seeds (``summary``); ``detect_over_6s`` lists the seeds whose slowest
observer declared the killed member dead more than 6 s after the kill. All figures come from the virtual clock
(``wall_s`` aside), so a seed gives the same numbers on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from swarm.config import SwarmTiming
from swarm.sim import SimConfig, SwarmSim, _parse

DETECT_TARGET_S = 6.0


def parse_seeds(text: str) -> list[int]:
    """``"1-20"``, ``"3,7,9"`` or a mix (``"1-5,9"``) -> sorted distinct seeds."""
    seeds: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first = int(low)
            last = int(high) if sep else first
        except ValueError:
            raise ValueError(f"seeds: expected N, N-M or a comma list of them, got {text!r}") from None
        if first > last:
            raise ValueError(f"seeds: empty range {part.strip()!r}")
        seeds.update(range(first, last + 1))
    return sorted(seeds)


def sim_config(sim_args: list[str], seed: int, timing: dict[str, Any]) -> SimConfig:
    cfg, _ = _parse([*sim_args, "--seed", str(seed)])
    if timing:
        cfg = replace(cfg, timing=replace(cfg.timing, **timing))
    return cfg


def run_seed(sim_args: list[str], timing: dict[str, Any], seed: int) -> dict[str, Any]:
    return SwarmSim(sim_config(sim_args, seed, timing)).run()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if key == "seed" or not values:
            continue
        finite = [v for v in values if math.isfinite(v)]
        summary[key] = {
            "min": min(values),
            "mean": round(sum(finite) / len(finite), 4) if finite else None,
            "max": max(values),
        }
    summary["detect_over_6s"] = [
        r["seed"] for r in runs if r.get("detect_max_s") is not None and r["detect_max_s"] > DETECT_TARGET_S
    ]
    summary["seeds_with_false_deaths"] = [r["seed"] for r in runs if r.get("false_deaths")]
    return summary


def bench(seeds: list[int], sim_args: list[str], timing: dict[str, Any] | None = None, jobs: int = 1) -> dict[str, Any]:
    timing = timing or {}
    cfg = sim_config(sim_args, seeds[0], timing)  # bad arguments fail here, once, not in every worker
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(run_seed, [sim_args] * len(seeds), [timing] * len(seeds), seeds))
    else:
        runs = [run_seed(sim_args, timing, seed) for seed in seeds]
    return {
        "sim_args": sim_args,
        "timing": asdict(cfg.timing),
        "seeds": seeds,
        "summary": summarize(runs),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarm.sim_bench", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--seeds", default="1-20", help="seeds to run: 1-20, 3,7 or 1-5,9 (default 1-20)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument(
        "--timing", default="{}", help='SwarmTiming fields to override, as JSON: {"probe_interval_s": 0.5}'
    )
    parser.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    args, sim_args = parser.parse_known_args(argv)
    if "--seed" in sim_args or "--json" in sim_args:
        parser.error("--seed/--json of swarm.sim: use --seeds and this --json")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        parser.error(str(exc))
    if args.jobs < 1:
        parser.error("--jobs: at least 1")
    try:
        timing = json.loads(args.timing)
        if not isinstance(timing, dict):
            raise ValueError("expected a JSON object")
        SwarmTiming(**timing)
    except (ValueError, TypeError) as exc:
        parser.error(f"--timing: {exc}")
    result = bench(seeds, sim_args, timing, args.jobs)
    keys = ("seed", "detect_p50_s", "detect_max_s", "false_deaths", "refutations", "bytes_per_node_s")
    print(" ".join(f"{k:>16}" for k in keys))
    for run in result["runs"]:
        print(" ".join(f"{run.get(k)!s:>16}" for k in keys))
    print(json.dumps(result["summary"], indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

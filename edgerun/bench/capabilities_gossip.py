"""What offload capabilities cost the gossip: bytes per node per second in the swarm simulator, side by side.

``python -m edgerun.bench.capabilities_gossip --json bench-results/swarm_capabilities.json``

20 members (the production ``Membership`` over ``swarm.memnet``), each scenario run on the same seed as:
``none`` (no metadata, as ``python -m swarm.sim`` measures); ``meta`` (the node's metadata as it is gossiped
without offload: model, engine, health, fps, camera pose, through ``edgerun.fleet.service.meta_worth_gossiping``
every ``meta_interval_s``); and the same plus the capabilities (serve_hash, serve_port, spare_fps, infer_ms,
queue; spare_fps wandering +-50 % every second, infer_ms +-10 %, the queue 0..2, so the rule lets capacity
through as often as it allows), once per capability rule: the design's (at most every 5 s on a > 20 % move),
a slower one (15 s, 50 %), and none of its own (capacity rides on updates made for other reasons).

Two scenarios: ``drones`` (the simulator's drones fly, see and claim: pose updates and dedup claims ride the
same gossip) and ``static`` (cameras that do not move, no claims: the metadata is all there is). At 0 % and
10 % datagram loss. The issue's budget: <= 1 KB/s per node at 20 nodes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from edgerun.fleet.member_meta import MemberMeta, encode_meta
from edgerun.fleet.service import meta_worth_gossiping
from edgerun.offload.capabilities import CAPABILITY_CHANGE, CAPABILITY_INTERVAL_S
from swarm.config import SwarmTiming
from swarm.dedup import DedupConfig, deferral_s
from swarm.sim import SimConfig, SwarmSim

BUDGET_BYTES_PER_NODE_S = 1000.0
# Capability rules measured beside the design's (5 s, 20 %): name -> (at most every s, on a move of more than)
RULES: dict[str, tuple[float, float]] = {
    "caps_5s_20pct": (CAPABILITY_INTERVAL_S, CAPABILITY_CHANGE),  # the design's rule, the node's default
    "caps_15s_50pct": (15.0, 0.5),
    "caps_ride_along": (math.inf, CAPABILITY_CHANGE),  # capacity only rides on updates made for other reasons
}
VARIANTS = ("none", "meta", *RULES)
SERVE_HASH = "9f86d081884c7d65"  # 16 hex chars, as the node advertises its served model
HFOV_DEG = 62.2


class MetadataSim(SwarmSim):
    """The swarm simulator whose members carry edgerun's member metadata, published by the node's rule."""

    def __init__(self, cfg: SimConfig, *, rule: tuple[float, float] | None, meta_interval_s: float) -> None:
        """``rule``: the capability rule (interval, change) of members that advertise capabilities, None: none do."""
        super().__init__(cfg)
        self.capabilities = rule is not None
        self.rule = rule or (CAPABILITY_INTERVAL_S, CAPABILITY_CHANGE)
        self.meta_interval_s = meta_interval_s
        self.meta_updates = 0
        self.meta_bytes: list[int] = []
        rng = random.Random(cfg.seed * 7 + 3)  # the figures' own stream: the swarm's draws stay the same
        self._wander = rng
        n = cfg.nodes
        self._base_spare = [rng.uniform(5.0, 40.0) for _ in range(n)]
        self._base_infer = [rng.uniform(15.0, 80.0) for _ in range(n)]
        self._base_fps = [rng.uniform(5.0, 15.0) for _ in range(n)]
        self._static_pose = [
            (rng.uniform(0, cfg.field_m), rng.uniform(0, cfg.field_m), rng.uniform(0, 360)) for _ in range(n)
        ]
        self._sent: list[tuple[MemberMeta, float] | None] = [None] * n
        self._next_check = [0.0] * n

    def member_meta(self, index: int, now: float) -> bytes | None:
        meta = self._current(index)
        if now < self._next_check[index]:
            return None
        self._next_check[index] = now + self.meta_interval_s
        interval_s, change = self.rule
        sent = self._sent[index]
        if not meta_worth_gossiping(meta, sent, now, capability_interval_s=interval_s, capability_change=change):
            return None
        self._sent[index] = (meta, now)
        data = encode_meta(meta)
        self.meta_updates += 1
        self.meta_bytes.append(len(data))
        return data

    def _current(self, index: int) -> MemberMeta:
        """This second's figures: what the node's member_meta() would return now."""
        rng = self._wander
        if self.drones:
            drone = self.drones[index]
            east, north = drone.east, drone.north
            yaw = math.degrees(math.atan2(drone.goal[0] - east, drone.goal[1] - north)) % 360.0
            up = 30.0
        else:
            east, north, yaw = self._static_pose[index]
            up = 6.0
        meta = MemberMeta(
            model="pose_detector",
            version=3,
            engine="tflite",
            health="ok",
            fps=round(self._base_fps[index] * rng.uniform(0.9, 1.1), 1),
            east=round(east, 2),
            north=round(north, 2),
            up=up,
            yaw=round(yaw, 1),
            hfov=HFOV_DEG,
        )
        if self.capabilities:
            meta.serve_hash = SERVE_HASH
            meta.serve_port = 7950
            meta.spare_fps = round(self._base_spare[index] * rng.uniform(0.5, 1.5), 1)
            meta.infer_ms = round(self._base_infer[index] * rng.uniform(0.9, 1.1), 1)
            meta.queue = rng.randint(0, 2)
        return meta


def run_variant(cfg: SimConfig, variant: str, meta_interval_s: float) -> dict[str, Any]:
    if variant == "none":
        sim: SwarmSim = SwarmSim(cfg)
    else:
        # the wandering figures change every second; the node's rule decides every meta_interval_s
        sim = MetadataSim(replace(cfg, meta_tick_s=1.0), rule=RULES.get(variant), meta_interval_s=meta_interval_s)
    result = sim.run()
    out: dict[str, Any] = {
        "bytes_per_node_s": result["bytes_per_node_s"],
        "false_deaths": result["false_deaths"],
        "wall_s": result["wall_s"],
    }
    if isinstance(sim, MetadataSim):
        out["meta_updates_per_node_min"] = round(sim.meta_updates / cfg.nodes / (cfg.seconds / 60.0), 2)
        out["meta_bytes_mean"] = round(sum(sim.meta_bytes) / len(sim.meta_bytes), 1) if sim.meta_bytes else 0
    return out


def run_bench(
    *,
    nodes: int = 20,
    seconds: float = 300.0,
    seed: int = 1,
    losses: tuple[float, ...] = (0.0, 0.1),
    scenarios: tuple[str, ...] = ("drones", "static"),
    meta_interval_s: float = 2.0,
) -> dict[str, Any]:
    timing = SwarmTiming()
    runs = []
    for scenario in scenarios:
        for loss in losses:
            cfg = SimConfig(
                nodes=nodes,
                loss=loss,
                seconds=seconds,
                seed=seed,
                kill_at=None,
                drones=scenario == "drones",
                timing=timing,
                # the node's hold, the deferral swarm.sim's command line uses
                dedup=DedupConfig(hold_s=1.5, defer_s=deferral_s(timing, nodes, 1.0 / SimConfig.frame_hz)),
            )
            variants = {v: run_variant(cfg, v, meta_interval_s) for v in VARIANTS}
            before = variants["meta"]["bytes_per_node_s"]
            runs.append(
                {
                    "scenario": scenario,
                    "loss": loss,
                    "bytes_per_node_s": {v: variants[v]["bytes_per_node_s"] for v in VARIANTS},
                    "added_by_capabilities_bytes_per_node_s": {
                        v: round(variants[v]["bytes_per_node_s"] - before, 1) for v in RULES
                    },
                    "meta_updates_per_node_min": {
                        v: variants[v].get("meta_updates_per_node_min") for v in VARIANTS[1:]
                    },
                    "meta_bytes_mean": {v: variants[v].get("meta_bytes_mean") for v in VARIANTS[1:]},
                    "false_deaths": {v: variants[v]["false_deaths"] for v in VARIANTS},
                    "wall_s": round(sum(v["wall_s"] for v in variants.values()), 1),
                }
            )
    within = {v: all(r["bytes_per_node_s"][v] <= BUDGET_BYTES_PER_NODE_S for r in runs) for v in VARIANTS}
    return {
        "bench": "capabilities_gossip",
        "nodes": nodes,
        "seconds": seconds,
        "seed": seed,
        "meta_interval_s": meta_interval_s,
        "budget_bytes_per_node_s": BUDGET_BYTES_PER_NODE_S,
        "rules": {name: {"interval_s": i if math.isfinite(i) else None, "change": c} for name, (i, c) in RULES.items()},
        "runs": runs,
        "within_budget": within,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edgerun.bench.capabilities_gossip", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=300.0, help="simulated seconds per run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--meta-interval-s", type=float, default=2.0, help="how often the node's rule is asked (the node's default)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.seconds <= 0 or args.meta_interval_s <= 0:
        parser.error("--nodes must be >= 2, --seconds and --meta-interval-s > 0")
    started = time.perf_counter()
    result = run_bench(nodes=args.nodes, seconds=args.seconds, seed=args.seed, meta_interval_s=args.meta_interval_s)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

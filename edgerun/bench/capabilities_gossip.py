"""What offload capabilities cost the gossip: bytes per node per second in the swarm simulator, side by side.

``python -m edgerun.bench.capabilities_gossip --json bench-results/swarm_capabilities.json``

20 members (the production ``Membership`` over ``swarm.memnet``), each scenario run on the same seed as:
``none`` (no metadata, as ``python -m swarm.sim`` measures); ``meta`` (the node's metadata as it was gossiped
before quiet updates, without offload: model, engine, health, fps, camera pose, every update broadcast, through
the rule of main before quiet updates, kept here as ``gossiped_before`` so the side by side stays reproducible,
asked every ``meta_interval_s``); the same plus the capabilities (serve_hash, serve_port, spare_fps, infer_ms,
queue; spare_fps wandering +-50 % every second, infer_ms +-10 %, the queue 0..2) under that rule's capability
bounds: 5 s / 20 % (its default), 15 s / 50 %, and none of its own (capacity rides on updates made for other
reasons); and ``quiet``: the same metadata and capabilities through the node's rule now
(``edgerun.fleet.service.meta_update_kind``: urgent fields broadcast, pose, fps and capacity in coarse steps as
quiet updates that only push-pull carries).

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

from edgerun.fleet.member_meta import MemberMeta, MetaUpdate, encode_meta
from edgerun.fleet.service import meta_update_kind
from edgerun.offload.capabilities import quantised_capacity
from swarm.config import SwarmTiming
from swarm.dedup import DedupConfig, deferral_s
from swarm.membership import MemberEvent
from swarm.sim import SimConfig, SwarmSim

BUDGET_BYTES_PER_NODE_S = 1000.0
# The rule before quiet updates (main at 6382076), every update broadcast: the pose on a 5 m move or a 30 deg
# turn, a 30 s refresh, and capacity at most every (interval) on a move of more than (change) of its last value.
BEFORE_MOVE_M = 5.0
BEFORE_TURN_DEG = 30.0
BEFORE_REFRESH_S = 30.0
BEFORE_FLOORS = {"spare_fps": 1.0, "infer_ms": 1.0, "queue": 1.0}  # below these a change was noise
# Capability rules measured under the rule before: name -> (at most every s, on a move of more than)
RULES: dict[str, tuple[float, float]] = {
    "caps_5s_20pct": (5.0, 0.2),  # the design's rule, the node's default before quiet updates
    "caps_15s_50pct": (15.0, 0.5),
    "caps_ride_along": (math.inf, 0.2),  # capacity only rides on updates made for other reasons
}
# The steady state: from here to the end of the run, after the joins and every member's first metadata (the
# simulator's members start without any and publish it at once, a broadcast each; a node joins with it).
STEADY_FROM_S = 100.0
# Spread is measured over the updates made at least this many push-pull intervals before the run ends.
SPREAD_SETTLE_PUSH_PULLS = 5
QUIET = "quiet"  # the node's rule now (meta_update_kind), with capabilities
VARIANTS = ("none", "meta", *RULES, QUIET)
SERVE_HASH = "9f86d081884c7d65"  # 16 hex chars, as the node advertises its served model
HFOV_DEG = 62.2


def _capabilities_moved_before(meta: MemberMeta, last: MemberMeta, change: float) -> bool:
    if (meta.serve_hash, meta.serve_port) != (last.serve_hash, last.serve_port):
        return True
    for name, floor in BEFORE_FLOORS.items():
        old, new = float(getattr(last, name)), float(getattr(meta, name))
        if abs(new - old) > change * max(abs(old), floor):
            return True
    return False


def gossiped_before(
    meta: MemberMeta, sent: tuple[MemberMeta, float] | None, now: float, *, interval_s: float, change: float
) -> bool:
    """Whether the rule before quiet updates broadcast ``meta`` (``sent``: the last broadcast and when)."""
    if sent is None:
        return True
    last, at = sent
    if (meta.model, meta.version, meta.engine, meta.fallback, meta.health) != (
        last.model,
        last.version,
        last.engine,
        last.fallback,
        last.health,
    ):
        return True
    if (meta.serve_hash, meta.serve_port) != (last.serve_hash, last.serve_port):
        return True
    if now - at >= interval_s and _capabilities_moved_before(meta, last, change):
        return True
    if now - at >= BEFORE_REFRESH_S:
        return True
    if meta.east is None or last.east is None:
        return meta.east is not last.east
    moved = math.hypot(meta.east - last.east, (meta.north or 0.0) - (last.north or 0.0))
    turned = abs(((meta.yaw or 0.0) - (last.yaw or 0.0) + 180.0) % 360.0 - 180.0)
    return moved > BEFORE_MOVE_M or turned > BEFORE_TURN_DEG


class MetadataSim(SwarmSim):
    """The swarm simulator whose members carry edgerun's member metadata, published by the node's rule."""

    def __init__(
        self, cfg: SimConfig, *, capabilities: bool, rule: tuple[float, float] | None, meta_interval_s: float
    ) -> None:
        """``rule``: the capability bounds (interval, change) of the rule before quiet updates, None: the node's
        rule now (meta_update_kind, urgent or quiet)."""
        super().__init__(cfg)
        self.capabilities = capabilities
        self.rule = rule
        self.meta_interval_s = meta_interval_s
        self.meta_updates = 0
        self.quiet_updates = 0
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
        self.updates: list[tuple[int, int, float, bool]] = []  # (member, its incarnation, when, broadcast)

    def member_meta(self, index: int, now: float) -> tuple[bytes, bool] | None:
        meta = self._current(index)
        if now < self._next_check[index]:
            return None
        self._next_check[index] = now + self.meta_interval_s
        sent = self._sent[index]
        if self.rule is None:
            meta = quantised_capacity(meta) if self.capabilities else meta  # as the node advertises it
            kind = meta_update_kind(meta, sent, now)
        else:
            interval_s, change = self.rule
            due = gossiped_before(meta, sent, now, interval_s=interval_s, change=change)
            kind = MetaUpdate.URGENT if due else MetaUpdate.NONE
        if kind is MetaUpdate.NONE:
            return None
        self._sent[index] = (meta, now)
        data = encode_meta(meta)
        membership = self.hosts[index].membership
        self.updates.append((index, membership.incarnation + 1, now, kind is MetaUpdate.URGENT))
        self.meta_updates += 1
        self.quiet_updates += kind is MetaUpdate.QUIET
        self.meta_bytes.append(len(data))
        return data, kind is MetaUpdate.URGENT

    def spread(self, *, broadcast: bool, settle_s: float) -> dict[str, Any]:
        """How long updates of one kind took to reach every other member (it, or a newer one): those made at
        least ``settle_s`` before the end of the run; ``unreached``: how many of them some member never got."""
        heard: dict[tuple[int, str], list[tuple[float, int]]] = {}
        for j, host in enumerate(self.hosts):
            for t, event in host.events:
                if isinstance(event, MemberEvent):
                    heard.setdefault((j, event.member.name), []).append((t, event.member.incarnation))
        times: list[float] = []
        unreached = 0
        for index, incarnation, at, urgent in self.updates:
            if urgent is not broadcast or at > self.cfg.seconds - settle_s or incarnation <= 1:
                continue
            name, last = self.names[index], 0.0
            for j in range(len(self.hosts)):
                if j == index:
                    continue
                got = [t for t, inc in heard.get((j, name), []) if t >= at and inc >= incarnation]
                last = max(last, min(got) - at if got else math.inf)
            if math.isfinite(last):
                times.append(last)
            else:
                unreached += 1
        times.sort()
        if not times:
            return {"updates": 0, "unreached": unreached}
        return {
            "updates": len(times),
            "median_s": round(times[len(times) // 2], 1),
            "p90_s": round(times[int(len(times) * 0.9)], 1),
            "max_s": round(times[-1], 1),
            "unreached": unreached,
        }

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


def _sent_bytes(sim: SwarmSim) -> int:
    """Datagrams and streams sent by every member so far, as swarm.sim's bytes_per_node_s counts them."""
    return sum(h.membership.stats["sent_bytes"] + h.membership.stats["stream_sent_bytes"] for h in sim.hosts)


def run_variant(cfg: SimConfig, variant: str, meta_interval_s: float) -> dict[str, Any]:
    if variant == "none":
        sim: SwarmSim = SwarmSim(cfg)
    else:
        # the wandering figures change every second; the node's rule decides every meta_interval_s
        sim = MetadataSim(
            replace(cfg, meta_tick_s=1.0),
            capabilities=variant != "meta",
            rule=None if variant == QUIET else RULES.get(variant, RULES["caps_5s_20pct"]),
            meta_interval_s=meta_interval_s,
        )
    steady_from = min(STEADY_FROM_S, cfg.seconds / 2)
    at_steady: list[int] = []
    sim.net.call_at(steady_from, lambda: at_steady.append(_sent_bytes(sim)))  # reads counters, changes no draw
    result = sim.run()
    streams = sum(host.membership.stats["stream_sent_bytes"] for host in sim.hosts)
    steady = (_sent_bytes(sim) - at_steady[0]) / cfg.nodes / (cfg.seconds - steady_from)
    out: dict[str, Any] = {
        "bytes_per_node_s": result["bytes_per_node_s"],
        "steady_bytes_per_node_s": round(steady, 1),
        # of which push-pull (and TCP-fallback ping) streams: every member's metadata rides in each push-pull
        "stream_bytes_per_node_s": round(streams / cfg.nodes / cfg.seconds, 1),
        "false_deaths": result["false_deaths"],
        "wall_s": result["wall_s"],
    }
    if isinstance(sim, MetadataSim):
        per_min = cfg.nodes * (cfg.seconds / 60.0)
        out["meta_updates_per_node_min"] = round(sim.meta_updates / per_min, 2)
        out["quiet_updates_per_node_min"] = round(sim.quiet_updates / per_min, 2)
        settle_s = SPREAD_SETTLE_PUSH_PULLS * cfg.timing.push_pull_interval_s
        out["spread_s"] = {
            "urgent": sim.spread(broadcast=True, settle_s=settle_s),
            "quiet": sim.spread(broadcast=False, settle_s=settle_s),
        }
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
                    "steady_bytes_per_node_s": {v: variants[v]["steady_bytes_per_node_s"] for v in VARIANTS},
                    "stream_bytes_per_node_s": {v: variants[v]["stream_bytes_per_node_s"] for v in VARIANTS},
                    "added_by_capabilities_bytes_per_node_s": {
                        v: round(variants[v]["bytes_per_node_s"] - before, 1) for v in (*RULES, QUIET)
                    },
                    "meta_updates_per_node_min": {
                        v: variants[v].get("meta_updates_per_node_min") for v in VARIANTS[1:]
                    },
                    "quiet_updates_per_node_min": variants[QUIET]["quiet_updates_per_node_min"],
                    "spread_s": {v: variants[v].get("spread_s") for v in ("meta", QUIET)},
                    "meta_bytes_mean": {v: variants[v].get("meta_bytes_mean") for v in VARIANTS[1:]},
                    "false_deaths": {v: variants[v]["false_deaths"] for v in VARIANTS},
                    "wall_s": round(sum(v["wall_s"] for v in variants.values()), 1),
                }
            )
    within = {v: all(r["bytes_per_node_s"][v] <= BUDGET_BYTES_PER_NODE_S for r in runs) for v in VARIANTS}
    within_steady = {v: all(r["steady_bytes_per_node_s"][v] <= BUDGET_BYTES_PER_NODE_S for r in runs) for v in VARIANTS}
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
        "within_budget_steady": within_steady,
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

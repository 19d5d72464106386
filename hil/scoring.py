"""Scores a recorded HIL run (``run.json``, ``observations.jsonl``, each node's ``detections.jsonl``).

Everything here is computed from the files alone, so a run can be scored (and its report redrawn) long
after it ended. Figures:

* fleet: object recall and duplicate fleet reports against the scene's ground truth (``FleetScore`` of
  ``edgerun.demo_swarm``: a ground-truth face some node had in view counts as found when a fleet object
  lies within the swarm radius); ``duplicate_ratio`` = duplicate reports / objects found;
* per node: end-to-end latency (capture stamp to the observer's receive time; a skewed clock's declared
  skew is taken out), fps, exits, the longest silence the faults do not explain, batches the node wrote
  locally that never reached the broker beyond what its MQTT sink counted as dropped;
* faults: failover time (injection to the first batch from the fallback engine), OTA convergence
  (release to every node serving the new version), whether each declared fault happened.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

# The rig flies the demo's scene, so a run is scored with the demo's fleet score (its drones, truth label).
from edgerun.config import SwarmConfig
from edgerun.demo_swarm import TRUTH_LABEL, Drone, FleetScore, object_local
from edgerun.testing.jsonl_reader import read_jsonl
from edgerun.wire import DETECTIONS_SCHEMA, OBJECT_SCHEMA, OBJECT_SCHEMA_V1
from hil.scenario import Scenario
from swarm.config import SwarmTiming
from swarm.dedup import DedupConfig, deferral_s

KILL_IN_FLIGHT_S = 3.0  # batches captured this close before a SIGKILL may die in the node's outbox, uncounted
RESUME_GRACE_S = 2.0  # after a fault is undone, the node needs a moment to publish again
MQTT_DROPS = ("edgerun_sink_dropped", 'sink="mqtt"')


def load_observations(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def score_run(out: Path, scenario: Scenario) -> dict[str, Any]:
    run = json.loads((out / "run.json").read_text())
    rows = load_observations(out / "observations.jsonl")
    return score_records(
        run, rows, scenario, {n: read_jsonl(out / "nodes" / n / "detections.jsonl") for n in run.get("nodes", {})}
    )


def score_records(
    run: dict[str, Any], rows: list[dict[str, Any]], scenario: Scenario, local: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The scores of one run from its records; ``local``: each simulated node's own JSON Lines."""
    t0 = float(run.get("t0") or run.get("started") or 0.0)
    t_end = float(run.get("t_end") or t0 + scenario.duration_s)
    nodes_info: dict[str, Any] = run.get("nodes", {})
    faults: list[dict[str, Any]] = run.get("faults", [])
    batches: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    objects: list[tuple[float, dict[str, Any]]] = []
    scrapes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    blind: list[tuple[float, float, str]] = []  # the observer was off the broker (a broker restart)
    # The observer notices a broker restart a moment after the broker went down: it was blind from then on.
    restarts = [
        (f["t_start"], f.get("t_end") or t_end) for f in faults if f["kind"] == "broker_restart" and f.get("t_start")
    ]
    for row in rows:
        if row.get("observer") == "disconnected":
            t = float(row["t"])
            blind.append((min([t, *(a for a, b in restarts if a <= t <= b)]), t_end, "observer"))
        elif row.get("observer") == "connected" and blind and blind[-1][1] == t_end:
            blind[-1] = (blind[-1][0], float(row["t"]) + 1.0, "observer")
        if "scrape" in row:
            scrapes[row["scrape"]].append(row)
            continue
        payload = row.get("payload")
        if not isinstance(payload, dict):
            continue
        if payload.get("schema") == DETECTIONS_SCHEMA:
            batches[str(payload.get("node"))].append((float(row["t"]), payload))
        elif payload.get("schema") in (OBJECT_SCHEMA, OBJECT_SCHEMA_V1):
            objects.append((float(row["t"]), payload))
    names = list(nodes_info) + [n for n in run.get("real_nodes", {}) if n not in nodes_info]
    fleet = _fleet_score(nodes_info, batches, objects, scenario)
    per_node = {
        name: _node_score(
            name, nodes_info.get(name, {}), batches[name], scrapes[name], faults, local.get(name), t0, t_end, blind
        )
        for name in names
    }
    failovers = _failovers(faults, batches)
    ota = _ota(run, faults, batches, names)
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "mode": run.get("mode"),
        "mode_reason": run.get("mode_reason"),
        "impairment": run.get("impairment"),
        "latency_jitter": run.get("latency_jitter"),
        "interrupted": bool(run.get("interrupted")),
        "duration_s": round(t_end - t0, 1),
        "fleet": fleet,
        "per_node": per_node,
        "failovers": failovers,
        "ota": ota,
        "faults": faults,
        "not_injectable": [
            f"{f['kind']} at {f['at_s']:g} s on {f.get('node') or 'the fleet'}: {f['why_not']}"
            for f in faults
            if not f.get("injectable", True)
        ],
        "series": _series(t0, batches, objects, scrapes, nodes_info, faults, fleet),
    }
    result["criteria"] = check_criteria(result, scenario)
    if run.get("startup_error"):
        result["criteria"].insert(
            0,
            {
                "name": "the fleet started",
                "limit": True,
                "value": False,
                "passed": False,
                "missed_by": None,
                "unit": "",
                "detail": run["startup_error"],
            },
        )
    result["verdict"] = verdict(result["criteria"], scenario.name, result["interrupted"])
    return result


def _fleet_score(
    nodes_info: dict[str, Any],
    batches: dict[str, list[tuple[float, dict[str, Any]]]],
    objects: list[tuple[float, dict[str, Any]]],
    scenario: Scenario,
) -> dict[str, Any]:
    # One scored flight per process: a restarted node flies on from further along its path.
    flights: dict[str, list[tuple[float, str]]] = {}
    drones: list[Drone] = []
    for name, info in nodes_info.items():
        replays = info.get("replays") or [[0.0, info["replay"]]]
        for k, (start, replay) in enumerate(replays):
            key = name if k == 0 else f"{name}#{k}"
            source = {"kind": "replay", "fps": info.get("fps", 15.0), "replay": replay}
            drones.append(Drone(len(drones), key, Path("."), {"source": source}))
            flights.setdefault(name, []).append((float(start), key))
    if not drones:
        return {
            "fleet_objects": len({o["id"] for _, o in objects}),
            "object_recall": None,
            "duplicate_reports": 0,
            "objects_seen": 0,
            "objects_found": 0,
            "duplicate_ratio": None,
            "targets_declared": 0,
        }
    score = FleetScore(drones, scenario.swarm.radius_m)
    try:
        for name, keys in flights.items():
            for t, payload in batches.get(name, []):
                score.add(next((key for start, key in reversed(keys) if start <= t), keys[0][1]), payload)
        for _, payload in objects:
            owner = str(payload.get("owner"))
            score.add(owner if owner in score.tallies else drones[0].node_id, payload)
        fleet = score.fleet()
        _split_losses(fleet, score.detected, nodes_info, scenario)
        fleet["truth_points"] = score.truth_points.tolist()
        fleet["truth_labels"] = list(score.scene.labels)
        fleet["targets_in_scene"] = sum(1 for label in score.scene.labels if label == TRUTH_LABEL)
        fleet["seen_truth"] = sorted(score.seen_truth)
        # Each object's place in the scene's metres (from its lat/lon through the scene's anchor), for the plot.
        fleet["object_points"] = {str(p["id"]): list(object_local(p, score.frame)) for _, p in objects}
    finally:
        score.close()
    found = fleet["objects_found"]
    fleet["duplicate_ratio"] = round(fleet["duplicate_reports"] / found, 4) if found else None
    fleet["targets_declared"] = scenario.scene.targets
    return fleet


def decide_s(scenario: Scenario) -> float:
    """How long after a detection its node may take to report it: the hold, the deferral, a tick (the bound
    of ``swarm.dedup``, with the deferral the node derives from its timing: ``edgerun.fleet.service``)."""
    overrides: dict[str, Any] = dict(scenario.swarm.timing)
    timing = dataclasses.replace(SwarmTiming(), **overrides)
    hold = scenario.swarm.hold_s if scenario.swarm.hold_s is not None else SwarmConfig().hold_s
    tick = timing.gossip_interval_s
    return hold + deferral_s(timing, DedupConfig.max_nodes, tick) + tick


def _split_losses(
    fleet: dict[str, Any],
    detected: dict[int, list[tuple[str, int, float]]],
    nodes_info: dict[str, Any],
    scenario: Scenario,
) -> None:
    """Of the faces detected but never reported: those only a node that was killed before it could decide
    had detected (lost with the node), and the rest, dedup's losses (``dedup_losses``, which must be 0)."""
    bound = decide_s(scenario)
    kills = {
        name: [float(e["t"]) for e in info.get("exits", []) if e.get("t") is not None and e.get("code") != 0]
        for name, info in nodes_info.items()
    }
    losses = 0
    for entry in fleet["detected_not_reported"]:
        survived = [
            (drone, ts)
            for drone, _, ts in detected[entry["truth"]]
            if not any(ts <= k <= ts + bound for k in kills.get(drone.split("#")[0], []))
        ]
        entry["cause"] = "dedup" if survived else "its only finders died before deciding"
        losses += bool(survived)
    fleet["dedup_losses"] = losses
    fleet["decide_s"] = round(bound, 2)


def _windows(faults: list[dict[str, Any]], node: str, t_end: float) -> list[tuple[float, float, str]]:
    """Intervals in which this node was meant to be silent: broker down, camera gone (to their end + grace)."""
    out = []
    for f in faults:
        if f.get("t_start") is None:
            continue
        if f["kind"] == "broker_restart" or (f["kind"] == "camera_loss" and f.get("node") == node):
            out.append((f["t_start"], (f.get("t_end") or t_end) + RESUME_GRACE_S, f["kind"]))
    return out


def _node_score(
    name: str,
    info: dict[str, Any],
    batches: list[tuple[float, dict[str, Any]]],
    scrapes: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    local: list[dict[str, Any]] | None,
    t0: float,
    t_end: float,
    blind: list[tuple[float, float, str]],
) -> dict[str, Any]:
    latencies = latencies_ms(batches, _skews(faults, name))
    exits = info.get("exits", [])
    starts = info.get("starts", [])
    times = sorted(t for t, _ in batches if t0 <= t <= t_end)
    # Restarts: from the process start to its first batch; the silence before it is explained by the restart.
    restarts = []
    explained = _windows(faults, name, t_end)
    for exit_ in exits:
        if exit_.get("t") is None or exit_["t"] > t_end:
            continue
        later_starts = [s for s in starts if s >= exit_["t"] - 0.5]
        start = min(later_starts) if later_starts else None
        first = next((t for t, _ in sorted(batches, key=lambda b: b[0]) if start is not None and t >= start), None)
        if start is not None:
            restarts.append(
                {
                    "exit_t": exit_["t"],
                    "code": exit_["code"],
                    "why": exit_["why"],
                    "restart_s": round(first - start, 2) if first else None,
                }
            )
        if exit_.get("expected") and first is not None:
            explained.append((exit_["t"] - 1.0, first + 0.1, "restart"))
    gaps = []
    edges = [t0, *times, t_end]
    for a, b in zip(edges, edges[1:]):
        unexplained = _uncovered(a, b, explained)
        if unexplained > 0:
            gaps.append((unexplained, a, b))
    worst = max(gaps, default=(0.0, t0, t0))
    loss = _loss(batches, local, scrapes, exits, blind) if local is not None else None
    versions = [int((p.get("model") or {}).get("version") or 0) for _, p in batches]
    return {
        "batches": len(batches),
        "fps": round(len(times) / max(1e-9, t_end - t0), 2),
        "latency_p50_ms": _pct(latencies, 50),
        "latency_p99_ms": _pct(latencies, 99),
        "exits": exits,
        "unexpected_exits": sum(
            1 for e in exits if not e.get("expected") and not (e.get("code") == 0 and e.get("t", 0) >= t_end - 1.0)
        ),
        "restarts": restarts,
        "max_outage_s": round(worst[0], 2),
        "max_outage_at_s": round(worst[1] - t0, 1),
        "final_version": versions[-1] if versions else None,
        "loss": loss,
    }


def _skews(faults: list[dict[str, Any]], node: str) -> list[float]:
    return [
        f.get("skew_s", 0.0) for f in faults if f["kind"] == "clock_skew" and f.get("node") == node and f.get("t_start")
    ]


def latencies_ms(batches: list[tuple[float, dict[str, Any]]], skews: list[float]) -> list[float]:
    """Capture stamp to receive time; a stamp made under a declared clock skew has the skew taken out."""
    out = []
    for t, payload in batches:
        ts = payload.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        raw = t - ts
        # Which batches carry the skew is read from the stamps themselves: those the skew brings back near zero.
        out.append(round(min([raw, *(raw + s for s in skews)], key=abs) * 1000.0, 1))
    return out


def _uncovered(a: float, b: float, windows: list[tuple[float, float, str]]) -> float:
    """Length of [a, b] outside every window."""
    pieces = [(a, b)]
    for wa, wb, _ in windows:
        nxt = []
        for pa, pb in pieces:
            if wb <= pa or wa >= pb:
                nxt.append((pa, pb))
                continue
            if pa < wa:
                nxt.append((pa, wa))
            if wb < pb:
                nxt.append((wb, pb))
        pieces = nxt
    return sum(pb - pa for pa, pb in pieces)


def _loss(
    batches: list[tuple[float, dict[str, Any]]],
    local: list[dict[str, Any]],
    scrapes: list[dict[str, Any]],
    exits: list[dict[str, Any]],
    blind: list[tuple[float, float, str]],
) -> dict[str, int]:
    """Batches the node wrote locally that the broker never delivered, against what the node counted.

    Batches captured while the observer itself was off the broker are ``observer_blind``, not lost: the
    broker (mosquitto 2.0.11 here) does not keep the observer's session across its own restart, so what a
    node delivers before the observer has resubscribed reaches no one.
    """
    seen = {(p.get("seq"), p.get("ts")) for _, p in batches}
    kills = [e["t"] for e in exits if e.get("code") == -9]
    missing = in_flight = unseen = 0
    for row in local:
        if row.get("schema") != DETECTIONS_SCHEMA or (row.get("seq"), row.get("ts")) in seen:
            continue
        ts = float(row.get("ts") or 0.0)
        if any(k - KILL_IN_FLIGHT_S <= ts <= k for k in kills):
            in_flight += 1
        elif any(a <= ts <= b for a, b, _ in blind):
            unseen += 1
        else:
            missing += 1
    counted = 0
    previous = 0.0
    for scrape in scrapes:  # a counter going down is a new process: the last value of each one adds up
        value = sum(
            v for k, v in (scrape.get("metrics") or {}).items() if k.startswith(MQTT_DROPS[0]) and MQTT_DROPS[1] in k
        )
        if value < previous:
            counted += int(previous)
        previous = value
    counted += int(previous)
    return {
        "local": sum(1 for r in local if r.get("schema") == DETECTIONS_SCHEMA),
        "missing": missing,
        "in_flight_at_kill": in_flight,
        "observer_blind": unseen,
        "counted_dropped": counted,
        "unaccounted": max(0, missing - counted),
    }


def _failovers(faults: list[dict[str, Any]], batches: dict[str, list[tuple[float, dict[str, Any]]]]) -> list[dict]:
    """Per accelerator fault: the time to the first batch not from the accelerator, and what served the node's
    batches while the fault lasted: its own fallback engine or a neighbour (``remote:<helper>``, #25)."""
    out = []
    for f in faults:
        if not f["kind"].startswith("accelerator") or f.get("t_start") is None:
            continue
        node, t = f["node"], f["t_start"]
        t_end = f.get("t_end") or float("inf")
        ordered = sorted(batches.get(node, []), key=lambda b: b[0])
        first = next(
            (bt for bt, p in ordered if bt >= t and (p.get("model") or {}).get("engine") != "hilaccel"),
            None,
        )
        during = [str((p.get("model") or {}).get("engine", "")) for bt, p in ordered if t <= bt <= t_end]
        offloaded = [bt for bt, p in ordered if bt >= t and _remote(p)]
        out.append(
            {
                "node": node,
                "fault": f["index"],
                "kind": f["kind"],
                "failover_s": round(first - t, 3) if first is not None else None,
                # batches while the fault lasted, by what inferred them
                "during_fault": {
                    "batches": len(during),
                    "offloaded": sum(1 for e in during if e.startswith("remote:")),
                    "local": sum(1 for e in during if not e.startswith("remote:")),
                    "helpers": sorted({e.split(":", 1)[1] for e in during if e.startswith("remote:")}),
                },
                "first_offloaded_s": round(offloaded[0] - t, 3) if offloaded else None,
                "offloaded_before_fault": sum(1 for bt, p in ordered if bt < t and _remote(p)),
            }
        )
    return out


def _remote(payload: dict[str, Any]) -> bool:
    return str((payload.get("model") or {}).get("engine", "")).startswith("remote:")


def _ota(
    run: dict[str, Any], faults: list[dict[str, Any]], batches: dict[str, list[tuple[float, dict]]], names: list[str]
) -> dict[str, Any] | None:
    releases = [f for f in faults if f["kind"] == "ota_release" and f.get("t_start")]
    if not releases:
        return None
    release = releases[0]
    t, version = release["t_start"], release.get("version", 2)
    per_node: dict[str, float | None] = {}
    for name in names:
        first = next(
            (
                bt
                for bt, p in sorted(batches.get(name, []), key=lambda b: b[0])
                if bt >= t and int((p.get("model") or {}).get("version") or 0) >= version
            ),
            None,
        )
        per_node[name] = round(first - t, 2) if first is not None else None
    done = [v for v in per_node.values() if v is not None]
    return {
        "version": version,
        "t_release": t,
        "per_node_s": per_node,
        "convergence_s": max(done) if len(done) == len(per_node) and done else None,
    }


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _series(
    t0: float,
    batches: dict[str, list[tuple[float, dict[str, Any]]]],
    objects: list[tuple[float, dict]],
    scrapes: dict[str, list[dict[str, Any]]],
    nodes_info: dict[str, Any],
    faults: list[dict[str, Any]],
    fleet: dict[str, Any],
) -> dict[str, Any]:
    """What the report plots, relative to the scenario's start."""
    latency: dict[str, list[float]] = {}
    fps: dict[str, list[tuple[int, int]]] = {}
    version: dict[str, list[tuple[float, int]]] = {}
    for name, rows in batches.items():
        latency[name] = latencies_ms(rows, _skews(faults, name))
        counts: dict[int, int] = defaultdict(int)
        for t, _ in rows:
            counts[math.floor(t - t0)] += 1
        fps[name] = sorted(counts.items())
        changes: list[tuple[float, int]] = []
        for t, p in sorted(rows, key=lambda r: r[0]):
            v = int((p.get("model") or {}).get("version") or 0)
            if not changes or changes[-1][1] != v:
                changes.append((round(t - t0, 2), v))
        version[name] = changes
    membership = {
        name: [
            (round(s["t"] - t0, 1), sum(1 for st in (s.get("members") or {}).values() if st == "alive"))
            for s in rows
            if s.get("ok")
        ]
        for name, rows in scrapes.items()
    }
    reports: dict[Any, dict[str, Any]] = {}
    for _, o in objects:
        reports.setdefault(o["id"], o)
    return {
        "latency_ms": latency,
        "fps": fps,
        "version": version,
        "alive_members": membership,
        "objects": [
            [*fleet.get("object_points", {}).get(str(o["id"]), (o.get("east_m"), o.get("north_m"))), o.get("owner", "")]
            for o in reports.values()
        ],
        "faults": [[round(f["t_start"] - t0, 1), f["kind"], f.get("node", "")] for f in faults if f.get("t_start")],
    }


def check_criteria(result: dict[str, Any], scenario: Scenario) -> list[dict[str, Any]]:
    """One entry per criterion: name, limit, value, passed, and by how much it missed."""
    c = scenario.criteria
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, higher_is_better: bool, unit: str = "") -> None:
        passed = value is not None and (value >= limit if higher_is_better else value <= limit)
        by = None if value is None or passed else abs(value - limit)
        checks.append(
            {
                "name": name,
                "limit": limit,
                "value": value,
                "passed": passed,
                "missed_by": None if by is None else round(by, 4),
                "unit": unit,
            }
        )

    fleet, nodes = result["fleet"], result["per_node"]
    if c.min_object_recall is not None:
        add("object_recall", fleet.get("object_recall"), c.min_object_recall, True)
    if c.max_duplicate_ratio is not None:
        add("duplicate_ratio", fleet.get("duplicate_ratio"), c.max_duplicate_ratio, False)
    if c.max_dedup_losses is not None:
        add("faces detected but not reported (dedup losses)", fleet.get("dedup_losses"), c.max_dedup_losses, False)
    for pct, limit in ((50, c.max_latency_p50_ms), (99, c.max_latency_p99_ms)):
        if limit is not None:
            values = [n[f"latency_p{pct}_ms"] for n in nodes.values()]
            add(
                f"latency_p{pct}_ms (worst node)",
                None if None in values or not values else max(values),
                limit,
                False,
                " ms",
            )
    if c.max_failover_s is not None:
        for fo in result["failovers"]:
            add(f"failover_s {fo['node']} (fault {fo['fault']})", fo["failover_s"], c.max_failover_s, False, " s")
    if c.min_offloaded_after_failover is not None:
        for fo in result["failovers"]:
            add(
                f"batches a neighbour inferred for {fo['node']} during fault {fo['fault']}",
                float(fo["during_fault"]["offloaded"]),
                c.min_offloaded_after_failover,
                True,
            )
    if c.max_ota_convergence_s is not None and result["ota"] is not None:
        add("ota_convergence_s", result["ota"]["convergence_s"], c.max_ota_convergence_s, False, " s")
        if result["ota"] is not None:
            behind = [n for n, v in nodes.items() if v["final_version"] != result["ota"]["version"]]
            add("nodes not on the new model at the end", float(len(behind)), 0.0, False)
    if c.max_outage_s is not None:
        worst = max(nodes.items(), key=lambda kv: kv[1]["max_outage_s"], default=None)
        if worst is not None:
            add(f"max_outage_s ({worst[0]})", worst[1]["max_outage_s"], c.max_outage_s, False, " s")
    if c.max_unexpected_exits is not None:
        add(
            "unexpected_exits", float(sum(n["unexpected_exits"] for n in nodes.values())), c.max_unexpected_exits, False
        )
    if c.max_unaccounted_loss is not None:
        losses = [n["loss"]["unaccounted"] for n in nodes.values() if n.get("loss")]
        add("unaccounted_loss (batches)", float(sum(losses)), c.max_unaccounted_loss, False)
    for name, n in nodes.items():
        if n["batches"] < c.min_batches_per_node:
            add(f"batches from {name}", float(n["batches"]), c.min_batches_per_node, True)
    for f in result["faults"]:
        if f.get("injectable", True):
            checks.append(
                {
                    "name": f"fault {f['index']} {f['kind']}{' ' + f['node'] if f.get('node') else ''} happened",
                    "limit": True,
                    "value": f.get("happened"),
                    "passed": f.get("happened") is True,
                    "missed_by": None,
                    "unit": "",
                    "detail": f.get("detail", ""),
                }
            )
    return checks


def verdict(checks: list[dict[str, Any]], name: str, interrupted: bool = False) -> dict[str, Any]:
    failed = [c for c in checks if not c["passed"]]
    parts = []
    for c in failed:
        if c.get("detail") is not None and c["limit"] is True:
            parts.append(f"{c['name']}: no ({c['detail']})")
        elif c["value"] is None:
            parts.append(f"{c['name']}: not measured (limit {c['limit']:g}{c['unit']})")
        else:
            parts.append(
                f"{c['name']} {c['value']:g}{c['unit']} vs limit {c['limit']:g}{c['unit']} "
                f"(missed by {c['missed_by']:g}{c['unit']})"
            )
    passed = not failed and not interrupted
    if passed:
        line = f"PASS {name}: all {len(checks)} criteria hold"
    elif not failed:
        line = f"FAIL {name} (interrupted: partial run): the {len(checks)} criteria held until it was cut short"
    else:
        cut = " (interrupted: partial run)" if interrupted else ""
        line = f"FAIL {name}{cut}: {len(failed)} of {len(checks)} criteria failed: " + "; ".join(parts)
    return {"passed": passed, "failed": [c["name"] for c in failed], "line": line}

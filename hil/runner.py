"""``python -m hil run SCENARIO --out DIR``: fly a scenario on the rig, inject its faults, score it, report.

Steps: the fleet's bundles and signed OTA release (``hil.fleet_release``); the rig (``hil.rig``: broker,
observer, one ``edgerun run --test-control`` per simulated node); wait until every simulated node
publishes; the timeline (``hil.timeline``) for ``duration_s`` with a progress line; a clean stop; then
``hil.scoring`` and ``hil.report`` over what was recorded. Ctrl-C (or SIGTERM) stops early, tears
everything down and still writes a partial report. The exit code is 0 only if every criterion holds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hil.fleet_release import prepare_fleet_release
from hil.live import LiveView
from hil.rig import Rig, RigError
from hil.scenario import Scenario
from hil.timeline import Timeline

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # every node loads its model and scene on a shared 2-core machine
MAX_RESTARTS = 5  # a node that keeps dying is left down (its exits are in the report)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop early, still report."""


class StartupFailed(Exception):
    """A node never published: the scenario cannot start; reported as a failed run."""


def run_scenario(
    scenario: Scenario,
    out: Path,
    *,
    force_loopback: bool = False,
    ignore_control: frozenset[str] = frozenset(),
    progress: bool = True,
) -> int:
    """Run ``scenario`` into ``out``; returns the exit code (0: every criterion holds, 1: some failed, 130: cut)."""
    from hil.report import write_report
    from hil.scoring import score_run

    if out.is_dir() and any(out.iterdir()):
        if not (out / "run.json").is_file() and not (out / "observations.jsonl").is_file():
            raise RigError(f"{out} is not empty and holds no earlier HIL run: choose another --out")
        shutil.rmtree(out)  # an earlier run's records and OTA state must not leak into this one
    out.mkdir(parents=True, exist_ok=True)
    repo = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupted)
    interrupted = False
    run_info: dict[str, Any] = {"scenario": scenario.name, "started": time.time(), "duration_s": scenario.duration_s}
    release = prepare_fleet_release(out)
    rig = Rig(scenario, out, release, force_loopback=force_loopback, ignore_control=ignore_control)
    timeline: Timeline | None = None
    try:
        with rig:
            run_info.update(mode=rig.mode, mode_reason=rig.mode_reason, broker=f"{rig.broker_host}:{rig.broker_port}")
            live = LiveView(rig.observations_path)
            timeline = Timeline(rig, live)
            try:
                t0 = _wait_for_fleet(rig, live, progress)
                run_info["t0"] = t0
                _fly(rig, live, timeline, t0, scenario, progress)
            except (KeyboardInterrupt, Interrupted):
                interrupted = True
                _line("interrupted: tearing down, writing a partial report", progress, final=True)
            except StartupFailed as err:
                run_info["startup_error"] = str(err)
            finally:
                timeline.finish()
                run_info["t_end"] = time.time()
                rig.stop_nodes()
                time.sleep(1.0)  # the observer's last messages
            run_info.update(_rig_record(rig, timeline))
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    run_info["interrupted"] = interrupted
    if timeline is not None and "faults" not in run_info:
        run_info.update(_rig_record(rig, timeline))
    (out / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
    result = score_run(out, scenario)
    html = write_report(out, scenario, result)
    verdict = result["verdict"]
    print(f"report: {html}")
    print(verdict["line"])
    if interrupted:
        return 130
    return 0 if verdict["passed"] else 1


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted()


def _rig_record(rig: Rig, timeline: Timeline) -> dict[str, Any]:
    return {
        "mode": rig.mode,
        "mode_reason": rig.mode_reason,
        "impairment": rig.impairment_backend or ("none" if rig.lab else "not available on loopback"),
        "latency_jitter": "not injected: this kernel has no netem; the rig injects loss only (nftables)"
        if rig.impairment_backend != "netem"
        else "netem available (loss only configured)",
        "t_release": timeline.t_release,
        "nodes": {
            node.id: {
                "ip": node.ip,
                "http": node.http_url,
                "starts": node.starts,
                "exits": node.exits,
                "replay": node.replays[0][1] if node.replays else node.drone.config["source"]["replay"],
                "replays": node.replays,
                "fps": node.drone.config["source"]["fps"],
                "ignore_control": node.ignore_control,
                "engines": node.spec.engines,
            }
            for node in rig.nodes.values()
        },
        "real_nodes": {spec.id: spec.address for spec in rig.scenario.nodes if spec.real},
        "faults": [record.to_json() for record in timeline.records],
    }


def _wait_for_fleet(rig: Rig, live: LiveView, progress: bool) -> float:
    """Until every simulated node has published a batch; the scenario's clock starts then."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    shown = 0.0
    while True:
        live.update()
        _supervise(rig, None)
        waiting = [n for n in rig.nodes if live.nodes[n].batches == 0]
        if not waiting:
            return time.time()
        if time.monotonic() > deadline:
            raise StartupFailed(
                f"{', '.join(waiting)} published nothing within {STARTUP_TIMEOUT_S:.0f} s (see nodes/*/node.log)"
            )
        if time.monotonic() - shown >= (0.5 if sys.stderr.isatty() else 10.0):
            shown = time.monotonic()
            _line(f"[{rig.scenario.name}] starting: waiting for {', '.join(waiting)}", progress)
        time.sleep(0.5)


def _fly(rig: Rig, live: LiveView, timeline: Timeline, t0: float, scenario: Scenario, progress: bool) -> None:
    last_line = 0.0
    while True:
        elapsed = time.time() - t0
        live.update()
        _supervise(rig, timeline)
        timeline.tick(elapsed)
        if elapsed >= scenario.duration_s:
            break
        now = time.monotonic()
        if now - last_line >= (0.5 if sys.stderr.isatty() else 10.0):
            last_line = now
            up = sum(1 for n in rig.nodes.values() if n.running)
            _line(
                f"[{scenario.name}] {elapsed:5.0f}/{scenario.duration_s:.0f} s  faults {timeline.done}/"
                f"{len(timeline.records)}  nodes up {up}/{len(rig.nodes)}  fleet objects {len(live.objects)}",
                progress,
            )
        time.sleep(0.2)
    _line(f"[{scenario.name}] done: {len(live.objects)} fleet objects", progress, final=True)


def _supervise(rig: Rig, timeline: Timeline | None) -> None:
    for node in rig.poll_exits():
        unexpected = sum(1 for e in node.exits if not e["expected"])
        log.info("node %s exited %s (%s)", node.id, node.exits[-1]["code"], node.exits[-1]["why"])
        if timeline is not None:
            if unexpected <= MAX_RESTARTS:
                timeline.on_exit(node)
        elif unexpected <= MAX_RESTARTS:
            rig.start_node(node)


def _line(text: str, progress: bool, *, final: bool = False) -> None:
    if not progress:
        return
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{text:<100}" + ("\n" if final else ""))
    else:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()

"""A scenario's faults on the clock: each one injected at its time, undone after its duration, and checked.

A fault counts as done only when its effect is seen from outside (a failover event, a node that stops
publishing, a member declared unreachable, a process that died at its OTA step), not when the command was
accepted: a node that ignores its control socket fails the run with the reason. Faults the rig cannot
inject (real boards, no namespaces) are recorded as not injectable, with why.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from edgerun.ota.store import ModelStore
from hil.live import LiveView
from hil.rig import Rig, SimNode
from hil.scenario import NODE_FAULTS, FaultSpec

log = logging.getLogger(__name__)

# How long after its injection a fault's effect may take to show before the fault counts as not happened.
CHECK_TIMEOUT_S = {
    "accelerator_exception": 15.0,
    "accelerator_hang": 15.0,
    "broker_restart": 10.0,
    "kill": 10.0,
    "ota_release": 60.0,
    "ota_power_cut": 150.0,
    "clock_skew": 15.0,
}
SILENCE_S = 3.0  # a camera is gone when its node published nothing for this long

# (final) -> None while undecided, else (happened, detail)
Check = Callable[[bool], "tuple[bool, str] | None"]


@dataclass
class FaultRecord:
    index: int
    spec: FaultSpec
    injectable: bool = True
    why_not: str = ""
    t_start: float | None = None  # wall time injected
    t_end: float | None = None  # wall time undone
    happened: bool | None = None
    detail: str = ""
    check: Check | None = None
    check_deadline: float = 0.0
    measure: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            **msgspec.to_builtins(self.spec),
            "injectable": self.injectable,
            "why_not": self.why_not,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "happened": self.happened,
            "detail": self.detail,
            **self.measure,
        }


class Timeline:
    def __init__(self, rig: Rig, live: LiveView) -> None:
        self.rig = rig
        self.live = live
        self.records = [FaultRecord(i, f) for i, f in enumerate(rig.scenario.faults)]
        self._actions: list[tuple[float, int, str]] = []  # (at_s, fault index, "start" | "end")
        self._power_cut: dict[str, FaultRecord] = {}  # node -> its armed power cut
        self.t_release: float | None = None
        for record in self.records:
            record.injectable, record.why_not = self._injectable(record.spec)
            spec = record.spec
            self._actions.append((spec.at_s, record.index, "start"))
            if spec.duration_s > 0:
                self._actions.append((spec.at_s + spec.duration_s, record.index, "end"))
        self._actions.sort()
        self._next = 0

    def _injectable(self, spec: FaultSpec) -> tuple[bool, str]:
        rig = self.rig
        if spec.kind in NODE_FAULTS and rig.scenario.node(spec.node).real:
            return False, f"{spec.node} is a real board: driven over MQTT and HTTP only (no control socket, no signals)"
        if spec.kind == "partition":
            if rig.lab is None:
                return False, f"no network namespaces ({rig.mode_reason})"
            real = [n for group in spec.groups for n in group if rig.scenario.node(n).real]
            if real:
                return False, f"{real[0]} is a real board outside the rig's namespaces"
        if spec.kind == "broker_restart" and rig.scenario.broker.address:
            return False, "the broker is external (broker.address): the rig does not own it"
        return True, ""

    @property
    def done(self) -> int:
        return sum(1 for r in self.records if r.happened is not None or not r.injectable)

    def tick(self, elapsed_s: float) -> None:
        """Run what fell due and decide the checks that can be decided."""
        while self._next < len(self._actions) and self._actions[self._next][0] <= elapsed_s:
            _, index, phase = self._actions[self._next]
            self._next += 1
            record = self.records[index]
            if not record.injectable:
                continue
            try:
                (self._start if phase == "start" else self._end)(record)
            except Exception as err:  # a fault that could not be injected fails the run; the runner goes on
                record.happened, record.detail = False, f"{phase} failed: {err}"
                log.warning("fault %d %s %s failed: %s", index, record.spec.kind, phase, err)
        now = time.time()
        for record in self.records:
            if record.check is None or record.happened is not None:
                continue
            final = now >= record.check_deadline
            verdict = record.check(final)
            if verdict is None and final:
                verdict = (False, "no effect seen before the deadline")
            if verdict is not None:
                record.happened, record.detail = verdict
                record.check = None

    def finish(self) -> None:
        """The run ended: undecided checks get their final answer."""
        for record in self.records:
            if record.check is not None and record.happened is None:
                verdict = record.check(True) or (False, "the run ended before its effect was seen")
                record.happened, record.detail = verdict
            elif record.injectable and record.happened is None and record.t_start is None:
                record.happened, record.detail = False, "the run ended before it was due"

    def on_exit(self, node: SimNode) -> None:
        """A node process ended: a power cut's proof, and a supervisor's restart where the exit was not planned."""
        cut = self._power_cut.get(node.id)
        exit_ = node.exits[-1]
        if cut is not None and exit_["code"] == -signal.SIGKILL:
            exit_["expected"], exit_["why"] = True, f"power cut at OTA step {cut.spec.step}"
            journal = ModelStore(node.state_dir).journal_records()
            last = journal[-1]["step"] if journal else "none"
            cut.measure["journal_last_step"] = last
            cut.happened = last == cut.spec.step
            cut.detail = (
                f"{node.id} SIGKILLed itself after journalling {last!r}"
                if cut.happened
                else f"{node.id} died but its journal ends at {last!r}, not {cut.spec.step!r}"
            )
            cut.check = None
            cut.t_end = exit_["t"]
            del self._power_cut[node.id]
            self.rig.start_node(node)  # the power comes back
            return
        if exit_["why"].startswith("kill"):
            return  # restarted when the kill fault ends
        self.rig.start_node(node)  # systemd's Restart=on-failure

    # -- injecting -------------------------------------------------------------------------------------------

    def _arm_check(self, record: FaultRecord, check: Check, timeout_s: float) -> None:
        record.check, record.check_deadline = check, time.time() + timeout_s

    def _start(self, record: FaultRecord) -> None:
        spec, rig, live = record.spec, self.rig, self.live
        node = rig.nodes.get(spec.node) if spec.node else None
        record.t_start = t0 = time.time()
        kind = spec.kind
        log.info("fault %d: %s %s", record.index, kind, spec.node)
        if kind in ("accelerator_exception", "accelerator_hang"):
            assert node is not None
            rig.control(node, {"cmd": "accelerator", "mode": "raise" if kind.endswith("exception") else "hang"})

            def failed_over(final: bool) -> tuple[bool, str] | None:
                events = [e for e in live.events_since(node.id, t0, "engine") if e.get("event") == "failover"]
                if events:
                    return True, f"{node.id} failed over {events[0].get('from')} -> {events[0].get('to')}"
                why = f"no failover event from {node.id} within {CHECK_TIMEOUT_S[kind]:g} s"
                return (False, why) if final else None

            self._arm_check(record, failed_over, CHECK_TIMEOUT_S[kind])
        elif kind == "camera_loss":
            assert node is not None
            rig.control(node, {"cmd": "camera", "present": False})
            wait = min(spec.duration_s, SILENCE_S + 3.0)

            def went_dark(final: bool) -> tuple[bool, str] | None:
                if not final:
                    return None
                quiet = time.time() - live.nodes[node.id].last_batch_t
                if quiet >= SILENCE_S:
                    return True, f"{node.id} published nothing for {quiet:.1f} s"
                return False, f"{node.id} kept publishing batches after its camera was taken away (ignored the command)"

            self._arm_check(record, went_dark, wait)
        elif kind == "clock_skew":
            assert node is not None
            rig.control(node, {"cmd": "clock_skew", "seconds": spec.skew_s})

            def skewed(final: bool) -> tuple[bool, str] | None:
                view = live.nodes[node.id]
                offset = view.last_ts_offset
                near = offset is not None and abs(offset - spec.skew_s) < abs(spec.skew_s) / 2
                if view.last_batch_t > t0 + 1.0 and near:
                    return True, f"{node.id} stamps batches {offset:+.1f} s off"
                return (False, f"{node.id}'s batch stamps did not move by {spec.skew_s:+g} s") if final else None

            self._arm_check(record, skewed, CHECK_TIMEOUT_S[kind])
        elif kind == "partition":
            assert rig.lab is not None
            # with a lab every node has its lab node; the check is for the type
            groups = [[lab for n in group if (lab := rig.nodes[n].lab_node) is not None] for group in spec.groups]
            for i in range(len(groups)):
                for j in range(i + 1, len(groups)):
                    rig.lab.partition(groups[i], groups[j])
            side = {n: i for i, group in enumerate(spec.groups) for n in group}

            def split(final: bool) -> tuple[bool, str] | None:
                for name, view in live.nodes.items():
                    if name not in side or view.members_t < t0:
                        continue
                    gone = [
                        m
                        for m, state in view.members.items()
                        if m in side and side[m] != side[name] and state != "alive"
                    ]
                    if gone:
                        return True, f"{name} saw {gone[0]} {view.members[gone[0]]}"
                return (False, "every node still saw the other side alive") if final else None

            self._arm_check(record, split, spec.duration_s + 2.0)
        elif kind == "broker_restart":
            rig.stop_broker()

            def broker_gone(final: bool) -> tuple[bool, str] | None:
                if any(t >= t0 and what == "disconnected" for t, what in live.observer_events):
                    return True, "the observer lost the broker"
                return (False, "the observer never lost the broker") if final else None

            self._arm_check(record, broker_gone, CHECK_TIMEOUT_S[kind])
        elif kind == "kill":
            assert node is not None
            rig.kill_node(node, f"kill fault {record.index}")
            code = node.proc.returncode if node.proc is not None else (node.exits[-1]["code"] if node.exits else None)
            record.happened = code == -signal.SIGKILL or not node.running
            record.detail = f"{node.id} SIGKILLed"
        elif kind == "ota_release":
            rig.publish_release()
            self.t_release = t0
            record.measure["version"] = spec.version

            def updating(final: bool) -> tuple[bool, str] | None:
                started = [n for n in rig.nodes if live.events_since(n, t0, "ota")]
                if len(started) == len(rig.nodes):
                    return True, f"every node took up the release ({len(started)})"
                return (False, f"only {sorted(started)} took up the release") if final else None

            self._arm_check(record, updating, CHECK_TIMEOUT_S[kind])
        elif kind == "ota_power_cut":
            assert node is not None
            rig.control(node, {"cmd": "ota_crash_at", "step": spec.step})
            self._power_cut[node.id] = record

            def cut(final: bool) -> tuple[bool, str] | None:
                return (False, f"{node.id} was not cut off at OTA step {spec.step!r}") if final else None

            self._arm_check(record, cut, CHECK_TIMEOUT_S[kind] + (self._release_after(spec.at_s)))

    def _release_after(self, at_s: float) -> float:
        later = [f.at_s for f in self.rig.scenario.faults if f.kind == "ota_release" and f.at_s >= at_s]
        return (min(later) - at_s) if later else 0.0

    def _end(self, record: FaultRecord) -> None:
        spec, rig = record.spec, self.rig
        node = rig.nodes.get(spec.node) if spec.node else None
        record.t_end = time.time()
        kind = spec.kind
        log.info("fault %d: %s %s ends", record.index, kind, spec.node)
        if kind in ("accelerator_exception", "accelerator_hang"):
            assert node is not None
            if node.running:
                rig.control(node, {"cmd": "accelerator", "mode": "clear"})
        elif kind == "camera_loss":
            assert node is not None
            if node.running:
                rig.control(node, {"cmd": "camera", "present": True})
        elif kind == "clock_skew":
            assert node is not None
            if node.running:
                rig.control(node, {"cmd": "clock_skew", "seconds": 0})
        elif kind == "partition":
            assert rig.lab is not None
            rig.lab.heal()
        elif kind == "broker_restart":
            rig.start_broker()
        elif kind == "kill":
            assert node is not None
            if not node.running:
                rig.start_node(node)

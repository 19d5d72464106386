"""Failover between inference back ends, so a node keeps detecting when its accelerator dies.

``Failover`` holds the ordered candidates of ``engine.order`` (the bundle's CPU
engine, ``tflite`` or else ``onnx``, always last) as whole model runtimes: back ends may need
other preprocessing (NCHW for ONNX/TensorRT, quantised input for the Edge
TPU), so failing over means swapping the pipeline's ``ModelRuntime`` between
two frames, not just its engine.

* **Start**: every candidate is opened and warmed up (a few inferences on a
  blank tensor, each under a deadline); the first that passes serves, the
  others stay open as warm standbys so a failover costs a pointer swap.
* **Watched calls**: the pipeline's infer stage calls a non-last-resort engine
  through that engine's own worker thread (``EngineWorker``) and waits at most
  the hang deadline (``engine.hang_deadline_ms``, or ``HANG_P99_MULTIPLE`` x
  the engine's recent p99 with a floor of ``HANG_FLOOR_S``). The waiting infer
  thread is the watchdog: it sees the start time of the call in flight. The
  CPU last resort has nothing to fail over to and is called directly.
* **Fault**: an exception, or a call that overran its deadline, marks that
  runtime dead and swaps the pipeline to the best warm candidate at once, from
  the infer thread. The hung worker is abandoned (a daemon thread; if it ever
  returns, its result lands in buffers nobody reads any more, because frame
  slots keep separate buffers per runtime). The failed frame and the frames
  already prepared for the dead runtime are dropped and counted
  (``FrameLost``: ``engine_error``, ``engine_hang``, ``failover``).
* **Recovery**: a supervisor thread re-probes failed candidates with
  exponential backoff (``engine.reprobe_min_s`` doubling up to
  ``engine.reprobe_max_s``) by opening a fresh engine and warming it up; when a
  candidate better than the one serving passes, the pipeline swaps back.
* **Crashes**: ``Breadcrumbs`` bracket every call into a non-last-resort
  engine, so a driver that kills the process is blamed at the next start,
  which begins on the fallback and re-probes later, backing off further for
  each crash (persisted count).

Health is ``degraded`` (problem key ``engine``) while the node serves on a
candidate other than its preferred one; each switch is published as an
``engine`` event and counted for /metrics.

Which runtime the pipeline serves is owned by ``ServingController``
(``edgerun.pipeline.serving``): failover asks it to activate a candidate and
is refused once an OTA swap has handed the pipeline to another owner. The
fault-injection tools live in ``edgerun.testing``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from edgerun.engines.breadcrumb import Breadcrumbs, InFlight
from edgerun.engines.runtime import FrameLost, ModelRuntime, ProblemReporter
from edgerun.engines.worker import EngineHang, EngineWorker, call_with_timeout
from edgerun.errors import EngineError, ModelError

if TYPE_CHECKING:
    from edgerun.pipeline.serving import ServingController

log = logging.getLogger(__name__)

# The CPU last resort when the caller names none (a bundle without TFLite names "onnx").
LAST_RESORT = "tflite"
HANG_P99_MULTIPLE = 10.0
HANG_FLOOR_S = 0.25
WARMUP_FRAMES = 3
WARMUP_TIMEOUT_S = 20.0  # first inferences build kernels and caches: generous
OPEN_TIMEOUT_S = 120.0  # deserialising a large TensorRT engine on a Nano takes a while
LATENCY_RING = 256
RECOMPUTE_EVERY = 64

# candidate states
READY = "ready"  # open and warm: serving or standing by
FAILED = "failed"  # failed at open, warm-up or mid-stream; re-probed with backoff
BROKEN = "broken"  # the model file does not load on this back end; never re-probed
ABSENT = "absent"  # the bundle has no variant for this back end; not a problem

EventCallback = Callable[[str, dict[str, Any]], None]
OpenRuntime = Callable[[str], ModelRuntime]


@dataclass(slots=True)
class FailoverSettings:
    hang_deadline_s: float = 0.0  # 0: auto, HANG_P99_MULTIPLE x p99 and at least HANG_FLOOR_S
    reprobe_min_s: float = 1.0
    reprobe_max_s: float = 300.0
    retire_timeout_s: float = 5.0

    def backoff(self, failures: int) -> float:
        """Seconds before the next probe after ``failures`` consecutive failures (>= 1)."""
        return min(self.reprobe_max_s, self.reprobe_min_s * 2.0 ** max(0, failures - 1))


class Candidate:
    """One back end of ``engine.order`` and what failover knows about it."""

    def __init__(self, key: str, index: int, last_resort: bool, fixed_deadline_s: float) -> None:
        self.key = key
        self.index = index
        self.last_resort = last_resort
        self.state = FAILED
        self.reason = ""
        self.runtime: ModelRuntime | None = None
        self.worker: EngineWorker | None = None
        self.failures = 0
        self.next_probe = math.inf
        self.served_since = 0.0  # monotonic; 0.0 when not serving
        self.fixed_deadline_s = fixed_deadline_s
        self.deadline_s = fixed_deadline_s or WARMUP_TIMEOUT_S
        self._times = np.zeros(LATENCY_RING, np.float64)
        self._count = 0

    def record(self, seconds: float) -> None:
        """One call's duration; every RECOMPUTE_EVERY calls the auto deadline follows the p99."""
        self._times[self._count % LATENCY_RING] = seconds
        self._count += 1
        if self._count % RECOMPUTE_EVERY == 0:
            self._update_deadline()

    def seed(self, times: list[float]) -> None:
        self._times[:] = 0.0
        self._count = 0
        for t in times:
            self._times[self._count] = t
            self._count += 1
        self._update_deadline()

    def _update_deadline(self) -> None:
        if self.fixed_deadline_s:
            return
        n = min(self._count, LATENCY_RING)
        p99 = float(np.percentile(self._times[:n], 99)) if n else 0.0
        self.deadline_s = max(HANG_FLOOR_S, HANG_P99_MULTIPLE * p99)

    @property
    def p99_ms(self) -> float:
        n = min(self._count, LATENCY_RING)
        return float(np.percentile(self._times[:n], 99) * 1000.0) if n else float("nan")

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            "failures": self.failures,
            "deadline_ms": round(self.deadline_s * 1000.0, 1),
        }


class _Lane:
    """The path from one runtime instance to its engine: candidate, worker, and whether it died."""

    __slots__ = ("candidate", "runtime", "worker", "dead")

    def __init__(self, candidate: Candidate, runtime: ModelRuntime, worker: EngineWorker | None) -> None:
        self.candidate = candidate
        self.runtime = runtime
        self.worker = worker
        self.dead = False


class Failover:
    """Failover over one model's engines: an owner under the ``ServingController``, which hands it the
    pipeline's engine calls (``infer``) while it is in charge.

    ``open_runtime(key)`` opens a fresh engine for back end ``key`` and builds
    its runtime (``edgerun.engines.factory.build_runtime``); it raises ModelError when the
    model does not load there (never re-probed) and EngineError when the back
    end is unusable (re-probed). Keys the bundle has no variant for are passed
    in ``absent`` (key -> why) and never opened. ``last_resort`` is the CPU back
    end appended last (the bundle's ``cpu_engine``).
    """

    def __init__(
        self,
        order: list[str],
        open_runtime: OpenRuntime,
        settings: FailoverSettings | None = None,
        *,
        absent: dict[str, str] | None = None,
        health: ProblemReporter | None = None,
        on_event: EventCallback | None = None,
        breadcrumbs: Breadcrumbs | None = None,
        last_resort: str = LAST_RESORT,
    ) -> None:
        keys = list(dict.fromkeys([*order, last_resort]))
        self.settings = settings or FailoverSettings()
        self._open_runtime = open_runtime
        self._health = health
        self._on_event = on_event
        self._crumbs = breadcrumbs
        fixed = self.settings.hang_deadline_s
        self.candidates = [Candidate(k, i, k == last_resort, fixed) for i, k in enumerate(keys)]
        for cand in self.candidates:
            if absent and cand.key in absent and not cand.last_resort:
                cand.state, cand.reason = ABSENT, absent[cand.key]
        self._lock = threading.RLock()
        self._lanes: dict[ModelRuntime, _Lane] = {}
        self._dead: weakref.WeakSet[ModelRuntime] = weakref.WeakSet()
        self._to_retire: list[_Lane] = []
        self._serving: ServingController | None = None
        self.active: Candidate | None = None
        self.failovers = 0
        self.switch_backs = 0
        self._fallback_total_s = 0.0
        self._fallback_since: float | None = None
        self._wake = threading.Event()
        self._closing = False
        self._closed = False
        self._supervisor: threading.Thread | None = None

    # -- reads (any thread) -------------------------------------------------------

    @property
    def preferred(self) -> Candidate:
        """The candidate the node should serve on: the first the bundle has a variant for."""
        return next(c for c in self.candidates if c.state != ABSENT)

    @property
    def active_key(self) -> str:
        return self.active.key if self.active else ""

    @property
    def keys(self) -> list[str]:
        return [c.key for c in self.candidates if c.state != ABSENT]

    def fallback_seconds(self) -> float:
        """Total time served on a candidate other than the preferred one."""
        with self._lock:
            since = self._fallback_since
            return self._fallback_total_s + (time.monotonic() - since if since is not None else 0.0)

    def concurrency(self) -> int:
        """Infer calls the open candidates take at once, the most of any: the pipeline's worker count.

        Sized for the CPU last resort's replicas too, so a failover from an
        accelerator lands on a pipeline that keeps every fallback replica busy.
        """
        with self._lock:
            open_engines = [c.runtime.engine for c in self.candidates if c.runtime is not None]
        return max([1, *(int(getattr(e, "concurrent_calls", 1)) for e in open_engines)])

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {
                "active": self.active_key,
                "failovers": self.failovers,
                "switch_backs": self.switch_backs,
                "fallback_s": round(self.fallback_seconds(), 3),
                "candidates": {c.key: c.describe() for c in self.candidates},
            }

    # -- start and stop --------------------------------------------------------------

    def start(self) -> ModelRuntime:
        """Open and warm up every candidate; returns the runtime of the best one to serve first.

        Raises EngineError (naming every failure) when not even the last resort works.
        """
        blamed: dict[str, int] = {}
        if self._crumbs is not None:
            blamed = self._crumbs.recover()
            self._crumbs.retain()
        now = time.monotonic()
        for cand in self.candidates:
            if self._closing:
                break  # closed from another thread while starting (a stop during the node's build)
            if cand.state == ABSENT:
                log.info("engine %s skipped: %s", cand.key, cand.reason)
                continue
            crashes = blamed.get(cand.key, 0) or (
                self._crumbs.crashes.get(cand.key, 0) if self._crumbs is not None and not cand.last_resort else 0
            )
            if cand.key in blamed:
                # Probing it now could kill the process again: start without it and probe later.
                cand.state = FAILED
                cand.failures = crashes + 1
                cand.reason = f"crashed the process inside an inference call last run (crash {crashes})"
                cand.next_probe = now + self.settings.backoff(cand.failures)
                log.warning("engine %s %s; re-probe in %.1f s", cand.key, cand.reason, cand.next_probe - now)
                continue
            if crashes:
                cand.failures = crashes  # earlier crashes not yet forgiven: back off further if it fails
            self._probe(cand, at_start=True)
        if self._closing:
            raise EngineError("engines closed while they were being opened")
        ready = [c for c in self.candidates if c.state == READY]
        if not ready:
            if self._crumbs is not None:
                self._crumbs.release()
            last = self.candidates[-1]
            if last.state == BROKEN:  # the bundle's required CPU model is bad: that is the error to fix
                raise ModelError(last.reason)
            failures = "; ".join(f"{c.key}: {c.reason}" for c in self.candidates if c.reason)
            raise EngineError(f"no engine could be opened: {failures}")
        with self._lock:
            self._activate(ready[0], reason="start")
        assert ready[0].runtime is not None
        return ready[0].runtime

    def attach(self, serving: ServingController) -> None:
        """Take charge under ``serving`` (its ``serve`` or ``swap`` calls this) and start re-probing."""
        with self._lock:
            self._serving = serving
            for cand in self.candidates:
                if cand.state == READY and cand.runtime is not None:
                    self._premake_buffers(cand.runtime)
            if self.active is not None and self.active.runtime is not serving.runtime:
                self._activate(self.active, reason="start")
            self._update_health()
            active, preferred = self.active, self.preferred
            if active is not None and active is not preferred:
                self._emit("start_degraded", frm=preferred.key, to=active.key, reason=preferred.reason)
        self._closing = False
        self._supervisor = threading.Thread(target=self._supervise, name="edgerun-failover", daemon=True)
        self._supervisor.start()

    def detach(self) -> None:
        """Stop re-probing and leave the pipeline alone; engines stay open (an OTA swap keeps them for rollback).

        ``attach`` takes charge again.
        """
        self._stop_supervisor()
        with self._lock:
            self._serving = None

    def _stop_supervisor(self) -> None:
        self._closing = True
        self._wake.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(5.0)
        self._supervisor = None

    def close(self) -> None:
        """Stop re-probing, close every engine that is not hung, and mark a clean shutdown."""
        if self._closed:
            return
        self._closed = True
        self._stop_supervisor()
        with self._lock:
            self._account_switch(None)
            # Lanes that failed and wait for the supervisor to retire them are closed too.
            lanes = [*self._lanes.values(), *self._to_retire]
            self._lanes.clear()
            self._to_retire = []
            for cand in self.candidates:
                cand.runtime, cand.worker = None, None
        for lane in lanes:
            self._close_lane(lane, wait=True)
        if self._crumbs is not None:
            self._crumbs.release()

    # -- the frame path (infer thread) ---------------------------------------------

    def infer(self, runtime: ModelRuntime, tensor: np.ndarray, outputs: list[np.ndarray]) -> None:
        lane = self._lanes.get(runtime)
        if lane is None:
            if runtime in self._dead:
                raise FrameLost("failover")
            runtime.engine.infer(tensor, outputs)  # a runtime we do not manage (swapped in by OTA)
            return
        if lane.dead:
            raise FrameLost("failover")
        cand = lane.candidate
        worker = lane.worker
        t0 = time.monotonic()
        if worker is None:
            runtime.engine.infer(tensor, outputs)
        else:
            try:
                worker.call(tensor, outputs, cand.deadline_s)
            except EngineHang as err:
                self.fault(lane, f"hang: {err}")
                raise FrameLost("engine_hang") from None
            except Exception as err:
                self.fault(lane, f"{type(err).__name__}: {_first_line(err)}")
                raise FrameLost("engine_error") from None
        cand.record(time.monotonic() - t0)

    def fault(self, lane: _Lane, reason: str) -> None:
        """``lane``'s engine failed mid-stream: retire it and move the pipeline to the best warm candidate."""
        with self._lock:
            if lane.dead:
                return
            lane.dead = True
            self._lanes.pop(lane.runtime, None)
            self._dead.add(lane.runtime)
            self._to_retire.append(lane)
            cand = lane.candidate
            if cand.runtime is lane.runtime:
                cand.runtime, cand.worker = None, None
            cand.failures += 1
            cand.state = FAILED
            cand.reason = reason
            cand.served_since = 0.0
            cand.next_probe = time.monotonic() + self.settings.backoff(cand.failures)
            log.warning("engine %s failed: %s", cand.key, reason)
            if self.active is cand:
                target = self._best_ready()
                if target is not None:
                    self.failovers += 1
                    self._activate(target, reason=f"{cand.key} {reason}")
                else:
                    self.active = None
                    self._update_health()
        self._wake.set()

    # -- internals ----------------------------------------------------------------------

    @property
    def _in_charge(self) -> bool:
        """False once the serving controller has handed the pipeline to another owner (an OTA swap)."""
        serving = self._serving
        return serving is None or serving.in_charge(self)

    def _best_ready(self) -> Candidate | None:
        return next((c for c in self.candidates if c.state == READY and c.runtime is not None), None)

    def _activate(self, target: Candidate, reason: str) -> None:
        """Under the lock: serve ``target`` from the next frame on."""
        previous = self.active
        assert target.runtime is not None
        serving = self._serving
        in_charge = serving is None or serving.activate(self, target.runtime)
        self.active = target
        target.served_since = time.monotonic()
        if previous is not None and previous is not target:
            previous.served_since = 0.0
        self._account_switch(target)
        self._update_health()
        if reason == "start" or not in_charge:
            return
        if previous is not None and target.index < previous.index:
            self.switch_backs += 1
            log.info("engine %s passed its warm-up: serving on it again (was %s)", target.key, previous.key)
            self._emit("switch_back", frm=previous.key, to=target.key, reason=reason)
        else:
            frm = previous.key if previous is not None else ""
            log.warning("failover %s -> %s: %s", frm, target.key, reason)
            self._emit("failover", frm=frm, to=target.key, reason=reason)

    def _account_switch(self, target: Candidate | None) -> None:
        now = time.monotonic()
        in_fallback = target is not None and target is not self.preferred
        if self._fallback_since is not None and not in_fallback:
            self._fallback_total_s += now - self._fallback_since
            self._fallback_since = None
        elif self._fallback_since is None and in_fallback:
            self._fallback_since = now

    def _update_health(self) -> None:
        if self._health is None or not self._in_charge:
            return
        preferred, active = self.preferred, self.active
        if active is preferred:
            self._health.clear_problem("engine")
            return
        if active is None:
            self._health.set_problem("engine", f"no engine can serve: {preferred.key} {preferred.reason}")
            return
        reason = f"serving on {active.key}: {preferred.key} {preferred.reason}"
        if preferred.state == FAILED and preferred.next_probe < math.inf:
            reason += f"; re-probe in {max(0.0, preferred.next_probe - time.monotonic()):.1f} s"
        self._health.set_problem("engine", reason)

    def _emit(self, event: str, *, frm: str, to: str, reason: str) -> None:
        if self._on_event is None:
            return
        data = {
            "event": event,
            "from": frm,
            "to": to,
            "reason": reason,
            "failovers": self.failovers,
            "fallback_s": round(self.fallback_seconds(), 3),
        }
        try:
            self._on_event("engine", data)
        except Exception:
            log.exception("engine event listener failed")

    def _premake_buffers(self, runtime: ModelRuntime) -> None:
        """Make what a standby needs in the pipeline now, so a failover to it allocates nothing."""
        if self._serving is not None:
            self._serving.prepare(runtime)

    # -- probing (start, then the supervisor thread) -------------------------------------

    def _probe(self, cand: Candidate, at_start: bool = False) -> None:
        """Open ``cand`` afresh and warm it up; on success it becomes a warm candidate."""
        inflight = None if cand.last_resort or self._crumbs is None else self._crumbs.inflight(cand.key)
        try:
            runtime, worker, times = self._open_and_warm(cand, inflight)
        except ModelError as err:
            cand.state, cand.reason = BROKEN, _first_line(err)
            cand.next_probe = math.inf
            if not (at_start and cand.last_resort and not any(c.state == READY for c in self.candidates)):
                log.warning("engine %s cannot load the model: %s", cand.key, cand.reason)  # else start() raises it
            return
        except Exception as err:
            with self._lock:
                cand.state = FAILED
                cand.failures += 1
                cand.reason = _first_line(err) if isinstance(err, EngineError) else f"{type(err).__name__}: {err}"
                cand.next_probe = time.monotonic() + self.settings.backoff(cand.failures)
                if not at_start:
                    self._update_health()
            log.warning(
                "engine %s unavailable: %s; re-probe in %.1f s",
                cand.key,
                cand.reason,
                cand.next_probe - time.monotonic(),
            )
            return
        with self._lock:
            if self._closing:
                self._close_lane(_Lane(cand, runtime, worker), wait=False)
                return
            cand.seed(times)
            cand.runtime, cand.worker = runtime, worker
            cand.state, cand.reason = READY, ""
            cand.next_probe = math.inf
            self._lanes[runtime] = _Lane(cand, runtime, worker)
            self._premake_buffers(runtime)
            if not at_start:
                log.info("engine %s passed its warm-up (p99 %.1f ms)", cand.key, cand.p99_ms)
                if self.active is None or cand.index < self.active.index:
                    self._activate(cand, reason="recovered")
                else:
                    self._update_health()

    def _open_and_warm(
        self, cand: Candidate, inflight: InFlight | None
    ) -> tuple[ModelRuntime, EngineWorker | None, list[float]]:
        def open_it() -> ModelRuntime:
            if inflight is None:
                return self._open_runtime(cand.key)
            with inflight:
                return self._open_runtime(cand.key)

        runtime: ModelRuntime = call_with_timeout(
            open_it, OPEN_TIMEOUT_S, f"edgerun-open-{cand.key}", on_late=lambda late: late.engine.close()
        )
        engine = runtime.engine
        worker = None if cand.last_resort else EngineWorker(engine, cand.key, inflight)
        tensor = engine.allocate_input()
        tensor.fill(engine.input_spec.zero_point if engine.input_spec.quantised else 0)
        outputs = engine.allocate_outputs()
        times: list[float] = []
        try:
            for _ in range(WARMUP_FRAMES):
                t0 = time.monotonic()
                if worker is None:
                    engine.infer(tensor, outputs)
                else:
                    worker.call(tensor, outputs, WARMUP_TIMEOUT_S)
                times.append(time.monotonic() - t0)
        except BaseException:
            self._close_lane(_Lane(cand, runtime, worker), wait=False)
            raise
        return runtime, worker, times[1:] or times  # the first call builds caches: not a sample

    def _supervise(self) -> None:
        while not self._closing:
            self._wake.wait(self._next_wake())
            self._wake.clear()
            if self._closing:
                break
            try:
                self._retire_dead()
                self._probe_due()
                self._forgive_stable()
            except Exception:
                log.exception("failover supervisor step failed")

    def _next_wake(self) -> float:
        now = time.monotonic()
        due = min((c.next_probe for c in self.candidates if c.state == FAILED), default=math.inf)
        return max(0.01, min(1.0, due - now))

    def _retire_dead(self) -> None:
        with self._lock:
            lanes, self._to_retire = self._to_retire, []
        for lane in lanes:
            serving = self._serving
            if serving is not None and not serving.retire(lane.runtime, self.settings.retire_timeout_s):
                log.warning("frames for the failed %s engine did not drain; retiring it anyway", lane.candidate.key)
            self._close_lane(lane, wait=False)

    def _probe_due(self) -> None:
        now = time.monotonic()
        for cand in self.candidates:
            if self._closing:
                return
            if cand.state == FAILED and cand.next_probe <= now:
                self._probe(cand)

    def _forgive_stable(self) -> None:
        """A candidate that served cleanly for ``reprobe_max_s`` starts its backoff and crash count afresh."""
        active = self.active
        if active is None or not active.served_since:
            return
        if time.monotonic() - active.served_since < self.settings.reprobe_max_s:
            return
        if active.failures:
            active.failures = 0
        if self._crumbs is not None and active.key in self._crumbs.crashes:
            self._crumbs.forgive(active.key)

    def _close_lane(self, lane: _Lane, wait: bool) -> None:
        """Close a lane's engine; a hung engine is left alone (closing it could hang as well)."""
        worker = lane.worker
        if worker is not None and worker.abandoned:
            return
        if worker is not None:
            worker.close()
        engine = lane.runtime.engine
        inflight = worker.inflight if worker is not None else None

        def close_it() -> None:
            if inflight is None:
                engine.close()
                return
            with inflight:
                engine.close()

        try:
            if wait:
                call_with_timeout(close_it, 5.0, f"edgerun-close-{lane.candidate.key}")
            else:
                threading.Thread(target=close_it, name=f"edgerun-close-{lane.candidate.key}", daemon=True).start()
        except Exception as err:
            log.warning("closing engine %s failed: %s", lane.candidate.key, err)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__

"""The stage threads: capture -> preprocess -> infer -> decode, joined by hand-offs.

Flow control works like MediaPipe's flow limiter: the only place a frame is
dropped is between capture and preprocess (policy ``drop_oldest`` by default).
Downstream hand-offs block, and each stage waits for room downstream *before*
taking its next input, so it always picks the freshest captured frame and no
stage burns CPU on a frame that would be thrown away. With ``block`` the
capture stage itself waits (offline files lose nothing).

Layouts (``PipelineSettings.stage_threads``): ``separate`` is a thread per
stage, with one infer thread per engine replica; ``fused`` is one worker
thread per replica doing preprocess, infer and decode of a whole frame (with
``block``, and for paced replays, the workers also read their frames, so there
is no capture thread; a paced replay's stale frames are skipped undecoded).
``auto`` fuses when a CPU engine covers every core and keeps separate threads
for accelerators; after a failover to a CPU engine the separate layout's infer
threads take whole frames too. Workers finish out of order; ``InOrder`` hands
batches on in frame order.

OpenCV, numpy and the interpreters release the GIL, so the threads overlap.
Finished batches enter the asyncio loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import cv2
import numpy as np

from edgerun.backoff import backoff_delay
from edgerun.decoders.base import output_fault
from edgerun.engines.runtime import FrameLost, ModelRuntime, ProblemReporter, ServeLocally
from edgerun.errors import SourceError
from edgerun.pipeline.admission import REMOTE, EngineSlots
from edgerun.pipeline.pool import BLOCK, DROP_NEWEST, FramePool, FrameSlot, Handoff
from edgerun.pipeline.stats import PipelineStats
from edgerun.sources.base import Source
from edgerun.types import DetectionBatch, Detections

log = logging.getLogger(__name__)

# Reconnect delays: nodes that lost one camera server must not all retry it in step.
_jitter = random.Random().uniform
# How long finished batches wait, at most, for an earlier frame whose call has not returned.
ORDER_WAIT_S = 5.0


def _name_native_thread(name: str) -> None:
    """Name the OS thread (``top -H``, ``ps -L``, /proc/*/task/*/comm) so operators see the stages."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class InferGuard(Protocol):
    """Runs the infer stage's engine calls for the pipeline (the node's ``ServingController``, which hands
    them to the ``edgerun.engines.failover.Failover`` in charge).

    It may call the engine through a watched worker, switch the pipeline to
    another runtime on a fault, and raise ``FrameLost`` for frames it dropped.
    """

    def infer(self, runtime: ModelRuntime, tensor: np.ndarray, outputs: list[np.ndarray]) -> None: ...


class RemoteInfer(Protocol):
    """Sends a frame to a helper and returns its detections (``edgerun.offload.lane.OffloadLane``).

    Called from a worker that holds a remote slot (``EngineSlots``), with the frame letterboxed to the
    model input. Returns the detections, normalised to the model input as a decoder's are, and the
    helper's name; raises ``FrameLost`` for a frame that was sent and is gone (late, lost: counted) and
    ``ServeLocally`` for one no helper took (the local engine serves it).
    """

    def infer(self, pixels: np.ndarray, slot: FrameSlot) -> tuple[Detections, str]: ...


@dataclass(slots=True)
class PipelineSettings:
    queue_depth: int = 1
    policy: str = "drop_oldest"
    pace_fps: float = 0.0  # pace synthetic-clock sources; 0 = as fast as they go
    reopen_backoff_s: float = 0.5
    reopen_backoff_max_s: float = 10.0
    snapshot_interval_s: float = 1.0
    # "separate": one thread per stage (one infer thread per replica). "fused": a worker per
    # replica does preprocess, infer and decode of a frame. "auto": fused when the engine already
    # runs CPU threads on every core, where separate stages only steal cores from it (docs/architecture.md).
    stage_threads: str = "auto"
    # Frames worked on at once: fused workers, or infer threads in the separate layout.
    # 0: as many as the engine takes concurrent calls (its CPU replicas).
    workers: int = 0
    # Later batches wait at most this long for a frame whose call has not returned (see InOrder).
    order_wait_s: float = ORDER_WAIT_S


def _concurrent_calls(runtime: ModelRuntime) -> int:
    return max(1, int(getattr(runtime.engine, "concurrent_calls", 1)))


def engine_cpu_threads(engine: object) -> int:
    """CPU threads an engine computes on (0 for accelerators that leave the CPU free)."""
    return int(getattr(engine, "cpu_threads", 0))


class InOrder:
    """Hands finished batches on in the order their frames were taken, whichever worker finished first.

    Several workers finish frames out of order; consumers (trackers, gossip
    dedup, anyone reading the JSONL) expect frame order. Every frame that got a
    ticket must be finished, with ``None`` when it was lost.

    The wait for a frame is bounded: a call that never returns (the CPU last
    resort has no hang deadline) must not hold every later batch forever. When
    a later frame finishes while the oldest outstanding one has been out for
    more than ``max_wait_s``, that one is given up (``on_overdue``, counted as
    lost) and the batches behind it go on; if it finishes after all, its batch
    is discarded. ``give_up`` hands on everything held (a shutdown that could
    not drain). ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        emit: Callable[[DetectionBatch], object],
        *,
        max_wait_s: float = ORDER_WAIT_S,
        on_overdue: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._next_ticket = 0
        self._issued = 0
        self._waiting: dict[int, DetectionBatch | None] = {}
        self._taken_at: dict[int, float] = {}
        self.max_wait_s = max_wait_s
        self._on_overdue = on_overdue
        self._clock = clock
        self.overdue = 0
        self.discarded = 0

    def ticket(self) -> int:
        """The next ticket; callers issue tickets from one thread or under their own lock."""
        ticket = self._issued
        self._issued += 1
        self._taken_at[ticket] = self._clock()
        return ticket

    def finish(self, ticket: int, batch: DetectionBatch | None) -> None:
        with self._lock:
            self._taken_at.pop(ticket, None)
            if ticket < self._next_ticket:
                self.discarded += 1  # given up on while it was out: already counted as lost
                return
            if ticket != self._next_ticket:
                self._waiting[ticket] = batch
                self._give_up_overdue()
                return
            if batch is not None:
                self._emit(batch)
            self._next_ticket += 1
            self._hand_on_held()
            self._give_up_overdue()

    def give_up(self) -> None:
        """Hand on every held batch now, skipping the frames still out (they count as overdue)."""
        with self._lock:
            while self._waiting:
                self._skip_head()
                self._hand_on_held()

    def _hand_on_held(self) -> None:
        while self._next_ticket in self._waiting:  # the ones that finished early
            held = self._waiting.pop(self._next_ticket)
            if held is not None:
                self._emit(held)
            self._next_ticket += 1

    def _give_up_overdue(self) -> None:
        """Under the lock, with batches held: skip the head of the line while it is overdue."""
        while self._waiting:
            taken = self._taken_at.get(self._next_ticket)
            if taken is None or self._clock() - taken <= self.max_wait_s:
                return
            self._skip_head()
            self._hand_on_held()

    def _skip_head(self) -> None:
        ticket = self._next_ticket
        self._taken_at.pop(ticket, None)
        self._next_ticket += 1
        self.overdue += 1
        if self._on_overdue is not None:
            self._on_overdue(ticket)


class Snapshot:
    """The latest frame with its detections, copied at most every ``interval`` seconds."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.lock = threading.Lock()
        self.image: np.ndarray | None = None
        self.batch: DetectionBatch | None = None
        self._last = 0.0

    def due(self, now: float) -> bool:
        return now - self._last >= self.interval

    def take(self, slot: FrameSlot, batch: DetectionBatch, now: float) -> None:
        with self.lock:
            if self.image is None or self.image.shape != slot.image.shape:
                self.image = slot.image.copy()
            else:
                self.image[...] = slot.image
            self.batch = batch
        self._last = now


class Pipeline:
    """Runs one source through one engine and decoder; hands batches to ``on_batch``."""

    def __init__(
        self,
        *,
        node_id: str,
        source: Source,
        runtime: ModelRuntime,
        on_batch: Callable[[DetectionBatch], object],  # what it returns is ignored
        settings: PipelineSettings,
        health: ProblemReporter | None = None,
        stats: PipelineStats | None = None,
        infer_guard: InferGuard | None = None,
    ) -> None:
        self.node_id = node_id
        self.source = source
        self.runtime = runtime
        self.on_batch = on_batch
        self.settings = settings
        self.health = health
        self.infer_guard = infer_guard
        self.stats = stats or PipelineStats()
        self.snapshot = Snapshot(settings.snapshot_interval_s)
        # edgerun.fleet.find_images.FindCropper when the swarm wants pictures of finds (set once serving)
        self.find_cropper: Any = None
        # edgerun.offload.lane.OffloadLane when the node may send frames to a helper (set once serving); the
        # lane opens the remote slots of ``engine_slots`` while a helper is chosen.
        self.offload: RemoteInfer | None = None
        self.workers = settings.workers or max(1, int(getattr(runtime.engine, "concurrent_calls", 1)))
        # Copies 0..workers-1 belong to the workers (fused) or infer threads; copy ``workers`` to the
        # preprocess and decode threads of the separate layout, which run beside them.
        self._stage_copy = self.workers
        # on_batch may be replaced later, hence the lambda
        self._in_order = InOrder(
            lambda batch: self.on_batch(batch), max_wait_s=settings.order_wait_s, on_overdue=self._overdue
        )
        self._take_lock = threading.Lock()  # fused workers take a frame and its ticket together
        # A worker holds one of the serving engine's call slots before it takes a frame (see admission).
        self.engine_slots = EngineSlots(_concurrent_calls(runtime), self.workers)
        self._running_workers = self.workers
        self._capture_done = False
        self._workers_lock = threading.Lock()
        depth = settings.queue_depth
        # Every slot a stage can hold or a hand-off can queue, plus one so capture never waits on the pool.
        size = 4 + 2 * (self.workers - 1) + 3 * depth + 1
        self.pool = FramePool(size, self._make_slot)
        self.prepare(runtime)
        self._to_preprocess = Handoff(depth, settings.policy, self._dropped_at("capture"))
        self._to_infer = Handoff(depth, BLOCK, self._dropped_at("preprocess"))
        self._to_decode = Handoff(depth, BLOCK, self._dropped_at("infer"))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.finished = threading.Event()  # set when the decode stage has drained
        self.end_of_stream = threading.Event()
        self._source_open = True
        self._source_error = ""
        self._cores = os.cpu_count() or 1
        if settings.stage_threads == "auto":
            self.fused = self._cpu_bound(runtime)
        else:
            self.fused = settings.stage_threads == "fused"
        self.whole_frames = 0  # frames an infer thread of the separate layout took end to end (see _infer_loop)
        # Files and replays go as fast as they decode unless paced at pace_fps on their own clock.
        self._period = 1.0 / settings.pace_fps if settings.pace_fps > 0 and source.synthetic_clock else 0.0
        # Fused workers read their next frame themselves, in turn, where a capture thread would
        # only add a hand-off (two thread wake-ups a frame): with policy block nothing is ever
        # dropped, and a paced replay's frames fall due on its own clock, so the frames that fell
        # due while every worker was busy are skipped without being decoded (``Source.skip``)
        # instead of read only to be dropped. Live cameras keep the capture thread, which drains
        # the device and drops stale frames.
        self.inline_capture = self.fused and (settings.policy == BLOCK or self._period > 0)
        self._skip_stale = self.inline_capture and settings.policy != BLOCK

    def _make_slot(self, index: int) -> FrameSlot:
        slot = FrameSlot(index=index, image=np.zeros((self.source.height, self.source.width, 3), np.uint8))
        slot.buffers_for(self.runtime)
        return slot

    def swap_runtime(self, new: ModelRuntime) -> ModelRuntime:
        """Serve ``new`` from the next frame on; returns the old runtime (still finishing its frames).

        Tensor buffers for ``new`` are made here, before the swap, so the frame
        path never allocates. Call ``retire`` before closing the old engine.
        """
        self.prepare(new)
        old, self.runtime = self.runtime, new
        self.engine_slots.resize(_concurrent_calls(new))
        return old

    def prepare(self, runtime: ModelRuntime) -> None:
        """Make what serving ``runtime`` needs (every slot's tensor buffers, every thread's
        preprocessor and decoder), so swapping to it later allocates nothing."""
        runtime.ensure_workers(self.workers + 1)
        for slot in self.pool.slots:
            slot.buffers_for(runtime)

    def retire(self, old: ModelRuntime, timeout: float) -> bool:
        """Wait until no frame in flight uses ``old``, then drop its buffers; False on timeout."""
        end = time.monotonic() + timeout
        while any(slot.runtime is old for slot in self.pool.slots):
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        for slot in self.pool.slots:
            slot.forget(old)
        return True

    def _overdue(self, ticket: int) -> None:
        """A frame's call has not returned in ``order_wait_s``: the batches behind it go on without it."""
        self.stats.drop("infer", "overdue")
        log.warning(
            "a frame has been in inference for over %.1f s; later frames are published without it",
            self.settings.order_wait_s,
        )

    def _dropped_at(self, stage: str) -> Callable[[FrameSlot, str], None]:
        def on_drop(slot: FrameSlot, reason: str) -> None:
            self.stats.drop(stage, reason)
            ticket = slot.ticket
            self.pool.release(slot)
            if ticket >= 0:
                self._in_order.finish(ticket, None)

        return on_drop

    # -- lifecycle -----------------------------------------------------------

    def start(self, source_open: bool = True, source_error: str = "") -> None:
        """Start the stage threads; with ``source_open=False`` capture begins by (re)opening the source
        (``source_error``: why it did not open, kept as the health reason)."""
        self._source_open = source_open
        self._source_error = source_error
        self._next_due = time.monotonic()
        self._seq = 0
        self._source_failures = 0  # failed reads and opens since the last frame: the backoff's exponent
        self._opened_at = time.monotonic()
        self._captured_at_open = 0
        if self.workers >= self._cores:
            # Every core already has a worker on a frame of its own; OpenCV's thread pool splitting a
            # small resize across cores would only add wake-ups (measured: +8 % BlazeFace fps with
            # one OpenCV thread, median of 8 interleaved rounds). Process-wide, like the workers.
            cv2.setNumThreads(1)
        workers = range(self.workers)
        numbered = self.workers > 1
        stages: list[tuple[str, Callable[[], None]]] = []
        if not self.inline_capture:
            stages.append(("capture", self._capture_loop))
        if self.fused:
            stages += [(f"worker{i}" if numbered else "worker", self._worker(self._fused_loop, i)) for i in workers]
        else:
            stages.append(("preprocess", self._preprocess_loop))
            stages += [(f"infer{i}" if numbered else "infer", self._worker(self._infer_loop, i)) for i in workers]
            stages.append(("decode", self._decode_loop))
        for name, target in stages:
            # Daemon threads: a driver that hangs inside infer must not keep the process alive at exit.
            thread = threading.Thread(target=self._guard(name, target), name=f"edgerun-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _guard(self, name: str, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            _name_native_thread(f"edgerun-{name}")
            try:
                target()
            except Exception:
                log.exception("%s stage crashed", name)
                if self.health is not None:
                    self.health.set_problem("pipeline", f"{name} stage crashed")
                self._stop.set()
                for handoff in (self._to_preprocess, self._to_infer, self._to_decode):
                    handoff.close()
                if name == "decode" or name.startswith("worker"):
                    self.finished.set()

        return run

    def _worker(self, loop: Callable[[int], None], index: int) -> Callable[[], None]:
        return lambda: loop(index)

    def _last_worker_out(self) -> bool:
        """Called as each worker ends; True for the last one (it closes what follows)."""
        with self._workers_lock:
            self._running_workers -= 1
            return self._running_workers == 0

    def stop(self) -> None:
        """Stop capturing; frames already captured still flow through to ``on_batch``."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait for the frames in flight to drain; False if a stage did not finish in time (what
        finished behind a frame still out is handed on anyway)."""
        if self.finished.wait(timeout):
            return True
        self._in_order.give_up()
        return False

    # -- stages --------------------------------------------------------------

    def _capture_loop(self) -> None:
        try:
            while (slot := self._next_frame()) is not None:
                self._to_preprocess.put(slot)
        finally:
            self._to_preprocess.close()

    def _next_frame(self) -> FrameSlot | None:
        """Pace, take a slot and read the next frame into it; None once stopped or at end of stream.

        Called by the capture thread, or by a worker holding ``_take_lock`` (inline capture):
        the capture state below has one user at a time.
        """
        stats, source, settings = self.stats, self.source, self.settings
        if not self._source_open:
            self._source_open = True
            reason = self._source_error or f"source {source.KEY} not available at start"
            self._reopen(reason)
        period = self._period
        while not self._stop.is_set():
            due, skip_before, skip_after = 0.0, 0, 0
            if period:
                delay = self._next_due - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    break
                due, now = self._next_due, time.monotonic()
                if self._skip_stale:
                    # Every frame due by now besides one is stale: drop_oldest takes the newest
                    # (skipping the others first), drop_newest the oldest (skipping the others after).
                    stale = int((now - due) / period)
                    self._next_due = due + (stale + 1) * period
                    if settings.policy == DROP_NEWEST:
                        skip_after = stale
                    else:
                        skip_before = stale
                        due += stale * period
                else:
                    # Behind by more than a frame (slow start, a stall): resync instead of bursting.
                    self._next_due = max(due + period, now - period)
            slot = self.pool.acquire(timeout=0.5)
            if slot is None:
                continue
            t0 = time.monotonic()
            try:
                if skip_before:
                    self._skip(skip_before)
                t_read = time.monotonic()
                meta = source.read(slot.image, self._seq)
                if skip_after and meta is not None:
                    self._skip(skip_after)
            except SourceError as err:
                self.pool.release(slot)
                stats.source_errors += 1
                self._reopen(str(err))
                continue
            if meta is None:
                self.pool.release(slot)
                self.end_of_stream.set()
                return None
            self._source_failures = 0
            stats.stages["capture"].record(time.monotonic() - t0)
            if self._skip_stale and t_read > due:
                # Read on demand after it fell due: back-date it by the time it waited, as if a
                # capture thread had read it when it fell due (the read itself counts, as for a camera).
                meta.wall_time -= t_read - due
                meta.t_capture -= t_read - due
            slot.meta = meta
            slot.t_read = t_read
            self._seq += 1
            stats.captured += 1
            return slot
        return None

    def _skip(self, count: int) -> None:
        """Skip ``count`` stale frames of a paced replay; they count as captured and dropped at
        capture and use up their sequence numbers, as when a capture thread read and dropped them."""
        skipped = self.source.skip(count)
        self._seq += skipped
        self.stats.captured += skipped
        self.stats.drop("capture", self.settings.policy, skipped)

    def _frame_rate(self) -> float:
        """The source's frame rate: its nominal one, else what it delivered since it was last opened."""
        if self.source.fps > 0:
            return self.source.fps
        elapsed = time.monotonic() - self._opened_at
        frames = self.stats.captured - self._captured_at_open
        return frames / elapsed if elapsed > 1.0 and frames > 1 else 0.0

    def _reopen(self, reason: str) -> None:
        """Close and reopen the source, with jittered exponential backoff, until it works or we are stopped.

        The node stays up and ``degraded`` with the reason meanwhile; once the source is back, the frames
        it would have delivered during the outage are counted as lost (``source_lost``).
        """
        settings, stats = self.settings, self.stats
        log.warning("source failed: %s; reconnecting", reason)
        if self.health is not None:
            self.health.set_problem("source", reason)
        rate, failed_at = self._frame_rate(), time.monotonic()
        self.source.close()
        while not self._stop.wait(
            backoff_delay(self._source_failures, settings.reopen_backoff_s, settings.reopen_backoff_max_s, _jitter)
        ):
            self._source_failures += 1
            try:
                self.source.open()
            except Exception as err:
                if self.health is not None:
                    self.health.set_problem("source", f"{reason}; reconnect failed: {err}")
                continue
            self._opened_at = now = time.monotonic()
            self._captured_at_open = stats.captured
            outage = now - failed_at
            lost = round(outage * rate)
            stats.source_reconnects += 1
            stats.source_lost += lost
            stats.source_outage_s = outage
            log.info("source back after %.2f s (%d tries); about %d frames lost", outage, self._source_failures, lost)
            if self.health is not None:
                self.health.clear_problem("source")
            return

    # Per-frame steps, shared by the separate stage threads and the fused worker.

    def _cpu_bound(self, runtime: ModelRuntime) -> bool:
        """True when ``runtime``'s engine computes on every core: then a frame is best done on one thread."""
        return engine_cpu_threads(runtime.engine) >= self._cores

    def _preprocess_one(self, slot: FrameSlot, worker: int, bind: bool = True) -> None:
        t0 = time.monotonic()
        if bind:
            slot.bind(self.runtime)  # read once: a swap takes effect between frames
        slot.runtime.preprocessors[worker](slot.image, slot.tensor)
        slot.t_preprocessed = t1 = time.monotonic()
        with self.stats.lock:
            self.stats.stages["preprocess"].record(t1 - t0)

    def _infer_one(self, slot: FrameSlot) -> bool:
        """Run the model; False when the frame was lost (counted, slot released)."""
        stats = self.stats
        runtime = slot.runtime
        engine = runtime.engine
        guard = self.infer_guard
        t0 = time.monotonic()
        try:
            tensor = slot.tensor
            assert tensor is not None  # preprocess bound the slot to this runtime's buffers
            with runtime.serial:
                if guard is None:
                    engine.infer(tensor, slot.outputs)
                else:
                    guard.infer(runtime, tensor, slot.outputs)
        except FrameLost as lost:
            self._lose(slot, lost.reason)
            return False
        except Exception as err:
            self._lose(slot, "error")
            self._log_infer_error(err)
            return False
        slot.t_inferred = t1 = time.monotonic()
        slot.engine_key = engine.KEY
        with stats.lock:
            stats.stages["infer"].record(t1 - t0)
            stats.inferred += 1
            stats.last_inference = t1
        return True

    def _infer_remote(self, slot: FrameSlot, worker: int) -> bool | None:
        """Send the frame to the helper; True when its detections came back, False when the frame was lost
        (counted, slot released), None when no helper took it and the local engine is to serve it."""
        offload = self.offload
        slot.remote = False
        if offload is None:
            return None
        stats = self.stats
        t0 = time.monotonic()
        pixels = slot.runtime.preprocessors[worker].letterboxed(slot.image)
        slot.t_preprocessed = t1 = time.monotonic()
        try:
            detections, helper = offload.infer(pixels, slot)
        except ServeLocally:
            return None
        except FrameLost as lost:
            self._lose(slot, lost.reason)
            return False
        except Exception as err:  # a fault in the lane loses this frame, never the worker
            self._lose(slot, "error")
            self._log_infer_error(err)
            return False
        slot.remote = True
        slot.remote_detections = detections
        slot.t_inferred = t2 = time.monotonic()
        slot.engine_key = f"remote:{helper}"
        with stats.lock:
            stats.stages["preprocess"].record(t1 - t0)
            stats.stages["offload"].record(t2 - t1)
            stats.inferred += 1
            stats.offloaded += 1
            stats.last_inference = t2
        return True

    def _lose(self, slot: FrameSlot, reason: str) -> None:
        self.stats.drop("infer", reason)
        ticket = slot.ticket
        self.pool.release(slot)
        self._in_order.finish(ticket, None)

    def _decode_one(self, slot: FrameSlot, worker: int) -> None:
        t0 = time.monotonic()
        runtime = slot.runtime
        decoder, model, letterbox = runtime.decoders[worker], runtime.model, runtime.preprocessor.letterbox
        remote = slot.remote_detections
        # A frame a helper served comes back decoded (normalised to the model input, as a decoder returns).
        detections = remote if remote is not None else decoder.decode(slot.outputs)
        fault = output_fault(detections, len(model.labels) or decoder.label_count or 0)
        if fault is not None:
            self._bad_output(slot, fault)
            return
        letterbox.boxes_to_source(detections.boxes)
        if detections.keypoints is not None:
            letterbox.to_source(detections.keypoints)
        meta = slot.meta
        assert meta is not None
        batch = DetectionBatch(
            node_id=self.node_id,
            meta=meta,
            detections=detections,
            labels=model.labels,
            model_name=model.name,
            model_version=model.version,
            engine=slot.engine_key,
            stamps={"read": slot.t_read, "preprocessed": slot.t_preprocessed, "inferred": slot.t_inferred},
            trace=slot.trace,  # begun by the worker that sent the frame to a helper (its request named it)
        )
        t1 = time.monotonic()
        batch.stamps["decoded"] = t1
        stats = self.stats
        with stats.lock:
            stats.stages["decode"].record(t1 - t0)
            stats.detections += len(detections)
        if self.snapshot.due(t1):
            self.snapshot.take(slot, batch, t1)
        cropper = self.find_cropper
        if cropper is not None and len(detections):
            batch.crops = cropper.crop(slot.image, batch)  # small copies: the slot goes back to the pool now
        ticket = slot.ticket
        self.pool.release(slot)
        self._in_order.finish(ticket, batch)

    def _bad_output(self, slot: FrameSlot, fault: str) -> None:
        """A frame whose decoded output is no valid payload: dropped, counted, logged 1st and every 1000th."""
        self.stats.drop("decode", "bad_output")
        count = self.stats.dropped[("decode", "bad_output")]
        if count == 1 or count % 1000 == 0:
            log.error("model output not publishable (%d frame(s) so far): %s", count, fault)
        ticket = slot.ticket
        self.pool.release(slot)
        self._in_order.finish(ticket, None)

    # Stage loops. Each waits for room downstream before taking its next input.

    def _preprocess_loop(self) -> None:
        inp, out = self._to_preprocess, self._to_infer
        # Separate threads suit an accelerator, which leaves the CPU to the other stages. When a
        # CPU engine serves instead (after a failover to the CPU fallback), the infer threads take
        # each frame end to end, as fused workers do, and this thread only hands frames on.
        adaptive = self.settings.stage_threads == "auto"
        try:
            while out.wait_for_room():
                slot = inp.get()
                if slot is None:
                    break
                slot.ticket = self._in_order.ticket()
                runtime = self.runtime
                if adaptive and self._cpu_bound(runtime):
                    slot.bind(runtime)
                    slot.whole = True
                else:
                    self._preprocess_one(slot, self._stage_copy)
                out.put(slot)
        finally:
            out.close()

    def _infer_loop(self, worker: int) -> None:
        inp, out, slots = self._to_infer, self._to_decode, self.engine_slots
        try:
            while out.wait_for_room():
                token = slots.acquire()
                try:
                    slot = inp.get()
                    if slot is None:
                        break
                    slot.remote = token == REMOTE
                    if slot.whole:
                        with self.stats.lock:
                            self.whole_frames += 1
                        self._whole_frame(slot, worker, bind=False)
                        continue
                    inferred = self._infer_remote(slot, worker) if slot.remote else None
                    if inferred is None:
                        inferred = self._infer_one(slot)
                finally:
                    slots.release(token)
                if inferred:
                    out.put(slot)
        finally:
            if self._last_worker_out():
                out.close()

    def _log_infer_error(self, err: Exception) -> None:
        count = self.stats.dropped[("infer", "error")]
        if count == 1 or count % 1000 == 0:  # log the first, then every 1000th
            log.error("inference failed (%d so far): %s", count, err)
        if self.health is not None:
            self.health.set_problem("engine", f"inference failing: {err}")

    def _decode_loop(self) -> None:
        inp = self._to_decode
        try:
            while (slot := inp.get()) is not None:
                self._decode_one(slot, self._stage_copy)
        finally:
            self.finished.set()

    def _whole_frame(self, slot: FrameSlot, worker: int, bind: bool = True) -> None:
        """Preprocess, infer and decode one frame on this thread, with ``worker``'s copies (or send it to the
        helper when the worker holds a remote slot)."""
        if slot.remote:
            if bind:
                slot.bind(self.runtime)
            done = self._infer_remote(slot, worker)
            if done is not None:
                if done:
                    self._decode_one(slot, worker)
                return
            bind = False
        self._preprocess_one(slot, worker, bind=bind)
        if self._infer_one(slot):
            self._decode_one(slot, worker)

    def _read_inline(self) -> FrameSlot | None:
        """The next frame straight from the source (inline capture; under ``_take_lock``)."""
        if self._capture_done:
            return None
        slot = self._next_frame()
        if slot is None:
            self._capture_done = True
        return slot

    def _fused_loop(self, worker: int) -> None:
        """Whole frames on one thread; ``workers`` of these run side by side.

        Frames come from the capture hand-off, or with inline capture straight
        from the source, one reader at a time.
        """
        take = self._read_inline if self.inline_capture else self._to_preprocess.get
        slots = self.engine_slots
        try:
            while True:
                token = slots.acquire()
                try:
                    with self._take_lock:  # tickets in the order frames are taken
                        slot = take()
                        if slot is None:
                            break
                        slot.ticket = self._in_order.ticket()
                    slot.remote = token == REMOTE
                    self._whole_frame(slot, worker)
                finally:
                    slots.release(token)
        finally:
            if self._last_worker_out():
                self._to_preprocess.close()  # inline capture: nothing else closes it
                self.finished.set()

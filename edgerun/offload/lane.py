"""The origin's side of offloading: which helper, which frames go to it, and what a failure costs.

The pipeline's ``EngineSlots`` has a remote lane as wide as the window while a helper is chosen (none
otherwise). A worker holding a remote slot calls ``OffloadLane.infer`` with its frame letterboxed to the
model input; the frame goes to the helper through ``OffloadClient`` on the node's loop and the worker
waits for the detections, at most the per-frame deadline. So the window bounds what is in flight, and
the deadline what a helper that goes silent can cost.

When a helper is used (``update``, once a second on the loop):

* ``always``: whenever one serves this model;
* ``auto``: while the source delivers more than ``engage_load`` of what the local engine can do (its
  calls at once over its measured time per frame) until it drops below ``release_load`` (hysteresis: the
  local engine's time is measured on the frames it serves, so the helper's share does not feed back into
  the decision). An accelerator that fails over to a slow CPU fallback engages it; so does a source
  faster than the engine. With ``auto`` the local engine is preferred and the helper takes the frames
  that would have waited for it, unless the helper's estimated latency beats the local engine's by
  ``PREFER_MARGIN`` (then the helper first, the local engine takes the overflow).

Which helper: ``HelperChooser`` (lowest estimated latency from probe round trips and advertised time per
frame and queue, with hysteresis and per-helper backoff).

A chosen helper is connected to before any frame goes to it (``OffloadClient.connect``): a lost SYN costs
TCP's 1 s initial retransmission there, not a deadline's worth of frames, and a helper that cannot be reached
is backed off without a frame spent on it.

Failures, each counted (``counts``):

* lost (the connection broke with the frame in flight: a helper killed or gone), refused (no
  connection), model (it no longer serves this model), error, protocol: the helper is dropped at once
  (backed off in the chooser) and the remote lane closes, so every later frame is served locally;
  a frame that was in flight is lost and counted, a frame that was never taken is served locally;
* late, expired (no reply within the deadline, or the helper found the deadline spent): the frame is
  dropped and counted; two in a row drop the helper (one late frame on a lossy link is no verdict);
* busy, window: the frame is served locally; ``BUSY_STREAK`` busy answers in a row drop the helper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

from edgerun.config import OffloadConfig
from edgerun.engines.runtime import FrameLost, ServeLocally
from edgerun.offload import codec
from edgerun.offload.chooser import HelperCandidate, HelperChooser, estimated_latency_ms
from edgerun.offload.client import OffloadClient
from edgerun.offload.protocol import InferRequest, OffloadError, OffloadProtocolError, reply_to_detections
from edgerun.pipeline.admission import EngineSlots
from edgerun.types import Detections

log = logging.getLogger(__name__)

LATE_STREAK = 2  # late frames in a row that drop a helper
BUSY_STREAK = 3  # "busy" answers in a row that drop a helper
PREFER_MARGIN = 0.7  # auto prefers a helper whose estimated latency is below this share of the local engine's
# The worker waits this much past the deadline for the loop to hand back the client's verdict (a busy loop).
GRACE_S = 0.25
_DROP_NOW = frozenset({"lost", "refused", "model", "error", "protocol"})
_FRAME_GONE = frozenset({"lost", "late", "expired"})  # the frame's time is spent: dropped, not served here


class OffloadLane:
    """Sends frames to the chosen helper from the pipeline's worker threads; see the module docstring."""

    def __init__(
        self,
        cfg: OffloadConfig,
        client: OffloadClient,
        loop: asyncio.AbstractEventLoop,
        slots: EngineSlots,
        *,
        model_hash: Callable[[], str],
        chooser: HelperChooser | None = None,
        tracer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mode = cfg.mode
        self.window = cfg.window
        self.deadline_s = cfg.deadline_ms / 1000.0
        self.codec = cfg.codec
        self.engage_load = cfg.engage_load
        self.release_load = cfg.release_load
        self.client = client
        self.loop = loop
        self.slots = slots
        self.model_hash = model_hash
        self.chooser = chooser or HelperChooser()
        self.tracer = tracer  # edgerun.tracing.FrameTracer: a sampled frame's trace continues on the helper
        self.clock = clock
        self.helper: HelperCandidate | None = None
        self.prefer = False
        self.engaged = self.mode == "always"
        self.load = 0.0  # the source's frame rate over what the local engine can do (auto)
        self.counts: Counter[str] = Counter()  # done, local, late, lost, ... (see the module docstring)
        self.bytes_out = 0
        self._late = 0
        self._busy = 0
        self._connecting: tuple[HelperCandidate, bool] | None = None  # chosen, preferred: connecting to it
        self._lock = threading.Lock()

    # -- worker threads -----------------------------------------------------------------------

    def infer(self, pixels: np.ndarray, slot: Any) -> tuple[Detections, str]:
        """The helper's detections for one model-size frame, normalised to the model input."""
        helper = self.helper
        if helper is None:
            self._count("local")
            raise ServeLocally()
        data = codec.encode(pixels, self.codec)
        traceparent = ""
        if self.tracer is not None:
            if slot.trace is None:
                slot.trace = self.tracer.begin()
            if slot.trace is not None:
                traceparent = slot.trace.traceparent()
        height, width = pixels.shape[:2]
        request = InferRequest(
            id=0,
            model=self.model_hash(),
            codec=self.codec,
            height=height,
            width=width,
            budget_ms=0,
            traceparent=traceparent,
            data=data,
        )
        deadline = self.clock() + self.deadline_s
        with self._lock:
            self.bytes_out += len(data)
        try:
            future = asyncio.run_coroutine_threadsafe(self.client.infer(helper.addr, request, deadline), self.loop)
        except RuntimeError:  # the loop is closed: the node is stopping
            self._count("local")
            raise ServeLocally() from None
        try:
            reply = future.result(timeout=self.deadline_s + GRACE_S)
            detections = reply_to_detections(reply)
        except OffloadError as err:
            raise self._failed(helper, err.reason) from None
        except OffloadProtocolError:
            raise self._failed(helper, "protocol") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._failed(helper, "late") from None
        except concurrent.futures.CancelledError:  # the node is stopping
            raise self._failed(helper, "lost") from None
        with self._lock:
            self._late = self._busy = 0
            self.counts["done"] += 1
            self.chooser.succeeded(helper.name)
        return detections, helper.name

    def _failed(self, helper: HelperCandidate, reason: str) -> Exception:
        """Count a frame the helper did not serve, drop the helper if that is the verdict, and say what the
        worker does with the frame: ``FrameLost`` (its time is spent) or ``ServeLocally``."""
        with self._lock:
            self.counts[reason] += 1
            if reason in ("late", "expired"):
                self._late += 1
                drop = self._late >= LATE_STREAK
            elif reason == "busy":
                self._busy += 1
                drop = self._busy >= BUSY_STREAK
            else:
                drop = reason in _DROP_NOW
            if drop and self.helper is helper:
                self._drop(helper, reason)
        if reason in _FRAME_GONE:
            return FrameLost(f"offload_{reason}")
        self._count("local")
        return ServeLocally()

    def _drop(self, helper: HelperCandidate, reason: str) -> None:
        """Stop sending to ``helper`` (under the lock); the chooser backs it off."""
        self.helper = None
        self.prefer = False
        self._late = self._busy = 0
        self.slots.resize_remote(0)
        self.chooser.failed(helper.name, self.clock(), reason)
        self.counts["helper_dropped"] += 1
        log.warning("offload: helper %s dropped (%s); serving locally", helper.name, reason)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    # -- the loop, once a second -----------------------------------------------------------------

    def update(
        self, candidates: list[HelperCandidate], now: float, *, local_capacity_fps: float, source_fps: float
    ) -> None:
        """Decide whether a helper is used and which; open or close the remote lane accordingly."""
        if self.mode == "never":
            return
        with self._lock:
            if self.mode == "auto" and local_capacity_fps > 0:  # nothing to decide until the engine is measured
                self.load = source_fps / local_capacity_fps
                if not self.engaged and self.load > self.engage_load:
                    self.engaged = True
                    log.info(
                        "offload: the source (%.1f fps) needs help (local %.1f fps)", source_fps, local_capacity_fps
                    )
                elif self.engaged and self.load < self.release_load:
                    self.engaged = False
                    log.info(
                        "offload: the local engine keeps up again (%.1f of %.1f fps)", source_fps, local_capacity_fps
                    )
            chosen = self.chooser.choose(candidates, now) if self.engaged else None
            prefer = False
            if chosen is not None:
                if self.mode == "always":
                    prefer = True
                elif local_capacity_fps > 0:
                    local_ms = self.slots.limit * 1000.0 / local_capacity_fps
                    prefer = estimated_latency_ms(chosen) < PREFER_MARGIN * local_ms
            current = self.helper
            if chosen is not None and current is not None and _same(chosen, current):
                self.helper = chosen  # fresher figures, same connection
                if prefer != self.prefer:
                    self.prefer = prefer
                    self.slots.resize_remote(self.window, prefer)
                return
            if chosen is not None and self._connecting is not None and _same(chosen, self._connecting[0]):
                self._connecting = (chosen, prefer)  # still connecting to it
                return
            if current is not None:  # released, or another chosen: frames stop going to it at once
                self.helper, self.prefer = None, False
                self.slots.resize_remote(0)
                log.info("offload: helper %s released; serving locally", current.name)
            self._connecting = None
            if chosen is None:
                return
            self._connecting = (chosen, prefer)
        # Connected before the first frame goes: a lost SYN costs TCP's 1 s retransmission here, not frames.
        try:
            connecting = asyncio.run_coroutine_threadsafe(self.client.connect(chosen.addr), self.loop)
        except RuntimeError:  # the loop is closed: the node is stopping
            return
        connecting.add_done_callback(lambda done: self._connected(chosen, done))

    def _connected(self, chosen: HelperCandidate, done: concurrent.futures.Future[None]) -> None:
        """The connection to ``chosen`` is open (or not): open the remote lane to it, if it is still wanted."""
        error = None if done.cancelled() else done.exception()
        with self._lock:
            pending = self._connecting
            if pending is None or not _same(pending[0], chosen):
                return  # released or replaced while connecting
            chosen, prefer = pending  # the latest figures update() saw for it
            self._connecting = None
            if done.cancelled() or error is not None:
                self.counts["refused"] += 1
                self.chooser.failed(chosen.name, self.clock(), "refused")
                log.warning("offload: helper %s unreachable (%s); serving locally", chosen.name, error or "cancelled")
                return
            self.helper, self.prefer = chosen, prefer
            self._late = self._busy = 0
            self.slots.resize_remote(self.window, prefer)
        log.info(
            "offload: helper %s at %s:%d (%s, ~%.0f ms)",
            chosen.name,
            chosen.addr[0],
            chosen.addr[1],
            "preferred" if prefer else "surplus frames",
            estimated_latency_ms(chosen),
        )

    def describe(self) -> dict[str, Any]:
        """What /snapshot and the summary show."""
        with self._lock:
            helper = self.helper
            return {
                "mode": self.mode,
                "helper": helper.name if helper is not None else None,
                "connecting": self._connecting[0].name if self._connecting is not None else None,
                "preferred": self.prefer,
                "engaged": self.engaged,
                "load": round(self.load, 2),
                "frames": dict(self.counts),
                "bytes_out": self.bytes_out,
                "client": self.client.stats,
            }


def _same(a: HelperCandidate, b: HelperCandidate) -> bool:
    return (a.name, a.addr) == (b.name, b.addr)

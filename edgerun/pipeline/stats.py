"""Counters and latency histograms that stage threads update and /metrics reads.

Updates are a few integer and float stores per frame. Counters with a single
writer thread take no lock; those that several worker threads write
(preprocess, infer, decode) are updated under ``PipelineStats.lock``. A scrape
reads without locking: a value one frame stale is fine. Percentiles come from a fixed ring of recent samples.
"""

from __future__ import annotations

import bisect
import collections
import threading

import numpy as np

# Prometheus histogram bucket upper bounds, in seconds (1 ms .. 5 s).
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class LatencyHistogram:
    """A cumulative bucketed histogram plus a ring of recent samples for percentiles."""

    def __init__(self, ring: int = 4096) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0
        self.sum_s = 0.0
        self._ring = np.zeros(ring, np.float64)
        self._next = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += 1
        self.sum_s += seconds
        self._ring[self._next % self._ring.shape[0]] = seconds
        self._next += 1

    def recent(self) -> np.ndarray:
        n = min(self._next, self._ring.shape[0])
        return self._ring[:n].copy()

    def percentile_ms(self, q: float) -> float:
        recent = self.recent()
        if recent.size == 0:
            return float("nan")
        return float(np.percentile(recent, q) * 1000.0)


class StageStats:
    """Per-stage frame count, busy time and processing-time histogram."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.frames = 0
        self.busy_s = 0.0
        self.latency = LatencyHistogram()

    def record(self, seconds: float) -> None:
        self.frames += 1
        self.busy_s += seconds
        self.latency.observe(seconds)


class PipelineStats:
    """Everything the pipeline counts, shared by its threads and read by the service."""

    # "offload": a frame's round trip to a helper (edgerun.offload); "infer" is the local engine's calls only.
    STAGES = ("capture", "preprocess", "infer", "offload", "decode")

    def __init__(self) -> None:
        self.stages = {name: StageStats(name) for name in self.STAGES}
        self.captured = 0
        self.inferred = 0
        self.offloaded = 0  # of those inferred, frames a helper served (edgerun.offload)
        self.published = 0
        self.detections = 0
        self.source_errors = 0
        # A live source that went away: how often it came back, and the frames it would have delivered meanwhile
        # (outage x its frame rate; never captured, so outside captured = published + dropped).
        self.source_reconnects = 0
        self.source_lost = 0
        self.source_outage_s = 0.0  # the last outage, from the failed read to the frame source open again
        # (stage, reason) -> frames dropped there for that reason.
        self.dropped: collections.Counter[tuple[str, str]] = collections.Counter()
        self._drop_lock = threading.Lock()  # several threads drop frames
        # Held while recording infer and decode: several worker threads may write those.
        self.lock = threading.Lock()
        self.end_to_end = LatencyHistogram()  # capture -> handed to the sinks
        self.last_inference = 0.0  # monotonic; 0 until the first frame

    def drop(self, stage: str, reason: str, count: int = 1) -> None:
        with self._drop_lock:
            self.dropped[(stage, reason)] += count

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

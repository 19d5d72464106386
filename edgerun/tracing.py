"""Each frame as an OpenTelemetry trace: capture, preprocess, infer, decode, publish (``[tracing]``, off by default).

Spans are made after the fact, when the frame's batch reaches the sinks: the pipeline already stamps the end of
every stage on the frame (``FrameMeta.t_capture``, ``DetectionBatch.stamps``) for its latency statistics, so
the worker threads carry no tracing code and a node with tracing off or a frame not sampled costs nothing
but one ``random()`` on the loop. A sampled frame becomes a root span ``frame`` with one child per stage,
their times converted from the monotonic clock to wall time through the frame's own capture time.

Export is OTLP (protobuf over HTTP) by the SDK's batch processor: its own thread, a bounded queue (a full queue
drops spans, never blocks the loop) and a timeout per request, so a collector that is slow or gone costs
the node nothing but the spans. What was exported, and what failed or was dropped, is counted for
``/metrics``.

The sampling decision is the node's own (``sample_ratio``), made before any OpenTelemetry call; a frame that
arrives with a W3C trace context from elsewhere (a remote inference request, later) would join that trace.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from edgerun.errors import ConfigError

if TYPE_CHECKING:
    from edgerun.config import TracingConfig
    from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)

# The stage that ends at each stamp, in frame order: the span of a stage runs from the previous stamp to its own.
STAGES = (("preprocess", "preprocessed"), ("infer", "inferred"), ("decode", "decoded"))


class TraceCounts:
    """What became of sampled frames' spans; read by /metrics from another thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.frames_sampled = 0
        self.spans_exported = 0
        self.spans_failed = 0  # the collector refused them or could not be reached (after the SDK's retries)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "frames_sampled": self.frames_sampled,
                "spans_exported": self.spans_exported,
                "spans_failed": self.spans_failed,
            }


def _counting_exporter(inner: Any, counts: TraceCounts) -> Any:
    """The OTLP exporter, counting what each export call carried and whether it got through."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            result = inner.export(spans)
            with counts.lock:
                if result is SpanExportResult.SUCCESS:
                    counts.spans_exported += len(spans)
                else:
                    counts.spans_failed += len(spans)
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(inner.force_flush(timeout_millis))

    return CountingExporter()


class _QuietExporterLog(logging.Filter):
    """The exporter logs every failed batch with its traceback; one line per minute says enough."""

    def __init__(self) -> None:
        super().__init__()
        self.last = 0.0
        self.hidden = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.last < 60.0:
            self.hidden += 1
            return False
        self.last = now
        record.exc_info = None  # a refused connection is not a bug in edgerun
        record.exc_text = None
        if self.hidden:
            record.msg = f"{record.msg} ({self.hidden} more such lines hidden)"
            self.hidden = 0
        return True


class FrameTracer:
    """Turns published frames into traces and hands them to the OTLP exporter."""

    def __init__(self, cfg: TracingConfig, node_id: str, *, rng: random.Random | None = None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as err:
            raise ConfigError(
                f"tracing.enabled: OpenTelemetry is not installed ({err.name}); pip install 'edgerun[tracing]'"
            ) from None
        self.cfg = cfg
        self.counts = TraceCounts()
        self._rng = rng or random.Random()
        resource = Resource.create({"service.name": cfg.service_name or "edgerun", "service.instance.id": node_id})
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(
            endpoint=cfg.endpoint, timeout=cfg.export_timeout_s, headers=dict(cfg.headers) or None
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                _counting_exporter(exporter, self.counts),
                max_queue_size=cfg.max_queue_spans,
                schedule_delay_millis=int(cfg.export_interval_s * 1000),
                export_timeout_millis=int(cfg.export_timeout_s * 1000),
            )
        )
        self._tracer = self.provider.get_tracer("edgerun.pipeline")
        quiet = _QuietExporterLog()
        for name in ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk.trace.export"):
            logging.getLogger(name).addFilter(quiet)

    def sampled(self) -> bool:
        ratio = self.cfg.sample_ratio
        return ratio >= 1.0 or (ratio > 0.0 and self._rng.random() < ratio)

    def frame(self, batch: DetectionBatch, t_published: float, sinks: Sequence[str]) -> None:
        """Record one published frame if it is sampled (on the loop, after the sinks took the batch)."""
        if not self.sampled():
            return
        from opentelemetry import trace

        meta = batch.meta
        # Monotonic stamps to wall-clock nanoseconds, through the capture time known on both clocks.
        offset = meta.wall_time - meta.t_capture

        def ns(t_mono: float) -> int:
            return int((t_mono + offset) * 1e9)

        attributes: dict[str, str | int] = {
            "edgerun.node": batch.node_id,
            "edgerun.frame.seq": meta.seq,
            "edgerun.frame.source": meta.source,
            "edgerun.model": batch.model_name,
            "edgerun.model.version": batch.model_version,
            "edgerun.engine": batch.engine,
            "edgerun.detections": len(batch.detections),
        }
        # The read began at stamps["read"]; a frame read late and back-dated to when it fell due (the pipeline's
        # stale-frame skipping) has no read span of its own: its capture time is the start.
        read = batch.stamps.get("read", 0.0)
        start = read if 0.0 < read <= meta.t_capture else meta.t_capture
        root = self._tracer.start_span("frame", start_time=ns(start), attributes=attributes)
        context = trace.set_span_in_context(root)
        capture = self._tracer.start_span("capture", context=context, start_time=ns(start))
        capture.end(end_time=ns(meta.t_capture))
        start = meta.t_capture
        for name, stamp in STAGES:
            end = batch.stamps.get(stamp)
            if end is None:
                continue
            span_attributes = {"edgerun.engine": batch.engine} if name == "infer" else None
            span = self._tracer.start_span(name, context=context, start_time=ns(start), attributes=span_attributes)
            span.end(end_time=ns(end))
            start = end
        publish = self._tracer.start_span(
            "publish", context=context, start_time=ns(start), attributes={"edgerun.sinks": list(sinks)}
        )
        publish.end(end_time=ns(t_published))
        root.end(end_time=ns(t_published))
        with self.counts.lock:
            self.counts.frames_sampled += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is queued (bounded by ``timeout_s``), then stop the exporter thread."""
        self.provider.force_flush(int(timeout_s * 1000))
        self.provider.shutdown()

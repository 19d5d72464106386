"""Each frame as an OpenTelemetry trace: capture, preprocess, infer, decode, publish (``[tracing]``, off by default).

Spans are made after the fact, when the frame's batch reaches the sinks: the pipeline already stamps the end of
every stage on the frame (``FrameMeta.t_capture``, ``DetectionBatch.stamps``) for its latency statistics, so
the worker threads carry no tracing code (but ``begin`` for a frame sent to a helper) and a node with tracing
off or a frame not sampled costs nothing but one ``random()`` on the loop. A sampled frame becomes a root span
``frame`` with one child per stage, their times converted from the monotonic clock to wall time through the
frame's own capture time.

Export is OTLP (protobuf over HTTP) by the SDK's batch processor: its own thread, a bounded queue (a full queue
drops spans, never blocks the loop) and a timeout per request, so a collector that is slow or gone costs
the node nothing but the spans. What was exported, and what failed or was dropped, is counted for
``/metrics``.

The sampling decision is the node's own (``sample_ratio``), made before any OpenTelemetry call and before the
sinks take the batch (``begin``), so the detections payload can carry the trace id of a sampled frame. ``begin``
also fixes the ids the frame's spans will get, so a frame sent to a neighbour for inference (offloading) can
carry a W3C ``traceparent`` naming its ``infer`` span before that span exists; the helper records its side of the
inference (``remote_infer``) as a child of it, in its own process, and the collector joins the two by ids.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgerun.errors import ConfigError

if TYPE_CHECKING:
    from edgerun.config import TracingConfig
    from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)

# The stage that ends at each stamp, in frame order: the span of a stage runs from the previous stamp to its own.
STAGES = (("preprocess", "preprocessed"), ("infer", "inferred"), ("decode", "decoded"))

# Longer than any traceparent this version or a later one of W3C Trace Context writes; checked before parsing so a
# peer's garbage is never handed to a parser (nor to its warning log).
MAX_TRACEPARENT_CHARS = 512


def _nonzero_bits(rng: random.Random, bits: int) -> int:
    value = rng.getrandbits(bits)
    while value == 0:  # all zeros is the "invalid" id in W3C Trace Context
        value = rng.getrandbits(bits)
    return value


@dataclass(frozen=True, slots=True)
class FrameTraceIds:
    """The ids a sampled frame's spans will get, fixed before the spans are made (``FrameTracer.begin``)."""

    trace_id: int  # 128 bits
    root_span_id: int  # the frame's root span ``frame`` (64 bits)
    infer_span_id: int  # its ``infer`` span, the parent of a helper's remote ``infer`` span

    @property
    def trace_id_hex(self) -> str:
        """The trace id as 32 lowercase hex characters: what a collector, Jaeger or Tempo show and search by."""
        return f"{self.trace_id:032x}"

    def traceparent(self) -> str:
        """W3C ``traceparent`` (version 00, sampled) whose parent is the frame's ``infer`` span."""
        return f"00-{self.trace_id:032x}-{self.infer_span_id:016x}-01"


class TraceCounts:
    """What became of sampled frames' spans; read by /metrics from another thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.frames_sampled = 0
        self.spans_exported = 0
        self.spans_failed = 0  # the collector refused them or could not be reached (after the SDK's retries)
        self.remote_spans = 0  # infer spans recorded for other nodes' frames (this node as the helper)
        # Traceparents that recorded nothing, by reason: "malformed" (not W3C, or too long), "unsampled".
        self.traceparents_dropped: dict[str, int] = {"malformed": 0, "unsampled": 0}

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "frames_sampled": self.frames_sampled,
                "spans_exported": self.spans_exported,
                "spans_failed": self.spans_failed,
                "remote_spans": self.remote_spans,
                "traceparents_dropped": dict(self.traceparents_dropped),
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


def _assigning_id_generator() -> Any:
    """An IdGenerator that hands out the ids a frame was given by ``begin`` while its spans are made, and random
    ids for every other span; per thread, so the loop making a frame's spans and a helper's serving threads
    recording remote spans never take each other's ids."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

    class AssigningIdGenerator(IdGenerator):
        def __init__(self) -> None:
            self._random = RandomIdGenerator()
            self._next = threading.local()

        def assign(self, trace_id: int | None, span_id: int | None) -> None:
            """The ids the next span started on this thread gets (the trace id only matters for a root span)."""
            self._next.trace_id = trace_id
            self._next.span_id = span_id

        def generate_trace_id(self) -> int:
            trace_id = getattr(self._next, "trace_id", None)
            if trace_id is None:
                return self._random.generate_trace_id()
            self._next.trace_id = None
            return int(trace_id)

        def generate_span_id(self) -> int:
            span_id = getattr(self._next, "span_id", None)
            if span_id is None:
                return self._random.generate_span_id()
            self._next.span_id = None
            return int(span_id)

        def is_trace_id_random(self) -> bool:
            return True  # begin() draws all 128 bits at random

    return AssigningIdGenerator()


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
        self.node_id = node_id
        self._ids = _assigning_id_generator()
        self.provider = TracerProvider(resource=resource, id_generator=self._ids)
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

    def begin(self) -> FrameTraceIds | None:
        """Whether a frame is traced (``sample_ratio``) and, if so, the ids its spans will get; from any thread."""
        if not self.sampled():
            return None
        rng = self._rng  # random.Random's methods are each one call into C: safe across threads under the GIL
        return FrameTraceIds(_nonzero_bits(rng, 128), _nonzero_bits(rng, 64), _nonzero_bits(rng, 64))

    def _start(self, name: str, ids: tuple[int | None, int], **kwargs: Any) -> Any:
        """A span with the given (trace id, span id); the trace id is used only by a root span."""
        self._ids.assign(*ids)
        try:
            return self._tracer.start_span(name, **kwargs)
        finally:
            self._ids.assign(None, None)  # a span that drew no id (a disabled tracer) leaves none for the next

    def frame(self, batch: DetectionBatch, t_published: float, sinks: Sequence[str]) -> None:
        """Record one published frame (on the loop, after the sinks took the batch).

        With ``batch.trace`` set the frame was sampled already (``begin``) and its spans get those ids; without,
        it is sampled here.
        """
        ids = batch.trace
        if ids is None:
            ids = self.begin()
            if ids is None:
                return
        from opentelemetry import trace
        from opentelemetry.context import Context

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
        root = self._start(
            "frame",
            (ids.trace_id, ids.root_span_id),
            context=Context(),
            start_time=ns(start),
            attributes=attributes,
        )
        context = trace.set_span_in_context(root)
        capture = self._tracer.start_span("capture", context=context, start_time=ns(start))
        capture.end(end_time=ns(meta.t_capture))
        start = meta.t_capture
        helper = batch.remote_helper
        for name, stamp in STAGES:
            end = batch.stamps.get(stamp)
            if end is None:
                continue
            if name == "infer":
                infer_attributes: dict[str, str] = {"edgerun.engine": batch.engine}
                kind = trace.SpanKind.INTERNAL
                if helper is not None:  # inferred on a neighbour: this span is the request, the helper's the serving
                    infer_attributes["edgerun.remote.helper"] = helper
                    kind = trace.SpanKind.CLIENT
                span = self._start(
                    name,
                    (None, ids.infer_span_id),
                    context=context,
                    kind=kind,
                    start_time=ns(start),
                    attributes=infer_attributes,
                )
            else:
                span = self._tracer.start_span(name, context=context, start_time=ns(start))
            span.end(end_time=ns(end))
            start = end
        publish = self._tracer.start_span(
            "publish", context=context, start_time=ns(start), attributes={"edgerun.sinks": list(sinks)}
        )
        publish.end(end_time=ns(t_published))
        root.end(end_time=ns(t_published))
        with self.counts.lock:
            self.counts.frames_sampled += 1

    def remote_infer(self, traceparent: str, start_ns: int, end_ns: int, attributes: Mapping[str, str | int]) -> bool:
        """Record this node's inference of another node's frame as a SERVER span ``infer``, the child of the
        origin's ``infer`` span named by ``traceparent``; from any thread (the offload server's serving threads).

        ``start_ns``/``end_ns`` are wall-clock nanoseconds; ``attributes`` carries ``edgerun.engine`` and
        ``edgerun.remote.origin`` (the origin node). An empty traceparent (the origin did not sample the frame)
        records nothing; a malformed or unsampled one records nothing and is counted. Never raises for what the
        peer sent. True when a span was recorded.
        """
        if not traceparent:
            return False
        from opentelemetry import trace

        parent, reason = self._parent(traceparent)
        if reason:
            with self.counts.lock:
                self.counts.traceparents_dropped[reason] += 1
            return False
        span = self._tracer.start_span(
            "infer",
            context=parent,
            kind=trace.SpanKind.SERVER,
            start_time=start_ns,
            attributes={**attributes, "edgerun.node": self.node_id},
        )
        span.end(end_time=max(start_ns, end_ns))
        with self.counts.lock:
            self.counts.remote_spans += 1
        return True

    @staticmethod
    def _parent(traceparent: str) -> tuple[Any, str]:
        """The context ``traceparent`` names as the parent, and "" or why it cannot be one: "malformed" (not W3C
        Trace Context, or too long), "unsampled" (the origin does not record this trace)."""
        if len(traceparent) > MAX_TRACEPARENT_CHARS:
            return None, "malformed"
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        span_context = trace.get_current_span(context).get_span_context()
        if not span_context.is_valid:  # the propagator hands back an empty context for anything it cannot read
            return None, "malformed"
        if not span_context.trace_flags.sampled:
            return None, "unsampled"
        return context, ""

    def close(self, timeout_s: float = 2.0) -> None:
        """Export what is queued (bounded by ``timeout_s``), then stop the exporter thread."""
        self.provider.force_flush(int(timeout_s * 1000))
        self.provider.shutdown()

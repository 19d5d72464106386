"""Prometheus metrics, built at scrape time from the counters the node already keeps.

A custom collector reads the pipeline's and sinks' plain counters when
/metrics is scraped, so the frame path pays nothing for metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from edgerun.pipeline.stats import LATENCY_BUCKETS, LatencyHistogram

if TYPE_CHECKING:
    from edgerun.node import Node

# Sink counters that have metrics of their own above, or are gauges.
SINK_COUNTERS_ELSEWHERE = {"connected", "sent", "dropped", "errors", "queued", "inflight"}

STATES = ("starting", "running", "degraded", "stopping")


def _histogram(name: str, doc: str, labels: list[str], series: list[tuple[list[str], LatencyHistogram]]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, hist in series:
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), hist.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric(values, buckets, hist.sum_s)
    return family


MEMBER_STATES = ("alive", "suspect", "dead", "left")


def swarm_metrics(fleet: Any) -> Iterator[Metric]:
    """Membership, gossip traffic and dedup counters of the node's swarm member."""
    members = GaugeMetricFamily(
        "edgerun_swarm_members", "Swarm members in each state, this node's view.", labels=["state"]
    )
    counts = dict.fromkeys(MEMBER_STATES, 0)
    for member in fleet.members():
        state = member.state.name.lower()
        counts[state] = counts.get(state, 0) + 1
    for state, n in counts.items():
        members.add_metric([state], n)
    yield members
    yield GaugeMetricFamily(
        "edgerun_swarm_members_missing",
        "Members suspect now or declared dead and not back since (kept after gossip forgets them).",
        value=fleet.missing(),
    )
    counters = fleet.counters()
    agent, dedup = counters["agent"], counters["dedup"]
    dropped = CounterMetricFamily(
        "edgerun_swarm_packets_dropped", "Gossip packets (and claims in them) dropped, by reason.", labels=["reason"]
    )
    for reason, n in sorted((agent.get("dropped") or {}).items()):
        dropped.add_metric([reason], n)
    for reason, n in sorted(dedup.dropped.items()):
        dropped.add_metric([f"claim_{reason}"], n)
    yield dropped
    wire = CounterMetricFamily("edgerun_swarm_bytes", "Gossip bytes on the wire, encrypted.", labels=["direction"])
    wire.add_metric(["in"], agent.get("bytes_in", 0))
    wire.add_metric(["out"], agent.get("bytes_out", 0))
    yield wire
    objects = CounterMetricFamily("edgerun_fleet_objects", "Fleet objects this node owned and reported.")
    objects.add_metric([], counters["objects_published"])
    yield objects
    suppressed = CounterMetricFamily(
        "edgerun_dedup_suppressed", "Objects this node saw but left to their owner (another node's report)."
    )
    suppressed.add_metric([], dedup.suppressed)
    yield suppressed
    images = counters.get("images") or {}
    if images:
        published = CounterMetricFamily(
            "edgerun_find_images_published", "Pictures of owned fleet objects published (first views and better ones)."
        )
        published.add_metric([], images["published"])
        yield published
        size = CounterMetricFamily("edgerun_find_images_bytes", "JPEG bytes of the pictures published.")
        size.add_metric([], images["bytes"])
        yield size
        skipped = CounterMetricFamily(
            "edgerun_find_images_skipped",
            "Crops of finds a bound held back: frame_cap (crops per frame), object_rate (one picture per object per"
            " min_interval_s), bytes_rate (max_bytes_per_s), too_large (no JPEG quality fits max_bytes).",
            labels=["reason"],
        )
        for reason, n in sorted(images["skipped"].items()):
            skipped.add_metric([reason], n)
        yield skipped


# The offload server's stats that are not what became of a request.
_OFFLOAD_SERVER_NOT_OUTCOMES = frozenset(
    {"dropped", "bytes_in", "bytes_out", "connections", "requests", "queue", "served_fps", "unauth_buffered_peak"}
)


def offload_metrics(lane: Any, server: Any) -> Iterator[Metric]:
    """Frames sent to a helper and what became of them; neighbours' frames served here (edgerun.offload)."""
    if lane is not None:
        frames = CounterMetricFamily(
            "edgerun_offload_frames",
            "Frames this node tried to send to a helper, by outcome (done, local, late, lost, refused, busy, ...).",
            labels=["outcome"],
        )
        described = lane.describe()
        for outcome, count in sorted(described["frames"].items()):
            frames.add_metric([outcome], count)
        yield frames
        helper = GaugeMetricFamily("edgerun_offload_helper", "1 for the helper frames go to now.", labels=["helper"])
        if described["helper"] is not None:
            helper.add_metric([described["helper"]], 1.0)
        yield helper
        sent = CounterMetricFamily("edgerun_offload_bytes", "Encoded frame bytes sent to helpers.")
        sent.add_metric([], described["bytes_out"])
        yield sent
    if server is not None:
        served = CounterMetricFamily(
            "edgerun_offload_served", "Neighbours' frames this node was asked to serve, by outcome.", labels=["outcome"]
        )
        stats = server.stats
        for outcome, count in sorted(stats.items()):
            if outcome not in _OFFLOAD_SERVER_NOT_OUTCOMES and isinstance(count, int):
                served.add_metric([outcome], count)
        yield served
        dropped = CounterMetricFamily(
            "edgerun_offload_dropped", "Offload frames dropped on receipt, by reason.", labels=["reason"]
        )
        for reason, count in sorted(stats.get("dropped", {}).items()):
            dropped.add_metric([reason], count)
        yield dropped


def pose_metrics(pose: Any) -> Iterator[Metric]:
    """The live pose source (MAVLink): frames with and without a pose, messages, drops, the ground height used."""
    stats = pose.stats
    frames = CounterMetricFamily(
        "edgerun_pose_frames",
        "Frames looked up in the autopilot's pose: posed, or why not (no such frames make ground claims).",
        labels=["result"],
    )
    for result, key in (("posed", "poses"), ("stale", "stale"), ("no_fix", "no_fix"), ("no_gps_fix", "no_gps_fix")):
        frames.add_metric([result], stats[key])
    yield frames
    messages = CounterMetricFamily("edgerun_pose_messages", "MAVLink messages used from the followed autopilot.")
    messages.add_metric([], stats["messages"])
    yield messages
    dropped = CounterMetricFamily(
        "edgerun_pose_dropped", "MAVLink bytes and messages dropped, by reason.", labels=["reason"]
    )
    for reason, n in sorted(stats["dropped"].items()):
        dropped.add_metric([reason], n)
    yield dropped
    if stats["ground_alt_m"] is not None:
        ground = GaugeMetricFamily(
            "edgerun_pose_ground_alt_m",
            "The ground's height above mean sea level, by where it came from.",
            labels=["source"],
        )
        ground.add_metric([stats["ground_source"]], stats["ground_alt_m"])
        yield ground


class NodeCollector:
    """Yields every ``edgerun_*`` metric from a running Node."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        stats = node.stats

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            return family

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            return family

        yield counter("edgerun_frames_captured", "Frames read from the source.", stats.captured)
        yield counter("edgerun_frames_inferred", "Frames that went through the model.", stats.inferred)
        yield counter("edgerun_batches_published", "Detection batches handed to the sinks.", stats.published)
        yield counter("edgerun_detections", "Detections produced.", stats.detections)
        yield counter("edgerun_source_errors", "Times the source failed and was reopened.", stats.source_errors)
        yield counter("edgerun_source_reconnects", "Times a failed source came back.", stats.source_reconnects)
        yield counter(
            "edgerun_source_frames_lost",
            "Frames a live source would have delivered while it was gone (outage x its frame rate).",
            stats.source_lost,
        )
        yield gauge(
            "edgerun_source_last_outage_seconds",
            "The last source outage, from the failed read until the source was open again.",
            stats.source_outage_s,
        )
        dropped = CounterMetricFamily(
            "edgerun_frames_dropped", "Frames dropped, by stage and reason.", labels=["stage", "reason"]
        )
        for (stage, reason), count in sorted(stats.dropped.items()):
            dropped.add_metric([stage, reason], count)
        yield dropped
        rows = CounterMetricFamily(
            "edgerun_decoder_rows_dropped",
            "Output rows the decoder refused as detections (e.g. inverted_box), by reason; the frame goes on.",
            labels=["reason"],
        )
        for reason, count in sorted(node.decoder_rows_dropped().items()):
            rows.add_metric([reason], count)
        yield rows
        yield _histogram(
            "edgerun_stage_seconds",
            "Processing time per frame in each pipeline stage.",
            ["stage"],
            [([name], s.latency) for name, s in stats.stages.items()],
        )
        yield _histogram(
            "edgerun_latency_seconds", "Capture to hand-off to the sinks, per frame.", [], [([], stats.end_to_end)]
        )
        yield gauge("edgerun_fps", "Batches published per second over the last few seconds.", node.fps())
        if node.pipeline is not None:
            yield gauge(
                "edgerun_pipeline_workers",
                "Frames the pipeline works on at once (one per engine replica).",
                node.pipeline.workers,
            )
        state = GaugeMetricFamily("edgerun_health_state", "1 for the node's current state.", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if node.health.state == name else 0.0)
        yield state
        info = GaugeMetricFamily("edgerun_model_info", "The model being served.", labels=["model", "version", "engine"])
        info.add_metric([node.model_name, str(node.model_version), node.engine_key], 1.0)
        yield info
        sent = CounterMetricFamily("edgerun_sink_sent", "Batches delivered by each sink.", labels=["sink"])
        sdrop = CounterMetricFamily("edgerun_sink_dropped", "Batches evicted from a full sink outbox.", labels=["sink"])
        errors = CounterMetricFamily("edgerun_sink_errors", "Sink delivery errors.", labels=["sink"])
        up = GaugeMetricFamily("edgerun_sink_connected", "1 while the sink can deliver.", labels=["sink"])
        queued = GaugeMetricFamily("edgerun_sink_queued", "Batches waiting in each sink's outbox.", labels=["sink"])
        extra = CounterMetricFamily(
            "edgerun_sink_events", "Other per-sink counters (expired, reconnects, ...).", labels=["sink", "counter"]
        )
        for sink in node.sinks:
            sent.add_metric([sink.KEY], sink.stats.sent)
            sdrop.add_metric([sink.KEY], sink.stats.dropped)
            errors.add_metric([sink.KEY], sink.stats.errors)
            up.add_metric([sink.KEY], 1.0 if sink.stats.connected else 0.0)
            counters = sink.counters() if hasattr(sink, "counters") else {}
            if "queued" in counters:
                queued.add_metric([sink.KEY], counters["queued"])
            for name, value in sorted(counters.items()):
                if name not in SINK_COUNTERS_ELSEWHERE and not isinstance(value, bool):
                    extra.add_metric([sink.KEY, name], value)
        yield from (queued, extra)
        yield from (sent, sdrop, errors, up)
        yield gauge("edgerun_pool_free_slots", "Frame slots not holding a frame.", node.pool_free())
        fleet = getattr(node, "fleet", None)
        if fleet is not None:
            yield from swarm_metrics(fleet)
        if getattr(node, "offload", None) is not None or getattr(node, "offload_server", None) is not None:
            yield from offload_metrics(node.offload, node.offload_server)
        pose = getattr(node, "pose_source", None)
        if pose is not None:
            yield from pose_metrics(pose)
        mcu = getattr(node, "mcu", None)
        if mcu is not None:
            yield from mcu.collect()  # edgerun_mcu_*: link, drops by reason, the MCU's health
        updater = getattr(node, "updater", None)
        if updater is not None:
            try:  # installed.json is a few hundred bytes, read per scrape; a broken one is the updater's to report
                installed = updater.store.installed()
            except Exception:
                installed = None
            if installed is not None:
                # Persisted across restarts, so the "OTA rollback" alert sees rollbacks a crash loop would hide.
                yield gauge(
                    "edgerun_ota_rolled_back_versions",
                    "Model versions this node rolled back (never retried).",
                    len(installed.rejected),
                )
        tracer = getattr(node, "tracer", None)
        if tracer is not None:
            counts = tracer.counts.snapshot()
            yield counter("edgerun_trace_frames_sampled", "Frames recorded as traces.", counts["frames_sampled"])
            yield counter("edgerun_trace_spans_exported", "Spans the OTLP collector took.", counts["spans_exported"])
            yield counter(
                "edgerun_trace_spans_failed",
                "Spans the OTLP collector refused or could not be sent (collector down or slow).",
                counts["spans_failed"],
            )
            yield counter(
                "edgerun_trace_remote_spans",
                "Infer spans recorded for frames other nodes sent here (offloading), in the origin's trace.",
                counts["remote_spans"],
            )
            dropped_parents = CounterMetricFamily(
                "edgerun_trace_traceparents_dropped",
                "Traceparents of offloaded frames that recorded nothing, by reason (malformed, unsampled).",
                labels=["reason"],
            )
            for reason, n in sorted(counts["traceparents_dropped"].items()):
                dropped_parents.add_metric([reason], n)
            yield dropped_parents
        failover = getattr(node, "failover", None)
        if failover is not None:
            active = GaugeMetricFamily(
                "edgerun_engine_active", "1 for the back end serving frames, 0 for the others.", labels=["engine"]
            )
            for key in failover.keys:
                active.add_metric([key], 1.0 if key == failover.active_key else 0.0)
            yield active
            yield counter("edgerun_failovers", "Mid-stream switches to a fallback engine.", failover.failovers)
            yield counter(
                "edgerun_fallback_seconds",
                "Time served on an engine other than the preferred one.",
                failover.fallback_seconds(),
            )


def metrics_text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode("utf-8")


def node_registry(node: Node) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node))
    return registry

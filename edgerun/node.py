"""The Node: the one place that knows every part and wires them together.

Build (``Node.build``, on a thread, signal handlers already installed):
preflight checks -> model bundle -> source -> engines (failover opens and warms
every candidate) -> decoder -> pool. Serve (``Node.serve``): sinks -> serving
controller -> HTTP -> stage threads -> watchdog -> OTA, then READY=1 to systemd.
Services stop in reverse order: OTA first, then the pipeline drains its frames
in flight, then HTTP and the sinks; STOPPING=1 comes first of all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import signal
import threading
import time
from typing import Any, Callable, Coroutine

from edgerun.config import Config
from edgerun.engines.factory import open_failover
from edgerun.engines.failover import Failover
from edgerun.engines.runtime import ModelRuntime
from edgerun.errors import ConfigError, SourceError
from edgerun.fleet.member_meta import MemberMeta
from edgerun.fleet.service import FleetMember, parse_hostport
from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.models.demo import ensure_demo_bundle
from edgerun.offload.capabilities import LocalEngineRate, quantised_capacity, spare_fps  # no sockets, no crypto
from edgerun.pipeline.runner import Pipeline, PipelineSettings
from edgerun.pipeline.serving import Served, ServingController
from edgerun.pipeline.stats import PipelineStats
from edgerun.preflight import preflight
from edgerun.service.health import Health
from edgerun.service.metrics import metrics_text, node_registry
from edgerun.service.sdnotify import SdNotifier, Watchdog
from edgerun.sinks import sink_class
from edgerun.sinks.base import Sink
from edgerun.sources import make_source
from edgerun.sources.base import Source
from edgerun.types import DetectionBatch, Pose

log = logging.getLogger(__name__)

# Frame size assumed when a camera is missing at start; the source resizes into it once it appears.
FALLBACK_FRAME_SIZE = (640, 480)


def open_bundle(cfg: Config) -> ModelBundle:
    if cfg.model.bundle:
        return load_bundle(cfg.model.bundle)
    return ensure_demo_bundle(fetch=False)  # never the network at start: says to run `model fetch-demo`


class FpsMeter:
    """Batches per second over a sliding window of recent timestamps."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self._stamps: collections.deque[float] = collections.deque(maxlen=4096)

    def tick(self, now: float) -> None:
        self._stamps.append(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        stamps = self._stamps
        while stamps and now - stamps[0] > self.window_s:
            stamps.popleft()
        if len(stamps) < 2:
            return 0.0
        span = now - stamps[0]
        return (len(stamps) - 1) / span if span > 0 else 0.0


class Node:
    """One node's runtime: ``await node.build()`` then ``await node.serve()``; ``await node.run()`` does both.

    ``build`` does everything before the first frame (checks, bundle, source,
    engines opened and warm, pipeline) on a worker thread, so a SIGTERM during a
    long accelerator open is handled at once. ``serve`` starts the auxiliary
    services (sinks, HTTP, then the pipeline, watchdog and OTA), tells systemd
    READY=1 and runs until stopped; the services stop in reverse order. A new
    auxiliary service (the swarm, an MCU bridge) starts in ``serve`` and pushes
    its stop onto ``self._services`` (an ``AsyncExitStack``): nothing else to wire.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        observers: list[Callable[[DetectionBatch], None]] | None = None,
        test_control: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.test_control = test_control  # unix socket path of edgerun.testing.control (edgerun run --test-control)
        self.node_id = cfg.node_id
        self.stats = PipelineStats()
        self.health = Health()
        self.sinks: list[Sink] = []
        self.observers = observers or []
        self._fps = FpsMeter()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pipeline: Pipeline | None = None
        # Owns which runtime serves: failover, OTA swaps and rollbacks go through it.
        self.serving = ServingController(
            retire_timeout_s=cfg.service.shutdown_timeout_s, on_swap=self._on_model_swapped
        )
        self.updater: Any = None  # edgerun.ota.updater.Updater when ota.enabled
        self.fleet: FleetMember | None = None  # the swarm member when swarm.enabled
        self.last_pose: Pose | None = None  # the camera pose of the latest frame that had one
        self.pose_source: Any = None  # edgerun.sources.pose_mavlink.MavlinkPoseSource when source.pose is set
        self.mcu: Any = None  # edgerun.mcu.bridge.McuBridge when mcu.enabled
        self.tracer: Any = None  # edgerun.tracing.FrameTracer when tracing.enabled
        self.offload: Any = None  # edgerun.offload.lane.OffloadLane when offload.mode is not "never"
        self.offload_server: Any = None  # edgerun.offload.server.OffloadServer when offload.serve
        self._local_engine = LocalEngineRate()  # what the local engine can do, for offload and capabilities
        self._sink_keys: list[str] = []
        self.source: Source | None = None
        self._source_error = ""  # why the source did not open at start ("" when it did)
        self._starting: Failover | None = None  # the failover being opened by build, until it serves
        self._aborted = False  # a stop came during build
        # Auxiliary services started by serve, stopped in reverse order (sinks, HTTP, pipeline, watchdog, OTA).
        self._services = contextlib.AsyncExitStack()
        self.t_start = time.monotonic()
        self.t_pipeline_start = self.t_start
        self.t_first_batch: float | None = None
        self.http_port: int | None = None
        self._notifier: Any = None

    # -- read by the service -------------------------------------------------

    @property
    def failover(self) -> Failover | None:
        """The failover in charge of the serving model (replaced by an OTA swap)."""
        owner = self.serving.owner
        return owner if isinstance(owner, Failover) else self._starting

    @property
    def model_name(self) -> str:
        return self.pipeline.runtime.model.name if self.pipeline else ""

    @property
    def model_version(self) -> int:
        return self.pipeline.runtime.model.version if self.pipeline else 0

    @property
    def engine_key(self) -> str:
        return self.pipeline.runtime.engine.KEY if self.pipeline else ""

    def fps(self) -> float:
        return self._fps.rate()

    def decoder_rows_dropped(self) -> dict[str, int]:
        """Rows the serving model's decoders refused (every worker's copy), by reason."""
        total: collections.Counter[str] = collections.Counter()
        runtime = self.pipeline.runtime if self.pipeline else None
        for decoder in list(runtime.decoders) if runtime is not None else []:
            total.update(getattr(decoder, "dropped", {}))
        return dict(total)

    def pool_free(self) -> int:
        return self.pipeline.pool.free if self.pipeline else 0

    def inference_errors(self) -> int:
        return self.stats.dropped[("infer", "error")]

    def status_text(self) -> str:
        """systemd's STATUS= line (``systemctl status``): the state, and why when degraded, then the pace."""
        reasons = self.health.reasons
        why = " (" + "; ".join(f"{key}: {text}" for key, text in sorted(reasons.items())) + ")" if reasons else ""
        return f"{self.health.state}{why}, {self.fps():.1f} fps, {self.stats.published} batches"

    def snapshot_jpeg(self) -> bytes | None:
        """The latest frame with its boxes drawn, as JPEG (runs in an executor thread)."""
        if self.pipeline is None:
            return None
        from edgerun.service.snapshot import render_snapshot

        return render_snapshot(self.pipeline.snapshot, ".jpg")

    # -- the frame path, on the loop ------------------------------------------

    def _on_batch(self, batch: DetectionBatch) -> None:
        now = time.monotonic()
        meta = batch.meta
        if meta.pose is None and self.pose_source is not None:
            meta.pose = self.pose_source.latest(meta.t_capture)  # the autopilot's pose at capture time
        if meta.pose is not None:
            self.last_pose = meta.pose
        stats = self.stats
        stats.published += 1
        stats.end_to_end.observe(now - batch.meta.t_capture)
        self._fps.tick(now)
        if self.t_first_batch is None:
            self.t_first_batch = now
            self.health.mark_running()
        tracer = self.tracer
        if tracer is not None and batch.trace is None and batch.remote_helper is None:
            # Sampled before the sinks take it, so its payload names its trace. A frame inferred on a neighbour was
            # sampled (or not) by the worker that sent it, with the helper told so: it is not sampled twice.
            batch.trace = tracer.begin()
        for sink in self.sinks:
            sink.submit(batch, now)
        if tracer is not None and batch.trace is not None:
            tracer.frame(batch, time.monotonic(), self._sink_keys)
        if self.fleet is not None:
            self.fleet.observe(batch)
        for observe in self.observers:
            observe(batch)

    def _on_health_change(self, state: str, reasons: dict[str, str]) -> None:
        self.publish_event("health", {"state": state, "reasons": reasons})
        if self._notifier is not None:  # at once, not at the next watchdog tick: `systemctl status` says why
            self._notifier.status(self.status_text())

    def publish_event(self, kind: str, data: dict[str, Any]) -> None:
        """An event on every sink (on the loop); one sink refusing it does not keep it from the others."""
        for sink in self.sinks:
            try:
                sink.publish_event(kind, data)
            except Exception:
                log.exception("sink %s refused a %s event", sink.KEY, kind)

    def _publish_from_thread(self, kind: str, data: dict[str, Any]) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self.publish_event, kind, data)
        except RuntimeError:
            log.debug("%s event not published: the loop is closed", kind)

    def _on_model_swapped(self, runtime: ModelRuntime) -> None:
        self._publish_from_thread("model", {"name": runtime.model.name, "version": runtime.model.version})

    def open_model(self, bundle: ModelBundle) -> Served:
        """Open ``bundle`` on ``engine.order`` beside the serving model, warm, not serving (blocking)."""
        frame_size = (self.source.width, self.source.height) if self.source is not None else FALLBACK_FRAME_SIZE
        failover = open_failover(self.cfg, bundle, frame_size, health=self.health, on_event=self._publish_from_thread)
        return Served(failover.start(), failover)

    # -- lifecycle -----------------------------------------------------------

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self, *, seconds: float | None = None, install_signals: bool = True) -> int:
        """Build, then serve until SIGTERM/SIGINT, ``seconds`` elapse, or a finite source ends."""
        loop = asyncio.get_running_loop()
        self._stop = self._stop or asyncio.Event()
        if install_signals:
            # First of all: a stop while engines open is a clean stop, not a crash inside a driver.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            if not await self.build():
                return 0
            return await self.serve(seconds=seconds)
        finally:
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

    async def build(self) -> bool:
        """Everything before the first frame; False when a stop came first (what was opened is closed).

        Raises what a person must fix (ConfigError, ModelError) before any heavy work.
        """
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = self._stop or asyncio.Event()
        from edgerun.service.journal import bind_engine

        bind_engine(lambda: self.engine_key)  # journald entries carry EDGERUN_ENGINE
        self.health = Health(notify=loop.call_soon_threadsafe)
        self.health.on_change.append(self._on_health_change)
        self._notifier = SdNotifier()
        preflight(self.cfg)
        if self.cfg.ota.enabled:
            from edgerun.ota.updater import Updater

            self.updater = Updater(self, self.cfg.ota)
        done: asyncio.Future[None] = loop.create_future()
        # A daemon thread, not the default executor: an open stuck in a driver must not hold up the exit.
        threading.Thread(target=self._build_on_thread, args=(loop, done), name="edgerun-build", daemon=True).start()
        stop: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([done, stop], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            done.cancel()
            self._close_parts()
            raise
        finally:
            stop.cancel()
        if done.done():
            try:
                done.result()  # raises what the build raised
            except BaseException:
                self._close_parts()
                raise
            return True
        done.cancel()
        log.info("stop requested while starting: stopping cleanly")
        self.health.mark_stopping()
        self._close_parts()
        return False

    def _build_on_thread(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]) -> None:
        error: BaseException | None = None
        try:
            self._build_parts()
        except BaseException as err:  # handed to build() on the loop
            error = err

        def finish() -> None:
            if done.done():  # cancelled: a stop came first
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)

        try:
            loop.call_soon_threadsafe(finish)
        except RuntimeError:
            pass  # the loop is closed: the node stopped during its build

    def _build_parts(self) -> None:
        """Bundle -> source -> engines -> pipeline (the build thread; checks for a stop between steps)."""
        cfg = self.cfg
        if self.updater is not None:
            # Recovers an interrupted update and serves the active slot (the configured bundle seeds slot a).
            bundle = self.updater.boot_bundle(lambda: open_bundle(cfg))
        else:
            bundle = open_bundle(cfg)
        if self._aborted:
            return
        self.source = source = make_source(cfg.source)
        if self.test_control:
            from edgerun.testing.control import ControlledCamera

            self.source = source = ControlledCamera(source)  # the control socket's "camera gone" switch
        try:
            source.open()
        except SourceError as err:
            # A camera that is not there yet must not keep the node down: run degraded and keep trying.
            self._source_error = str(err)
            self.health.set_problem("source", self._source_error)
            log.warning("%s; the node starts degraded and keeps trying", err)
            source.width = source.width or cfg.source.width or FALLBACK_FRAME_SIZE[0]
            source.height = source.height or cfg.source.height or FALLBACK_FRAME_SIZE[1]
        if self._aborted:
            return
        self._starting = failover = open_failover(
            cfg, bundle, (source.width, source.height), health=self.health, on_event=self._publish_from_thread
        )
        runtime = failover.start()
        if self._aborted:
            return
        loop = self._loop
        assert loop is not None
        self.pipeline = Pipeline(
            node_id=self.node_id,
            source=source,
            runtime=runtime,
            on_batch=lambda batch: loop.call_soon_threadsafe(self._on_batch, batch),
            settings=PipelineSettings(
                queue_depth=cfg.pipeline.queue_depth,
                policy=cfg.pipeline.policy,
                stage_threads=cfg.pipeline.stage_threads,
                # Workers beyond the engine's calls wait at its gate, or send frames to a helper (offload window).
                workers=failover.concurrency() + (cfg.offload.window if cfg.offload.mode != "never" else 0),
                pace_fps=cfg.source.fps,
                reopen_backoff_s=cfg.source.reopen_backoff_s,
                reopen_backoff_max_s=cfg.source.reopen_backoff_max_s,
                snapshot_interval_s=cfg.service.snapshot_interval_s,
            ),
            health=self.health,
            stats=self.stats,
            infer_guard=self.serving,
        )

    def _close_parts(self) -> None:
        """Build failed or was stopped: close what it opened; an open still running is left to the exiting process."""
        self._aborted = True
        if self._starting is not None:
            self._starting.close()  # also marks the breadcrumbs clean: nothing is blamed for this stop
        if self.source is not None:
            self.source.close()

    async def serve(self, *, seconds: float | None = None) -> int:
        """Serve frames until stopped, ``seconds`` elapse or a finite source ends; returns the exit code."""
        pipeline, failover = self.pipeline, self._starting
        if pipeline is None or failover is None or self._aborted:
            return 0
        loop = asyncio.get_running_loop()
        assert self._stop is not None and self.source is not None
        services = self._services
        try:
            if self.cfg.tracing.enabled:
                self._start_tracing()
            await self._start_sinks()
            if self.cfg.source.pose.kind == "mavlink":
                await self._start_pose()
            if self.cfg.swarm.enabled:
                await self._start_fleet()
            if self.cfg.offload.mode != "never" or self.cfg.offload.serve:
                await self._start_offload()
            if self.cfg.mcu.enabled:
                await self._start_mcu()
            # After the sinks: the failover's first event reports how the engines started.
            self.serving.serve(pipeline, failover)
            self._starting = None
            await self._start_http()
            if self.test_control:
                await self._start_test_control(self.test_control)
            # Stall time counts from here: loading the model and the scene is not a stalled pipeline.
            self.t_pipeline_start = time.monotonic()
            pipeline.start(source_open=not self._source_error, source_error=self._source_error)
            services.push_async_callback(self._drain, pipeline)
            self._start_task(self._watchdog().run())
            self._start_task(self._watch_sinks())
            if self.updater is not None:
                self.updater.start()
                services.push_async_callback(self.updater.stop)  # first to stop: no swap while frames drain
            # Built, engines warm, services up: ready, even with no camera yet (health says degraded and why).
            self._notifier.ready()
            self._log_started(pipeline)
            ended = loop.run_in_executor(None, pipeline.end_of_stream.wait)
            waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._stop.wait()), ended]
            try:
                await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        finally:
            self.health.mark_stopping()
            self._notifier.stopping()
            await services.aclose()
            pipeline.end_of_stream.set()  # release the executor waiter
            (self.serving.owner or failover).close()  # an OTA update may have replaced it
            self.source.close()
        log.info("stopped: %s", json.dumps(self.summary(), sort_keys=True))
        return 0

    def _start_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)

        async def cancel() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self._services.push_async_callback(cancel)

    def _watchdog(self) -> Watchdog:
        return Watchdog(
            self._notifier,
            last_progress=lambda: self.stats.last_inference or self.t_pipeline_start,
            stall_s=self.cfg.service.stall_s,
            health=self.health,
            status_text=self.status_text,
            # A camera being reopened is a known, handled outage: a restart would not bring it back.
            stall_excused=lambda: "source" in self.health.reasons,
        )

    def _log_started(self, pipeline: Pipeline) -> None:
        engine, source, model = pipeline.runtime.engine, pipeline.source, pipeline.runtime.model
        log.info(
            "node %s: %s v%d on %s (%d x %d threads), source %s %dx%d, %d %s worker(s)%s",
            self.node_id,
            model.name,
            model.version,
            engine.KEY,
            getattr(engine, "replicas", 1),
            getattr(engine, "num_threads", 0),
            source.KEY,
            source.width,
            source.height,
            pipeline.workers,
            "fused" if pipeline.fused else "separate-stage",
            ", reading frames themselves" if pipeline.inline_capture else "",
        )

    async def _start_sinks(self) -> None:
        sinks_cfg = self.cfg.sinks
        self._services.push_async_callback(self._close_sinks)  # the ones that started, side by side
        for key, section in (("jsonl", sinks_cfg.jsonl), ("mqtt", sinks_cfg.mqtt), ("dds", sinks_cfg.dds)):
            if not section.enabled:
                continue
            sink = sink_class(key)(section, self.node_id)
            await sink.start()
            self.sinks.append(sink)
            self._sink_keys.append(key)
        for sink in self.sinks:
            setter: Any = getattr(sink, "set_metrics_provider", None)
            if setter is not None:
                setter(self.summary)

    def _start_tracing(self) -> None:
        from edgerun.tracing import FrameTracer

        tracer = FrameTracer(self.cfg.tracing, self.node_id)
        self.tracer = tracer

        async def close() -> None:  # after the sinks closed (pushed first, so popped last): the last frames' spans
            await asyncio.get_running_loop().run_in_executor(None, tracer.close)

        self._services.push_async_callback(close)

    async def _start_pose(self) -> None:
        """Live camera pose from the autopilot; a link that will not open leaves the node degraded, not down."""
        from edgerun.sources.pose_mavlink import MavlinkPoseSource

        pose = MavlinkPoseSource(self.cfg.source.pose)
        try:
            await pose.start()
        except SourceError as err:
            self.health.set_problem("pose", str(err))
            log.warning("%s; detections go out without a camera pose", err)
            return
        self.pose_source = pose
        self._services.push_async_callback(pose.stop)

    async def _start_mcu(self) -> None:
        """The MCU sensor node on its serial port: its detections go to this node's sinks as batches of their own."""
        from edgerun.mcu.bridge import McuBridge

        def publish(batch: DetectionBatch) -> None:
            now = time.monotonic()
            for sink in self.sinks:
                sink.submit(batch, now)

        bridge = McuBridge(self.cfg.mcu, self.node_id, publish)
        await bridge.start()  # returns at once: the port is opened, and reopened, by its own task
        self.mcu = bridge
        self._services.push_async_callback(bridge.stop)

    async def _start_fleet(self) -> None:
        """Join the swarm: claims from this node's detections, fleet objects it owns on every sink."""
        fleet = FleetMember(
            self.cfg.swarm,
            self.node_id,
            publish_object=self._publish_object,
            publish_event=self.publish_event,
            meta=self.member_meta,
            # pictures of finds only where a sink carries them (MQTT)
            publish_image=self._publish_object_image if any(s.carries_images for s in self.sinks) else None,
        )
        fleet.view_listeners.append(self._publish_swarm_view)
        await fleet.start()
        self.fleet = fleet
        if self.pipeline is not None:
            self.pipeline.find_cropper = fleet.cropper  # crops of finds, taken while the frame is still held
        self._services.push_async_callback(fleet.stop)  # before the sinks close: the leave is announced

    async def _start_offload(self) -> None:
        """Serve this node's model for neighbours, and/or send frames to a neighbour that serves it (#25)."""
        from edgerun.offload.client import OffloadClient
        from edgerun.offload.lane import OffloadLane
        from edgerun.offload.model_server import ModelServer
        from edgerun.offload.server import OffloadServer

        cfg, fleet, pipeline = self.cfg.offload, self.fleet, self.pipeline
        assert fleet is not None and pipeline is not None  # config checks: offload needs swarm.enabled
        if cfg.serve:
            bind = parse_hostport(cfg.bind, "offload.bind") if cfg.bind else (fleet.bind[0], 0)
            server = OffloadServer(
                fleet.keyring,
                self.node_id,
                ModelServer(self.serving, self.node_id, tracer=self.tracer).serve,
                workers=cfg.serve_workers,
                max_queue=cfg.serve_queue,
            )
            try:
                host, port = await server.start(bind)
            except OSError as err:
                raise ConfigError(
                    f"offload.bind: cannot listen on {bind[0]}:{bind[1]} ({err.strerror or err})"
                ) from None
            self.offload_server = server
            self._services.push_async_callback(server.close)
            log.info("offload: serving %s for neighbours on %s:%d", self.model_name, host, port)
        if cfg.mode != "never":
            client = OffloadClient(fleet.keyring, self.node_id, window=cfg.window)
            lane = OffloadLane(
                cfg,
                client,
                asyncio.get_running_loop(),
                pipeline.engine_slots,
                model_hash=lambda: self.model_hash,
                tracer=self.tracer,
            )
            self.offload = lane
            pipeline.offload = lane
            self._services.push_async_callback(client.close)
        self._start_task(self._offload_loop())

    async def _offload_loop(self, period_s: float = 1.0) -> None:
        """Once a second: measure what the local engine can do, and let the lane pick (or drop) a helper."""
        from edgerun.offload.capabilities import candidates_from_members

        fleet = self.fleet
        assert fleet is not None
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            rate = self._local_engine.update(self.stats, now)
            lane, agent = self.offload, fleet.agent
            if lane is None or agent is None:
                continue
            candidates = candidates_from_members(agent.members(), self.node_id, self.model_hash, agent.rtt_ms)
            capacity = rate.capacity_fps(self.pipeline.engine_slots.limit if self.pipeline else 1)
            lane.update(candidates, now, local_capacity_fps=capacity, source_fps=rate.source_fps)

    @property
    def model_hash(self) -> str:
        return self.pipeline.runtime.model.hash if self.pipeline else ""

    def _publish_object(self, payload: dict[str, Any], on_published: Callable[[], None] | None = None) -> None:
        """A fleet object to every sink; ``on_published`` once it is known published: on the broker's PUBACK
        where a sink confirms (MQTT), else as soon as the sinks took it (JSON Lines, DDS: nothing to confirm)."""
        confirmer = next((sink for sink in self.sinks if sink.confirms_objects), None)
        for sink in self.sinks:
            sink.publish_object(payload, on_published if sink is confirmer else None)
        if confirmer is None and on_published is not None:
            on_published()

    def _publish_object_image(self, object_id: str, jpeg: bytes, properties: list[tuple[str, str]]) -> None:
        """The picture of a fleet object this node owns, on every sink that carries pictures (MQTT)."""
        for sink in self.sinks:
            sink.publish_object_image(object_id, jpeg, properties)

    def _publish_swarm_view(self, view: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.publish_swarm_view(view)

    def member_meta(self) -> MemberMeta:
        """What this node gossips about itself: model, engine, health and where its camera is."""
        failover = self.failover
        pose = self.last_pose
        meta = MemberMeta(
            model=self.model_name,
            version=self.model_version,
            engine=self.engine_key,
            fallback=bool(failover is not None and failover.active_key and failover.active_key != failover.keys[0]),
            health=self.health.state,
            fps=round(self.fps(), 1),
        )
        server = self.offload_server
        if server is not None and server.address is not None:
            engine_ms = self._local_engine.infer_ms
            meta.serve_hash, meta.serve_port = self.model_hash, server.address[1]
            meta.infer_ms = round(engine_ms, 1)
            meta.queue = server.queue
            calls = self.pipeline.engine_slots.limit if self.pipeline else 1
            # Against what our own source asks of the engine, not what it gets: a node whose camera already
            # outruns its engine has nothing to spare, however many frames it manages to publish.
            meta.spare_fps = spare_fps(calls, engine_ms, self._local_engine.source_fps, server.served_fps)
        if pose is not None:
            meta.east, meta.north, meta.up = round(pose.east_m, 2), round(pose.north_m, 2), round(pose.up_m, 2)
            meta.yaw, meta.hfov = round(pose.yaw_deg, 1), round(pose.hfov_deg, 1)
        return quantised_capacity(meta)  # capacity in coarse steps: a figure wandering with every frame is no news

    def health_extra(self) -> dict[str, Any]:
        return {"swarm": self.fleet.view()} if self.fleet is not None else {}

    async def _watch_sinks(self, period_s: float = 0.5) -> None:
        """Mirror each sink's link state into health: ``sink.mqtt: connection refused`` while it is down."""
        while True:
            for sink in self.sinks:
                key = f"sink.{sink.KEY}"
                if sink.stats.connected:
                    self.health.clear_problem(key)
                else:
                    reason = getattr(sink, "status_reason", "") or "cannot deliver"
                    self.health.set_problem(key, reason)
            await asyncio.sleep(period_s)

    async def _start_http(self) -> None:
        svc = self.cfg.service
        if not svc.http_enabled:
            return
        from edgerun.service.http import HttpService

        registry = node_registry(self)
        http = HttpService(
            svc.http_host,
            svc.http_port,
            health=self.health,
            metrics_text=lambda: metrics_text(registry),
            snapshot_jpeg=self.snapshot_jpeg,
            health_extra=self.health_extra,
            snapshot_token_file=svc.snapshot_token_file,
        )
        await http.start()
        self.http_port = http.port
        self._services.push_async_callback(http.stop)

    async def _start_test_control(self, path: str) -> None:
        """The HIL rig's fault-injection socket; only ever from ``edgerun run --test-control``."""
        from edgerun.testing.control import ControlServer

        control = ControlServer(self, path)
        await control.start()
        self._services.push_async_callback(control.stop)

    async def _drain(self, pipeline: Pipeline) -> None:
        """Stop capture and let the frames in flight reach the sinks (before the sinks close)."""
        timeout = self.cfg.service.shutdown_timeout_s * 0.6
        pipeline.stop()
        if not await asyncio.get_running_loop().run_in_executor(None, pipeline.join, timeout):
            log.warning("frames in flight did not drain within %.1f s", timeout)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe batches reach the sinks

    async def _close_sinks(self) -> None:
        timeout = self.cfg.service.shutdown_timeout_s * 0.3
        await asyncio.gather(*(sink.close(timeout) for sink in self.sinks), return_exceptions=True)

    def summary(self) -> dict[str, Any]:
        """Counters for the end-of-run summary and the periodic metrics message."""
        stats = self.stats
        e2e = stats.end_to_end
        elapsed = (time.monotonic() - self.t_first_batch) if self.t_first_batch else 0.0
        return {
            "node": self.node_id,
            "model": self.model_name,
            "model_version": self.model_version,
            "engine": self.engine_key,
            "engine_failovers": self.failover.failovers if self.failover else 0,
            "engine_fallback_s": round(self.failover.fallback_seconds(), 3) if self.failover else 0.0,
            "state": self.health.state,
            "frames": stats.published,
            "captured": stats.captured,
            "inferred": stats.inferred,
            "fps": round((stats.published - 1) / elapsed, 2) if elapsed > 0 and stats.published > 1 else 0.0,
            "latency_p50_ms": round(e2e.percentile_ms(50), 3) if e2e.total else None,
            "latency_p99_ms": round(e2e.percentile_ms(99), 3) if e2e.total else None,
            "detections": stats.detections,
            "dropped": stats.dropped_total,
            "dropped_by_reason": {f"{s}/{r}": n for (s, r), n in sorted(stats.dropped.items())},
            "decoder_rows_dropped": self.decoder_rows_dropped(),  # rows that were no detection; frames went on
            "source_reconnects": stats.source_reconnects,
            "source_lost": stats.source_lost,  # frames a live source did not deliver while it was gone
            "stage_ms_p50": {
                name: round(s.latency.percentile_ms(50), 3) for name, s in stats.stages.items() if s.frames
            },
            # where /healthz and /snapshot.jpg answer: the ground station shows a node's live frame from it
            "http": f"{self.cfg.service.http_host}:{self.http_port}" if self.http_port else None,
            **self._offload_summary(),
        }

    def _offload_summary(self) -> dict[str, Any]:
        """Frames sent to a helper and what became of them; frames served for neighbours."""
        out: dict[str, Any] = {}
        if self.offload is not None:
            out["offload"] = {**self.offload.describe(), "offloaded": self.stats.offloaded}
        if self.offload_server is not None:
            server = self.offload_server
            out["offload_served"] = {**server.stats, "served_fps": round(server.served_fps, 2)}
        return out


def run_node(cfg: Config, seconds: float | None = None, *, test_control: str | None = None) -> int:
    """Run a node on a fresh event loop (uvloop when installed); ``test_control``: the HIL control socket."""
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(Node(cfg, test_control=test_control).run(seconds=seconds))

"""An MCU sensor node on a serial port, as a sub-source of the node: its detections go to the node's sinks.

``McuBridge`` owns the port (pyserial-asyncio-fast, on the node's loop, no thread), reopens it when it
goes away, turns each run of DETECTION messages with one timestamp into a ``DetectionBatch`` handed to
``submit_batch``, keeps the MCU's health (HELLO, HEARTBEAT) and the link's counters for /metrics, and
relays signed MCU model releases (``relay``). The protocol itself is ``McuLink`` and ``OtaRelay``.

Wiring it into a node (import it only when ``[mcu].enabled``: it needs the ``mcu`` extra)::

    bridge = McuBridge(cfg.mcu, cfg.node_id, lambda batch: publish_to_sinks(batch))
    await bridge.start()              # returns at once; the port is opened (and reopened) in a task
    registry.register(bridge)         # edgerun_mcu_* on /metrics
    result = await bridge.relay_directory(release_dir)   # an MCU model update
    await bridge.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.config import McuConfig
from edgerun.mcu.link import McuLink
from edgerun.mcu.ota_relay import OtaRelay, RelayResult
from edgerun.mcu.protocol import Ack, Detection, Hello, Log, Message
from edgerun.mcu.release import McuRelease, verify_mcu_release
from edgerun.ota.errors import Rejected
from edgerun.ota.minisign import PublicKey
from edgerun.types import DetectionBatch, Detections, FrameMeta

log = logging.getLogger(__name__)

LOG_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)
MCU_LOG_LINES_PER_S = 10  # an MCU stuck in a loop logging must not flood the node's log


class _SerialProtocol(asyncio.Protocol):
    def __init__(self, bridge: McuBridge) -> None:
        self.bridge = bridge
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.bridge.receive(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


class McuBridge:
    """One MCU on one port. ``start()``/``stop()`` on the node's loop; ``counters()`` and ``collect()`` for /metrics."""

    def __init__(
        self,
        cfg: McuConfig,
        node_id: str,
        submit_batch: Callable[[DetectionBatch], None],
        *,
        release_keys: list[PublicKey] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.submit_batch = submit_batch
        self.clock = clock
        self.wall_clock = wall_clock
        self.labels = tuple(cfg.labels)
        self.release_keys = release_keys if release_keys is not None else [PublicKey.load(p) for p in cfg.release_keys]
        self.link = McuLink()
        self.batches = 0
        self.detections = 0
        self.connects = 0
        self.connect_errors = 0
        self.submit_errors = 0
        self.ota_results: dict[str, int] = {}
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._connected = asyncio.Event()
        self._answer = asyncio.Event()
        self._relay: OtaRelay | None = None
        self._relay_lock = asyncio.Lock()
        self._hello_logged: Hello | None = None
        self.mcu_logs_suppressed = 0
        self._log_window = (0.0, 0)  # (second it started, lines logged in it)

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"mcu-{self.cfg.port}")

    async def stop(self) -> None:
        self._stopping = True
        if self._transport is not None:
            self._transport.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        import serial_asyncio_fast

        loop = asyncio.get_running_loop()
        failing = False
        while not self._stopping:
            try:
                transport, protocol = await serial_asyncio_fast.create_serial_connection(
                    loop, lambda: _SerialProtocol(self), self.cfg.port, baudrate=self.cfg.baud
                )
            except (OSError, ValueError) as err:  # pyserial's SerialException is an OSError
                self.connect_errors += 1
                if not failing:
                    log.warning(
                        "mcu %s: cannot open (%s); retrying every %.1f s", self.cfg.port, err, self.cfg.reconnect_s
                    )
                failing = True
                await asyncio.sleep(self.cfg.reconnect_s)
                continue
            failing = False
            self.connects += 1
            self.link.reset_rx()
            self._transport = transport
            self._connected.set()
            log.info("mcu %s: port open at %d baud", self.cfg.port, self.cfg.baud)
            self.send(Hello(0, 0, 0, 0, 0))  # asks the MCU to introduce itself
            assert isinstance(protocol, _SerialProtocol)
            try:
                exc = await protocol.closed
            finally:
                self._transport = None
                self._connected.clear()
                transport.close()
            if not self._stopping:
                log.warning("mcu %s: link lost (%s); reopening", self.cfg.port, exc or "closed")
                await asyncio.sleep(self.cfg.reconnect_s)

    def send(self, msg: Message) -> int | None:
        """Write one message; the sequence number used, or None when the port is not open."""
        if self._transport is None:
            return None
        seq, data = self.link.send(msg)
        self._transport.write(data)
        return seq

    def receive(self, data: bytes) -> None:
        """Bytes from the port (also the entry point for tests): detections to the sinks, answers to the relay."""
        run: list[Detection] = []
        for msg in self.link.receive(data):
            if isinstance(msg, Detection):
                if run and run[-1].timestamp_ms != msg.timestamp_ms:
                    self._submit(run)
                    run = []
                run.append(msg)
                continue
            if isinstance(msg, Ack):
                if self._relay is not None:
                    self._relay.on_ack(msg)
                    self._answer.set()
            elif isinstance(msg, Hello):
                if msg != self._hello_logged:
                    log.info(
                        "mcu %s: device %08x firmware %#x model %s v%d (slot %d)",
                        self.cfg.port,
                        msg.device_id,
                        msg.fw_version,
                        msg.name or "-",
                        msg.model_version,
                        msg.active_slot,
                    )
                    self._hello_logged = msg
            elif isinstance(msg, Log):
                self._log_line(msg)
        if run:
            self._submit(run)

    def _log_line(self, msg: Log) -> None:
        now = self.clock()
        start, lines = self._log_window
        if now - start >= 1.0:
            start, lines = now, 0
        if lines >= MCU_LOG_LINES_PER_S:
            self.mcu_logs_suppressed += 1
            return
        self._log_window = (start, lines + 1)
        level = LOG_LEVELS[min(msg.level, len(LOG_LEVELS) - 1)]
        log.log(level, "mcu %s: %s", self.cfg.port, msg.text.decode("utf-8", "replace"))

    def _submit(self, run: list[Detection]) -> None:
        hello = self.link.hello
        boxes = np.array([d.box for d in run], dtype=np.float32)
        scores = np.array([d.score_q16 for d in run], dtype=np.float32) / np.float32(65535.0)
        class_ids = np.array([d.class_id for d in run], dtype=np.int32)
        meta = FrameMeta(
            seq=self.batches,
            source=f"mcu:{hello.device_id:08x}" if hello else f"mcu:{self.cfg.port}",
            width=hello.frame_width if hello else 0,
            height=hello.frame_height if hello else 0,
            wall_time=self.wall_clock(),
            t_capture=self.clock(),
        )
        batch = DetectionBatch(
            node_id=self.node_id,
            meta=meta,
            detections=Detections(boxes=boxes, scores=scores, class_ids=class_ids),
            labels=self.labels,
            model_name=hello.name if hello else "",
            model_version=hello.model_version if hello else 0,
            engine="mcu",
            stamps={"mcu_ms": float(run[0].timestamp_ms)},
        )
        self.batches += 1
        self.detections += len(run)
        try:
            self.submit_batch(batch)
        except Exception:  # a sink bug must not take the serial link down with it
            self.submit_errors += 1
            log.exception("mcu %s: submitting a batch failed", self.cfg.port)

    async def relay_directory(self, directory: str | Path) -> RelayResult:
        """Verify a release directory against the trusted keys, then relay it; Rejected when it does not verify."""
        try:
            release = verify_mcu_release(directory, self.release_keys)
        except Rejected as err:
            self.ota_results[err.code] = self.ota_results.get(err.code, 0) + 1
            log.error("mcu %s: release refused by the node: %s", self.cfg.port, err)
            raise
        return await self.relay(release)

    async def relay(self, release: McuRelease) -> RelayResult:
        """Send a verified release to the MCU, chunk by chunk; the MCU verifies it again before it activates it."""
        async with self._relay_lock:
            relay = OtaRelay(release, self.cfg.ota_chunk, self.cfg.ack_timeout_s, self.cfg.ota_retries)
            self._relay = relay
            try:
                while not relay.finished:
                    msg = relay.next_message()
                    if msg is not None:
                        seq = self.send(msg)
                        if seq is not None:
                            relay.sent(int(msg.TYPE), seq, self.clock())
                        else:
                            # No port: wait for it as long as an answer would be waited for, then count a try.
                            relay.sent(int(msg.TYPE), -1, self.clock())
                    deadline = relay.next_deadline()
                    timeout = None if deadline is None else max(0.0, deadline - self.clock())
                    self._answer.clear()
                    if relay.next_deadline() is not None:
                        # asyncio.wait, not wait_for: before 3.12 wait_for can swallow a cancel that races an ACK.
                        waiter = asyncio.ensure_future(self._answer.wait())
                        try:
                            await asyncio.wait({waiter}, timeout=timeout)
                        finally:
                            waiter.cancel()
                    relay.poll(self.clock())
            finally:
                self._relay = None
            result = relay.result()
            key = "ok" if result.ok else result.reason
            self.ota_results[key] = self.ota_results.get(key, 0) + 1
            name, version = release.manifest.name, release.manifest.version
            if result.ok:
                log.info(
                    "mcu %s: %s v%d installed (resumed at %d, %d resends)",
                    self.cfg.port,
                    name,
                    version,
                    result.resumed_from,
                    result.resends,
                )
            else:
                log.error("mcu %s: %s v%d not installed: %s", self.cfg.port, name, version, result.reason)
            return result

    def counters(self) -> dict[str, Any]:
        hb = self.link.heartbeat
        hello = self.link.hello
        c = self.link.counters
        return {
            "connected": self.connected,
            "connects": self.connects,
            "connect_errors": self.connect_errors,
            "frames": c.frames,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "lost_frames": c.lost,
            "dropped_frames": dict(self.link.drop_totals()),
            "batches": self.batches,
            "detections": self.detections,
            "submit_errors": self.submit_errors,
            "mcu_logs_suppressed": self.mcu_logs_suppressed,
            "mcu_uptime_ms": hb.uptime_ms if hb else 0,
            "mcu_detections_sent": hb.detections_sent if hb else 0,
            "mcu_detections_dropped": hb.detections_dropped if hb else 0,
            "mcu_rx_bad_frames": hb.rx_bad_frames if hb else 0,
            "model_version": hello.model_version if hello else 0,
            "ota": dict(self.ota_results),
        }

    def collect(self) -> Iterator[Any]:
        """Prometheus metric families (register the bridge as a collector on the node's registry)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.counters()
        port = [self.cfg.port]

        def family(kind: type, name: str, doc: str, value: float) -> Any:
            f = kind(name, doc, labels=["port"])
            f.add_metric(port, value)
            return f

        yield family(
            GaugeMetricFamily,
            "edgerun_mcu_connected",
            "1 while the MCU's serial port is open.",
            1.0 if c["connected"] else 0.0,
        )
        yield family(CounterMetricFamily, "edgerun_mcu_frames", "Frames received from the MCU.", c["frames"])
        yield family(
            CounterMetricFamily,
            "edgerun_mcu_lost_frames",
            "Frames the MCU numbered that never arrived.",
            c["lost_frames"],
        )
        dropped = CounterMetricFamily(
            "edgerun_mcu_dropped_frames", "Frames from the MCU dropped, by reason.", labels=["port", "reason"]
        )
        for reason, count in sorted(c["dropped_frames"].items()):
            dropped.add_metric([self.cfg.port, reason], count)
        yield dropped
        yield family(
            CounterMetricFamily, "edgerun_mcu_detections", "MCU detections handed to the sinks.", c["detections"]
        )
        yield family(
            CounterMetricFamily,
            "edgerun_mcu_reported_dropped",
            "Detections the MCU reports it dropped (transmit buffer full).",
            c["mcu_detections_dropped"],
        )
        yield family(
            GaugeMetricFamily,
            "edgerun_mcu_uptime_seconds",
            "MCU uptime from its last heartbeat.",
            c["mcu_uptime_ms"] / 1000.0,
        )
        yield family(GaugeMetricFamily, "edgerun_mcu_model_version", "Model version the MCU runs.", c["model_version"])
        ota = CounterMetricFamily("edgerun_mcu_ota", "MCU model updates by outcome.", labels=["port", "result"])
        for result, count in sorted(c["ota"].items()):
            ota.add_metric([self.cfg.port, result], count)
        yield ota

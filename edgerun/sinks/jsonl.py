"""Detections as JSON Lines, to a file or standard output.

A file write or a full stdout pipe can block, so the loop only queues the
batch in a bounded outbox; a writer thread encodes and writes. When the
writer falls behind the outbox drops the oldest batch and counts it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

import msgspec

from edgerun import wire
from edgerun.config import JsonlSinkConfig
from edgerun.sinks.base import Outbox, Sink
from edgerun.types import DetectionBatch

log = logging.getLogger(__name__)


class JsonlSink(Sink):
    KEY = "jsonl"

    def __init__(self, cfg: JsonlSinkConfig, node_id: str = "") -> None:
        super().__init__()
        self.cfg = cfg
        self.node_id = node_id or socket.gethostname()  # as the MQTT sink names it
        self.status_reason = ""
        self._outbox = Outbox(cfg.outbox, self.stats)
        self._cond = threading.Condition()
        self._closing = False
        self._encoder = msgspec.json.Encoder()
        self._file: IO[bytes] | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        if self.cfg.path == "-":
            self._file = sys.stdout.buffer
        else:
            self._file = open(self.cfg.path, "ab")
        self._thread = threading.Thread(target=self._write_loop, name="edgerun-jsonl", daemon=True)
        self._thread.start()

    def submit(self, batch: DetectionBatch, t_submit: float) -> None:
        self.stats.submitted += 1
        with self._cond:
            self._outbox.put(("batch", batch, t_submit))
            self._cond.notify()

    def publish_event(self, kind: str, data: dict[str, Any]) -> None:
        """Events go to the same stream with a different schema, so one file tells the whole story."""
        payload = wire.event_payload(self.node_id, kind, data)
        with self._cond:
            self._outbox.put(("event", payload, 0.0))
            self._cond.notify()

    def publish_object(self, payload: dict[str, Any], on_delivered: Callable[[], None] | None = None) -> None:
        """Fleet objects go to the same stream too: the file says what this node reported for the fleet."""
        with self._cond:
            self._outbox.put(("object", payload, 0.0))
            self._cond.notify()

    def _write_loop(self) -> None:
        out = self._file
        assert out is not None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._outbox) or self._closing)
                if not len(self._outbox):
                    return
                items = [self._outbox.pop() for _ in range(len(self._outbox))]
            lines = bytearray()
            sent = 0
            for kind, item, t_submit in items:
                payload = item.to_wire(t_submit) if kind == "batch" else item
                lines += self._encoder.encode(payload)
                lines += b"\n"
                sent += kind == "batch"
            try:
                out.write(lines)
                out.flush()
                self.stats.sent += sent
                self.stats.connected = True
                self.status_reason = ""
            except (OSError, ValueError) as err:
                self.stats.errors += 1
                if self.stats.connected:
                    log.error("jsonl sink %s: write failed: %s", self.cfg.path, err)
                self.stats.connected = False
                self.status_reason = f"write failed: {err}"

    async def close(self, timeout: float = 1.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            # The writer drains what is queued before it sees _closing with an empty outbox.
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if self._file is not None and self._file is not sys.stdout.buffer:
            self._file.close()

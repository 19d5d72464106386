"""``OffloadServer``: a helper's side of the offload hop. Frames in over TCP, detections out.

Each connection is read straight into length-checked buffers (``FrameParser``); a complete frame is opened
with the swarm keyring on the loop, and the request goes to a thread pool of ``workers`` that decodes the
image and runs the injected ``serve`` callable (the helper's own engine and decoder). At most ``max_queue``
requests wait for a worker: one more is answered "busy" at once, so the origin serves it itself instead of
waiting. A request whose ``budget_ms`` ran out while it waited is answered "expired" without calling ``serve``.
Replies go out as they finish, in any order (ids match them).

Unauthenticated bytes are bounded across all connections, as in ``swarm.transport``: a connection is charged
``CONNECTION_COST`` until its first frame opens, and each frame body the length its prefix declares while it is
read, against one shared ``unauth_budget_bytes``; a connection that does not fit is closed and counted
(``dropped["unauth_budget"]``). An oversized prefix closes the connection before a byte of its body is read.
A forged, replayed or stale envelope closes the connection; a frame that must be completed (or a new
connection's first frame) has ``frame_timeout_s``. Every drop is counted by reason in ``stats["dropped"]``;
the first of each reason is logged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from edgerun.offload import codec
from edgerun.offload.protocol import (
    MAX_REQUEST_BYTES,
    STATUSES,
    EnvelopeRejected,
    FrameParser,
    InferReply,
    InferRequest,
    OffloadProtocolError,
    decode_request,
    detections_to_reply,
    encode_reply,
    open_envelope,
    seal_frame,
    valid_traceparent,
)
from edgerun.types import Detections
from swarm.keyring import KIND_OFFLOAD_REPLY, KIND_OFFLOAD_REQUEST, Keyring
from swarm.transport import UnauthBudget

log = logging.getLogger(__name__)

Address = tuple[str, int]
CONNECTION_COST = 4096  # charged per connection until it authenticates: 1024 idle sockets fill 4 MiB
FRAME_TIMEOUT_S = 10.0
SERVED_WINDOW_S = 5.0  # served_fps is the rate over this much recent time
# Always in stats, zero or not; "bad": the image did not decode (dropped[reason] says why).
COUNTERS = ("requests", "served", "busy", "expired", "model", "errors", "bad", "bytes_in", "bytes_out")


@dataclass(slots=True)
class ServeResult:
    """What ``serve`` made of one frame: detections normalised to the model input (as ``Decoder.decode``
    returns them), or a status other than "ok" ("model": not the model this helper serves; "busy"; "error")."""

    detections: Detections | None
    status: str = "ok"
    infer_ms: float = 0.0


# (model hash, BGR uint8 image H x W x 3 of the model's input size, traceparent or "", the origin's name as its
# sealed envelope says) -> result; runs in a worker
ServeFn = Callable[[str, np.ndarray, str, str], ServeResult]


class _Connection(asyncio.BufferedProtocol):
    """One origin's connection: frames in through a FrameParser, replies out as workers finish them."""

    def __init__(self, server: OffloadServer) -> None:
        self._server = server
        self._parser = FrameParser(MAX_REQUEST_BYTES, charge=self._charge)
        self._transport: asyncio.Transport | None = None
        self.peer: Address = ("", 0)
        self.sender = ""  # the node name of the first envelope this connection opened
        self._charged = 0  # CONNECTION_COST until authenticated
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        peer = transport.get_extra_info("peername")
        self.peer = (peer[0], peer[1]) if peer else ("", 0)
        server = self._server
        server._connections.add(self)
        server.counters["connections"] += 1
        if not server.unauth.charge(CONNECTION_COST):
            server._count("unauth_budget", self.peer)
            self.close()
            return
        self._charged = CONNECTION_COST
        self._arm_timer()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._parser.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        server = self._server
        server.counters["bytes_in"] += nbytes
        parser = self._parser
        frame = parser.buffer_updated(nbytes)
        if parser.error is not None:
            server._count("unauth_budget" if parser.error == "budget" else parser.error, self.peer)
            self.close()
            return
        if frame is None:
            if parser.in_frame and self._timer is None:
                self._arm_timer()  # a frame started: it has frame_timeout_s to arrive whole
            return
        self._release_frame()
        if self._charged == 0 and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        server._on_frame(self, frame)

    def eof_received(self) -> bool | None:
        return None  # the origin stopped sending: close (replies still owed are not wanted any more)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()
        self._server._connections.discard(self)

    # -- replies, accounting ------------------------------------------------------------------------------------

    def send(self, frame: bytes) -> bool:
        if self.closed or self._transport is None or self._transport.is_closing():
            return False
        self._transport.write(frame)
        return True

    def pause_writing(self) -> None:
        # An origin that does not read its replies stops being read: what it can queue here stays bounded.
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def authenticated(self, sender: str) -> None:
        if self._charged:
            self._server.unauth.release(self._charged)
            self._charged = 0
            self.sender = sender
        if self._timer is not None and not self._parser.in_frame:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Stop reading and close once what is written has gone."""
        self._finish()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        self._finish()
        if self._transport is not None:
            self._transport.abort()

    def _charge(self, n: int) -> bool:
        return self._server.unauth.charge(n)

    def _release_frame(self) -> None:
        if self._parser.charged:
            self._server.unauth.release(self._parser.charged)
            self._parser.charged = 0

    def _arm_timer(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._server.frame_timeout_s, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        self._server._count("timeout", self.peer)
        self.close()

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._release_frame()
        if self._charged:
            self._server.unauth.release(self._charged)
            self._charged = 0
        self.closed = True


class OffloadServer:
    """A helper's offload listener; ``serve`` runs in a pool of ``workers`` threads, never on the loop."""

    def __init__(
        self,
        keyring: Keyring,
        node_name: str,
        serve: ServeFn,
        *,
        workers: int = 1,
        max_queue: int = 8,
        unauth_budget_bytes: int = 4 << 20,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if workers < 1 or max_queue < 0:
            raise ValueError(f"workers must be >= 1 and max_queue >= 0, got {workers} and {max_queue}")
        self.keyring = keyring
        self.node_name = node_name
        self._serve = serve
        self.workers = workers
        self.max_queue = max_queue
        self.unauth = UnauthBudget(unauth_budget_bytes)  # shared by every connection not yet authenticated
        self.frame_timeout_s = frame_timeout_s
        self._clock = clock
        self._wall = wall
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.dropped: Counter[str] = Counter()
        self._waiting = 0  # requests handed to the pool that no worker has picked up yet
        self._waiting_lock = threading.Lock()
        self._served_at: deque[float] = deque(maxlen=4096)
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.address: Address | None = None

    async def start(self, bind: Address) -> Address:
        """Listens on ``bind`` and returns the bound address."""
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="offload-serve")
        self._server = await loop.create_server(lambda: _Connection(self), bind[0], bind[1])
        sockname = self._server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        return self.address

    async def close(self) -> None:
        """Stops listening and drops every connection at once (origins see their frames in flight "lost"),
        then waits for the serve calls already running."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown(wait=False, cancel_futures=True)
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    @property
    def queue(self) -> int:
        return self._waiting

    @property
    def served_fps(self) -> float:
        since = self._clock() - SERVED_WINDOW_S
        return round(sum(1 for t in self._served_at if t > since) / SERVED_WINDOW_S, 3)

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "dropped": dict(self.dropped),
            **self.counters,
            "queue": self.queue,
            "served_fps": self.served_fps,
            "unauth_buffered_peak": self.unauth.peak,
        }

    # -- requests -----------------------------------------------------------------------------------------------

    def _on_frame(self, conn: _Connection, envelope: bytes) -> None:
        try:
            sender, plaintext = open_envelope(self.keyring, envelope, self._wall(), KIND_OFFLOAD_REQUEST)
        except EnvelopeRejected as exc:
            self._count(exc.reason, conn.peer, exc)
            conn.close()  # forged, replayed, stale: nothing more from this connection is believed
            return
        conn.authenticated(sender)
        try:
            request = decode_request(plaintext)
        except OffloadProtocolError as exc:
            self._count(exc.reason, conn.peer, exc)
            return
        self.counters["requests"] += 1
        traceparent = request.traceparent
        if not valid_traceparent(traceparent):
            self.counters["traceparent_ignored"] += 1
            traceparent = ""  # a bad trace header costs the trace, not the frame
        with self._waiting_lock:
            full = self._waiting >= self.max_queue
            if not full:
                self._waiting += 1
        if full or self._executor is None:
            self._finished(conn, InferReply(request.id, "busy"), "busy")
            return
        arrival = self._clock()
        job = self._executor.submit(self._work, request, traceparent, sender, arrival)
        loop = asyncio.get_running_loop()
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(self._job_done, conn, done))

    def _work(
        self, request: InferRequest, traceparent: str, origin: str, arrival: float
    ) -> tuple[InferReply, str, codec.CodecError | None]:
        """In a worker: (reply, the counter it goes to, why its image was refused); the loop counts them."""
        with self._waiting_lock:
            self._waiting -= 1
        queue_ms = (self._clock() - arrival) * 1000.0
        if queue_ms >= request.budget_ms:
            return InferReply(request.id, "expired", queue_ms=round(queue_ms, 3)), "expired", None
        try:
            image = codec.decode(request.data, request.codec, request.height, request.width)
        except codec.CodecError as exc:
            return InferReply(request.id, "bad", queue_ms=round(queue_ms, 3)), "bad", exc
        try:
            result = self._serve(request.model, image, traceparent, origin)
            if result.status == "ok" and result.detections is not None:
                reply = detections_to_reply(request.id, result.detections, result.infer_ms, queue_ms)
                return reply, "served", None
        except Exception:
            if self.counters["errors"] == 0:
                log.exception("offload %s: serve failed on a frame", self.node_name)
            return InferReply(request.id, "error", queue_ms=round(queue_ms, 3)), "errors", None
        status = result.status if result.status in STATUSES and result.status != "ok" else "error"
        reply = detections_to_reply(request.id, Detections.empty(), result.infer_ms, queue_ms)
        reply.status = status
        return reply, "errors" if status == "error" else status, None

    def _job_done(self, conn: _Connection, job: Future[tuple[InferReply, str, codec.CodecError | None]]) -> None:
        if job.cancelled():
            return  # the server is closing
        reply, outcome, refused = job.result()
        if refused is not None:
            self._count(refused.reason, conn.peer, refused)
        if outcome == "served":
            self._served_at.append(self._clock())
        self._finished(conn, reply, outcome)

    def _finished(self, conn: _Connection, reply: InferReply, outcome: str) -> None:
        self.counters[outcome] += 1
        frame = seal_frame(self.keyring, self.node_name, encode_reply(reply), self._wall(), KIND_OFFLOAD_REPLY)
        if conn.send(frame):
            self.counters["bytes_out"] += len(frame)
        else:
            self.counters["replies_unsent"] += 1  # the origin went away first

    # -- accounting ---------------------------------------------------------------------------------------------

    def _count(self, reason: str, peer: Address | None = None, exc: Exception | None = None) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] == 1:  # once per reason; later ones are only counted
            log.warning("offload %s: dropped a frame from %s (%s): %s", self.node_name, peer, reason, exc or reason)

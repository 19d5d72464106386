"""``OffloadClient``: an origin's side of the offload hop, on the node's asyncio loop.

One persistent TCP connection per helper, full duplex, multiplexed by request id; at most ``window`` requests in
flight to one helper (one more is refused at once with "window": the caller serves that frame itself). Every
request ends in exactly one way: a reply, or ``OffloadError`` with its reason, and its pending entry is removed
on every path (reply, deadline, broken connection, the caller cancelling), so nothing leaks.

* late: no reply before the deadline. The helper may still answer; that reply is discarded and counted
  (``late_replies``).
* lost: the connection broke with the request in flight. Every request in flight on it fails at once, so a
  helper that dies costs the frames in flight, not a deadline each; the next request connects again.
* refused: no connection within ``connect_timeout_s``.
* window, protocol: refused here (too many in flight; a request too big to send or a reply that breaks the
  protocol); busy, expired, model, error: the helper said so.

Worker threads call ``asyncio.run_coroutine_threadsafe(client.infer(...), loop).result(timeout=...)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import msgspec

from edgerun.offload.protocol import (
    MAX_BUDGET_MS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    EnvelopeRejected,
    FrameParser,
    InferReply,
    InferRequest,
    OffloadError,
    OffloadProtocolError,
    decode_reply,
    decode_request,
    encode_request,
    open_envelope,
    seal_frame,
)
from swarm.keyring import KIND_OFFLOAD_REPLY, KIND_OFFLOAD_REQUEST, OVERHEAD, Keyring

log = logging.getLogger(__name__)

Address = tuple[str, int]
# Always in stats, zero or not (one per way a request ends, and the bytes).
COUNTERS = (
    "requests",
    "replies",
    "late",
    "lost",
    "refused",
    "window",
    "busy",
    "expired",
    "model",
    "error",
    "protocol",
    "late_replies",
    "bytes_out",
    "bytes_in",
)
# A connection opened ahead of a helper's first frame waits this long: two SYN retransmissions (1 s, 3 s).
WARM_CONNECT_TIMEOUT_S = 3.5
_HELPER_SAID = {"busy": "busy", "expired": "expired", "model": "model", "error": "error", "bad": "protocol"}


class _HelperConnection(asyncio.BufferedProtocol):
    """The connection to one helper: replies in through a FrameParser, matched to pending requests by id."""

    def __init__(self, client: OffloadClient, addr: Address) -> None:
        self._client = client
        self.addr = addr
        self._parser = FrameParser(MAX_REPLY_BYTES)
        self._transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[InferReply]] = {}
        self.next_id = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._parser.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        client = self._client
        client.counters["bytes_in"] += nbytes
        frame = self._parser.buffer_updated(nbytes)
        if self._parser.error is not None:
            client._count(self._parser.error, self.addr)
            self.close()
            return
        if frame is not None:
            client._on_reply_frame(self, frame)

    def eof_received(self) -> bool | None:
        return None  # the helper closed its side: close ours too (connection_lost fails what is in flight)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all()

    def send(self, frame: bytes) -> None:
        assert self._transport is not None
        self._transport.write(frame)

    def close(self) -> None:
        self._fail_all()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _fail_all(self) -> None:
        if not self.closed:
            self.closed = True
            self._client._forget(self)
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(OffloadError("lost", f"connection to {self.addr[0]}:{self.addr[1]} broke"))


class OffloadClient:
    """Sends frames to helpers; ``infer`` and ``close`` run on the loop that owns the connections."""

    def __init__(
        self,
        keyring: Keyring,
        node_name: str,
        *,
        window: int = 4,
        connect_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.keyring = keyring
        self.node_name = node_name
        self.window = window
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._wall = wall
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.dropped: Counter[str] = Counter()
        self._connections: dict[Address, _HelperConnection] = {}
        self._connecting: dict[Address, asyncio.Future[_HelperConnection]] = {}
        self._in_flight: Counter[Address] = Counter()
        self._closed = False

    @property
    def stats(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped), **self.counters}

    def in_flight(self, addr: Address) -> int:
        """Requests to ``addr`` that have not ended yet (connecting, sent, or waiting for their reply)."""
        return self._in_flight[addr]

    async def infer(self, addr: Address, request: InferRequest, deadline_s: float) -> InferReply:
        """Sends ``request`` to the helper at ``addr`` and returns its "ok" reply, or raises OffloadError.

        ``deadline_s`` is on this client's clock (``time.monotonic`` unless injected). The client sets the
        request's ``id``, and its ``budget_ms`` to the time left (or keeps the caller's, when that is smaller:
        a caller may keep the return trip's share back)."""
        if self._closed:
            raise self._fail("refused", "the offload client is closed")
        if self._in_flight[addr] >= self.window:
            raise self._fail("window", f"{self.window} requests already in flight to {addr[0]}:{addr[1]}")
        self.counters["requests"] += 1
        self._in_flight[addr] += 1
        try:
            return await self._infer(addr, request, deadline_s)
        finally:
            self._in_flight[addr] -= 1
            if self._in_flight[addr] <= 0:
                del self._in_flight[addr]

    async def _infer(self, addr: Address, request: InferRequest, deadline_s: float) -> InferReply:
        try:
            conn = await asyncio.wait_for(self._connection(addr), max(0.0, deadline_s - self._clock()))
        except asyncio.TimeoutError:
            raise self._fail("late", "the deadline passed while connecting") from None
        except OffloadError as exc:
            self.counters[exc.reason] += 1  # per request; requests that waited for one attempt share its failure
            raise
        if conn.closed:  # it broke between connecting and this task running again
            raise self._fail("lost", f"connection to {addr[0]}:{addr[1]} broke")
        left_ms = int((deadline_s - self._clock()) * 1000.0)
        if left_ms <= 0:
            raise self._fail("late", "the deadline passed before the request was sent")
        budget = min(left_ms, MAX_BUDGET_MS, request.budget_ms if request.budget_ms > 0 else MAX_BUDGET_MS)
        request_id = conn.next_id
        conn.next_id += 1
        request = msgspec.structs.replace(request, id=request_id, budget_ms=budget)
        plaintext = encode_request(request)
        if len(plaintext) + OVERHEAD > MAX_REQUEST_BYTES:
            self._count("oversized_out", addr)
            raise self._fail("protocol", f"request of {len(plaintext)} bytes is over {MAX_REQUEST_BYTES}")
        try:
            decode_request(plaintext)  # what the helper would drop unanswered (a deadline lost) fails here, named
        except OffloadProtocolError as exc:
            self._count("invalid_out", addr, exc)
            raise self._fail("protocol", str(exc)) from None
        future: asyncio.Future[InferReply] = asyncio.get_running_loop().create_future()
        conn.pending[request_id] = future
        try:
            frame = seal_frame(self.keyring, self.node_name, plaintext, self._wall(), KIND_OFFLOAD_REQUEST)
            conn.send(frame)
            self.counters["bytes_out"] += len(frame)
            try:
                reply = await asyncio.wait_for(future, max(0.0, deadline_s - self._clock()))
            except asyncio.TimeoutError:
                raise self._fail("late", f"no reply from {addr[0]}:{addr[1]} before the deadline") from None
        except OffloadError as exc:
            if exc.reason == "lost":
                self.counters["lost"] += 1
            raise
        finally:
            conn.pending.pop(request_id, None)  # late, lost, cancelled: a reply that still comes is counted late
        self.counters["replies"] += 1
        if reply.status != "ok":
            raise self._fail(_HELPER_SAID.get(reply.status, "protocol"), f"the helper answered {reply.status!r}")
        return reply

    async def connect(self, addr: Address, timeout_s: float = WARM_CONNECT_TIMEOUT_S) -> None:
        """Opens the connection to a helper before its first frame, or raises OffloadError("refused").

        A lost SYN or SYN-ACK costs TCP's initial retransmission timeout (1 s), longer than a frame's
        deadline: paid here, when a helper is chosen, it costs no frame (on a 10 % loss link one connect in
        five loses one)."""
        if self._closed:
            raise self._fail("refused", "the offload client is closed")
        conn = self._connections.get(addr)
        if conn is not None and not conn.closed:
            return
        await self._connection(addr, timeout_s)

    async def close(self) -> None:
        """Closes every connection; requests in flight fail "lost", later ones "refused"."""
        self._closed = True
        for conn in list(self._connections.values()):
            conn.close()

    # -- connections --------------------------------------------------------------------------------------------

    async def _connection(self, addr: Address, timeout_s: float | None = None) -> _HelperConnection:
        conn = self._connections.get(addr)
        if conn is not None and not conn.closed:
            return conn
        # Requests that find no connection share one attempt to make it.
        attempt = self._connecting.get(addr)
        if attempt is None:
            attempt = asyncio.ensure_future(self._connect(addr, timeout_s or self.connect_timeout_s))
            self._connecting[addr] = attempt
            attempt.add_done_callback(self._connect_done)
        return await asyncio.shield(attempt)

    def _connect_done(self, attempt: asyncio.Future[_HelperConnection]) -> None:
        for addr, pending in list(self._connecting.items()):
            if pending is attempt:
                del self._connecting[addr]
        if not attempt.cancelled():
            attempt.exception()  # retrieved: every waiter may have given up on it already

    async def _connect(self, addr: Address, timeout_s: float) -> _HelperConnection:
        loop = asyncio.get_running_loop()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _HelperConnection(self, addr), addr[0], addr[1]), timeout_s
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise OffloadError("refused", f"cannot connect to {addr[0]}:{addr[1]}: {exc or 'timed out'}") from None
        if self._closed:  # closed while connecting: requests waiting for this attempt are refused
            conn.close()
            raise OffloadError("refused", "the offload client is closed")
        self.counters["connects"] += 1
        self._connections[addr] = conn
        return conn

    def _forget(self, conn: _HelperConnection) -> None:
        if self._connections.get(conn.addr) is conn:
            del self._connections[conn.addr]

    # -- replies ------------------------------------------------------------------------------------------------

    def _on_reply_frame(self, conn: _HelperConnection, envelope: bytes) -> None:
        try:
            _sender, plaintext = open_envelope(self.keyring, envelope, self._wall(), KIND_OFFLOAD_REPLY)
        except EnvelopeRejected as exc:
            self._count(exc.reason, conn.addr, exc)
            conn.close()  # a forged or replayed reply: nothing more from this connection is believed
            return
        try:
            reply = decode_reply(plaintext)
        except OffloadProtocolError as exc:
            self._count(exc.reason, conn.addr, exc)
            return
        future = conn.pending.pop(reply.id, None)
        if future is None or future.done():
            if reply.id < conn.next_id:
                self.counters["late_replies"] += 1  # its request gave up (deadline or caller) before it came
            else:
                self._count("unknown_id", conn.addr)
            return
        future.set_result(reply)

    # -- accounting ---------------------------------------------------------------------------------------------

    def _fail(self, reason: str, message: str) -> OffloadError:
        self.counters[reason] += 1
        return OffloadError(reason, message)

    def _count(self, reason: str, addr: Address | None = None, exc: Exception | None = None) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] == 1:  # once per reason; later ones are only counted
            log.warning("offload %s: dropped a reply from %s (%s): %s", self.node_name, addr, reason, exc or reason)

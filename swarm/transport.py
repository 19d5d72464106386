"""UDP datagrams and TCP streams for the swarm on asyncio, every packet sealed and opened with the keyring.

Datagrams carry probes, acks and piggybacked gossip; a TCP stream carries one request and one reply (push-pull
state exchange, the fallback probe), framed as ``length(4, big endian) | envelope`` (length 0: no reply). The UDP
and TCP listeners share one port number, as in memberlist.

Untrusted bytes never raise into the loop: an oversized, short, forged, replayed or otherwise malformed packet is
dropped and counted in ``stats["dropped"][reason]``; the first drop of each reason is logged, the rest counted.
Failures that are not a rejected packet (a refused or timed-out stream, an ICMP error, a send error) are plain
counters beside bytes and packets in/out.
``loss`` drops that share of received datagrams on purpose (counted apart, as ``injected_loss``): the loopback
stand-in for a lossy radio link where network namespaces and nftables are not available.

A TCP request is not authenticated until its whole frame has arrived, so what unauthenticated peers can make
this member hold is bounded across all of them: each accepted connection is charged ``CONNECTION_COST`` and, once
its 4-byte length prefix is read, the length it declares, against one shared ``unauth_budget_bytes`` (1 MiB).
A connection that does not fit is closed at once and counted as ``dropped["unauth_budget"]``; nothing is read
past the length prefix until the body is charged, and the body is read straight into a buffer of that size.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from swarm.keyring import KIND_DATAGRAM, KIND_STREAM_REPLY, KIND_STREAM_REQUEST, Keyring, KeyringError

log = logging.getLogger(__name__)

Address = tuple[str, int]
DatagramHandler = Callable[[str, bytes, Address], None]
StreamHandler = Callable[[str, bytes, Address], "bytes | None"]

_LENGTH_BYTES = 4
UNAUTH_BUDGET_BYTES = 1 << 20  # every push-pull state of a swarm of ~1500 members fits; 25 hostile peers cannot grow it
CONNECTION_COST = 4096  # charged per unauthenticated connection (its objects): 256 idle sockets fill the budget
_BIND_ATTEMPTS = 20  # port 0: tries this many UDP ports until the same TCP port is free too


class UnauthBudget:
    """Bytes held for peers that have not authenticated yet, bounded across all of them together.

    Every listener that reads a frame before it can open the envelope charges the connection and the
    length its prefix declares here, and gives them back once the frame is opened or dropped: no number
    of peers can make it hold more than ``limit``. The swarm's TCP streams and the offload server each
    keep one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffered = 0
        self.peak = 0

    def charge(self, n: int) -> bool:
        """Hold ``n`` more bytes; False (nothing held) when they do not fit."""
        if self.buffered + n > self.limit:
            return False
        self.buffered += n
        self.peak = max(self.peak, self.buffered)
        return True

    def release(self, n: int) -> None:
        self.buffered -= n


class _DatagramProtocol(asyncio.DatagramProtocol):
    def __init__(self, transport: SwarmTransport) -> None:
        self._owner = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._owner._on_datagram(data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a dead peer shows up here; the protocol notices the missing ack itself.
        self._owner.counters["icmp_errors"] += 1


class _StreamServer(asyncio.BufferedProtocol):
    """The serving side of one TCP exchange: a length-prefixed request in, one reply out, then close.

    The socket is read straight into the 4-byte prefix, then into a body buffer of exactly the declared length
    once the owner's shared budget for unauthenticated bytes has room for it: no reader buffer can grow.
    """

    def __init__(self, owner: SwarmTransport) -> None:
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._addr: Address = ("", 0)
        self._header = bytearray(_LENGTH_BYTES)
        self._body: bytearray | None = None
        self._have = 0
        self._charged = 0
        self._timer: asyncio.TimerHandle | None = None
        self._finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        peer = transport.get_extra_info("peername")
        self._addr = (peer[0], peer[1]) if peer else ("", 0)
        self._owner._serving.add(self)
        if not self._charge(CONNECTION_COST):
            return
        self._timer = asyncio.get_running_loop().call_later(self._owner.tcp_timeout_s, self._timed_out)

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._header if self._body is None else self._body
        if self._finished or self._have >= len(target):
            return memoryview(bytearray(1))  # past the frame (reading is paused by now): read and ignore
        return memoryview(target)[self._have :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._finished:
            return
        owner = self._owner
        owner.counters["bytes_in"] += nbytes
        self._have += nbytes
        if self._body is None:
            if self._have < _LENGTH_BYTES:
                return
            length = int.from_bytes(self._header, "big")
            if length == 0:
                self._finish()
                return
            if length > owner.max_stream_bytes:
                owner._count("oversized", None, self._addr)
                self._finish()
                return
            if not self._charge(length):
                return
            self._body, self._have = bytearray(length), 0
            return
        if self._have < len(self._body):
            return
        request, self._body = bytes(self._body), None
        self._finish()  # releases the budget: what follows is authenticated or dropped
        frame = owner._answer(request, self._addr)
        if frame is not None and self._transport is not None:
            self._transport.write(frame)
            owner.counters["bytes_out"] += len(frame)

    def eof_received(self) -> bool | None:
        return None  # the peer stopped sending: close (connection_lost counts an unfinished frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._finished:
            self._owner.counters["stream_failures"] += 1  # the peer left in the middle of its request
        self._finish(close=False)
        self._owner._serving.discard(self)

    def abort(self) -> None:
        self._finish(close=False)
        if self._transport is not None:
            self._transport.abort()

    def _charge(self, n: int) -> bool:
        """Take ``n`` bytes of the shared budget, or count the drop and close."""
        if not self._owner.unauth.charge(n):
            self._owner._count("unauth_budget", None, self._addr)
            self._finish()
            return False
        self._charged += n
        return True

    def _timed_out(self) -> None:
        self._timer = None
        self._owner.counters["stream_timeouts"] += 1
        self._finish()

    def _finish(self, close: bool = True) -> None:
        """Stop reading, give back the budget, and close once any reply is written."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._charged:
            self._owner.unauth.release(self._charged)
            self._charged = 0
        self._body = None
        if self._finished:
            return
        self._finished = True
        if close and self._transport is not None:
            if not self._transport.is_closing():
                self._transport.pause_reading()
            # Called from buffer_updated before the reply is written: close after the write, on the next turn.
            asyncio.get_running_loop().call_soon(self._transport.close)


class SwarmTransport:
    """One member's sockets. Set ``on_datagram`` and ``on_stream`` before ``start``."""

    def __init__(
        self,
        name: str,
        keyring: Keyring,
        *,
        max_packet_bytes: int = 1400,
        max_stream_bytes: int = 4 * 1024 * 1024,
        unauth_budget_bytes: int = UNAUTH_BUDGET_BYTES,
        tcp_timeout_s: float = 10.0,
        loss: float = 0.0,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        self.name = name
        self.keyring = keyring
        self.max_packet_bytes = max_packet_bytes
        self.max_stream_bytes = max_stream_bytes
        # bytes charged now to peers not yet authenticated (connections + declared bodies)
        self.unauth = UnauthBudget(unauth_budget_bytes)
        self.tcp_timeout_s = tcp_timeout_s
        self.loss = loss
        self._rng = rng or random.Random()
        self._wall = wall_clock
        self.on_datagram: DatagramHandler | None = None
        self.on_stream: StreamHandler | None = None
        self.dropped: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[Any]] = set()  # requests of ours in flight
        self._serving: set[_StreamServer] = set()  # requests to us in flight
        self.address: Address | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self, bind: Address) -> Address:
        """Binds UDP and TCP on one port (port 0: a free one) and returns the bound address."""
        loop = asyncio.get_running_loop()
        host, port = bind
        attempts = _BIND_ATTEMPTS if port == 0 else 1
        for attempt in range(attempts):
            udp, _ = await loop.create_datagram_endpoint(lambda: _DatagramProtocol(self), local_addr=(host, port))
            bound_port = udp.get_extra_info("sockname")[1]
            try:
                server = await loop.create_server(lambda: _StreamServer(self), host, bound_port)
            except OSError:
                udp.close()
                if attempt == attempts - 1:
                    raise
                continue
            self._udp, self._server = udp, server
            self.address = (host, bound_port)
            return self.address
        raise OSError(f"no port free for both UDP and TCP on {host}")  # pragma: no cover - loop always returns

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._server is not None:
            self._server.close()
            for serving in list(self._serving):
                serving.abort()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)

    @property
    def stats(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped), **self.counters, "unauth_buffered_peak": self.unauth.peak}

    # -- datagrams ---------------------------------------------------------------------------------------------

    def send_datagram(self, addr: Address, plaintext: bytes) -> None:
        if self._udp is None:
            return
        packet = self.keyring.seal(self.name, plaintext, self._wall(), kind=KIND_DATAGRAM)
        if len(packet) > self.max_packet_bytes:
            self._count("oversized_out")
            return
        try:
            self._udp.sendto(packet, addr)
        except OSError:
            self.counters["send_errors"] += 1
            return
        self.counters["bytes_out"] += len(packet)
        self.counters["packets_out"] += 1

    def _on_datagram(self, data: bytes, addr: Address) -> None:
        self.counters["bytes_in"] += len(data)
        self.counters["packets_in"] += 1
        if self.loss and self._rng.random() < self.loss:
            self.counters["injected_loss"] += 1
            return
        if len(data) > self.max_packet_bytes:
            self._count("oversized")
            return
        try:
            sender, plaintext = self.keyring.open(data, self._wall(), kind=KIND_DATAGRAM)
        except KeyringError as exc:
            self._count(exc.reason, exc, addr)
            return
        if self.on_datagram is None:
            return
        try:
            self.on_datagram(sender, plaintext, addr)
        except Exception:  # a bug in the handler must not stop the socket
            log.exception("swarm datagram handler failed on a packet from %s", sender)
            self._count("handler_error")

    # -- streams -----------------------------------------------------------------------------------------------

    async def request(self, addr: Address, plaintext: bytes, timeout_s: float | None = None) -> bytes | None:
        """Sends one request over TCP and returns the opened reply, or None (refused, timed out, rejected)."""
        timeout = self.tcp_timeout_s if timeout_s is None else timeout_s
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        try:
            return await asyncio.wait_for(self._exchange(addr, plaintext), timeout)
        except asyncio.TimeoutError:
            self.counters["stream_timeouts"] += 1
        except (OSError, asyncio.IncompleteReadError):
            self.counters["stream_failures"] += 1
        finally:
            if task is not None:
                self._clients.discard(task)
        return None

    async def _exchange(self, addr: Address, plaintext: bytes) -> bytes | None:
        reader, writer = await asyncio.open_connection(addr[0], addr[1])
        try:
            packet = self.keyring.seal(self.name, plaintext, self._wall(), kind=KIND_STREAM_REQUEST)
            writer.write(len(packet).to_bytes(_LENGTH_BYTES, "big") + packet)
            await writer.drain()
            self.counters["bytes_out"] += _LENGTH_BYTES + len(packet)
            self.counters["streams_out"] += 1
            reply = await self._read_frame(reader, addr)
            if reply is None:
                return None
            try:
                _sender, body = self.keyring.open(reply, self._wall(), kind=KIND_STREAM_REPLY)
            except KeyringError as exc:
                self._count(exc.reason, exc, addr)
                return None
            return body
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def _read_frame(self, reader: asyncio.StreamReader, addr: Address) -> bytes | None:
        header = await reader.readexactly(_LENGTH_BYTES)
        length = int.from_bytes(header, "big")
        self.counters["bytes_in"] += _LENGTH_BYTES
        if length == 0:
            return None
        if length > self.max_stream_bytes:
            self._count("oversized", None, addr)
            return None
        body = await reader.readexactly(length)
        self.counters["bytes_in"] += length
        return body

    def _answer(self, request: bytes, addr: Address) -> bytes | None:
        """The reply frame to one complete request, or None (rejected: close without a word)."""
        try:
            sender, plaintext = self.keyring.open(request, self._wall(), kind=KIND_STREAM_REQUEST)
        except KeyringError as exc:
            self._count(exc.reason, exc, addr)
            return None
        self.counters["streams_in"] += 1
        reply = None
        if self.on_stream is not None:
            try:
                reply = self.on_stream(sender, plaintext, addr)
            except Exception:
                log.exception("swarm stream handler failed on a request from %s", sender)
                self._count("handler_error")
        if reply is None:
            return (0).to_bytes(_LENGTH_BYTES, "big")
        packet = self.keyring.seal(self.name, reply, self._wall(), kind=KIND_STREAM_REPLY)
        return len(packet).to_bytes(_LENGTH_BYTES, "big") + packet

    # -- accounting --------------------------------------------------------------------------------------------

    def _count(self, reason: str, exc: Exception | None = None, addr: Address | None = None) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] == 1:  # once per reason; later ones are only counted
            log.warning("swarm %s: dropped a packet from %s (%s): %s", self.name, addr, reason, exc or reason)

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
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from swarm.keyring import KIND_DATAGRAM, KIND_STREAM_REPLY, KIND_STREAM_REQUEST, Keyring, KeyringError

log = logging.getLogger(__name__)

Address = tuple[str, int]
DatagramHandler = Callable[[str, bytes, Address], None]
StreamHandler = Callable[[str, bytes, Address], "bytes | None"]

_LENGTH_BYTES = 4
_BIND_ATTEMPTS = 20  # port 0: tries this many UDP ports until the same TCP port is free too


class _DatagramProtocol(asyncio.DatagramProtocol):
    def __init__(self, transport: SwarmTransport) -> None:
        self._owner = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._owner._on_datagram(data, (addr[0], addr[1]))

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a dead peer shows up here; the protocol notices the missing ack itself.
        self._owner.counters["icmp_errors"] += 1


class SwarmTransport:
    """One member's sockets. Set ``on_datagram`` and ``on_stream`` before ``start``."""

    def __init__(
        self,
        name: str,
        keyring: Keyring,
        *,
        max_packet_bytes: int = 1400,
        max_stream_bytes: int = 4 * 1024 * 1024,
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
        self._clients: set[asyncio.Task[Any]] = set()  # stream exchanges in flight, both directions
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
                server = await asyncio.start_server(self._serve_stream, host, bound_port)
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
            await self._server.wait_closed()
            self._server = None
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)

    @property
    def stats(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped), **self.counters}

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

    async def _serve_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        addr: Address = (peer[0], peer[1]) if peer else ("", 0)
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)  # close() cancels a handler still waiting on a slow peer
        try:
            request = await asyncio.wait_for(self._read_frame(reader, addr), self.tcp_timeout_s)
            if request is None:
                return
            try:
                sender, plaintext = self.keyring.open(request, self._wall(), kind=KIND_STREAM_REQUEST)
            except KeyringError as exc:
                self._count(exc.reason, exc, addr)
                return
            self.counters["streams_in"] += 1
            reply = None
            if self.on_stream is not None:
                try:
                    reply = self.on_stream(sender, plaintext, addr)
                except Exception:
                    log.exception("swarm stream handler failed on a request from %s", sender)
                    self._count("handler_error")
            if reply is None:
                frame = (0).to_bytes(_LENGTH_BYTES, "big")
            else:
                packet = self.keyring.seal(self.name, reply, self._wall(), kind=KIND_STREAM_REPLY)
                frame = len(packet).to_bytes(_LENGTH_BYTES, "big") + packet
            writer.write(frame)
            await writer.drain()
            self.counters["bytes_out"] += len(frame)
        except asyncio.TimeoutError:
            self.counters["stream_timeouts"] += 1
        except (OSError, asyncio.IncompleteReadError):
            self.counters["stream_failures"] += 1
        finally:
            if task is not None:
                self._clients.discard(task)
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    # -- accounting --------------------------------------------------------------------------------------------

    def _count(self, reason: str, exc: Exception | None = None, addr: Address | None = None) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] == 1:  # once per reason; later ones are only counted
            log.warning("swarm %s: dropped a packet from %s (%s): %s", self.name, addr, reason, exc or reason)

"""Real UDP and TCP on loopback: sealed packets arrive; recorded, forged, oversized and garbage ones are dropped
and counted by reason, never raised into the loop."""

from __future__ import annotations

import asyncio
import random
import socket
import time

from swarm.keyring import KIND_STREAM_REQUEST, Keyring, generate_key
from swarm.transport import SwarmTransport


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_datagrams_arrive_and_recorded_forged_oversized_garbage_are_dropped():
    async def scenario() -> None:
        key = generate_key()
        a = SwarmTransport("a", Keyring([key]))
        b = SwarmTransport("b", Keyring([key]), max_packet_bytes=1400)
        got: list[tuple[str, bytes]] = []
        b.on_datagram = lambda sender, data, addr: got.append((sender, data))
        addr_a = await a.start(("127.0.0.1", 0))
        addr_b = await b.start(("127.0.0.1", 0))
        # A recorder socket stands where an attacker on the radio link would: it keeps what a sent.
        recorder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        recorder.bind(("127.0.0.1", 0))
        recorder.setblocking(False)
        try:
            a.send_datagram(addr_b, b"ping 1")
            await _until(lambda: got == [("a", b"ping 1")])
            a.send_datagram(recorder.getsockname(), b"alive a inc=1")
            await _until(lambda: a.counters["packets_out"] == 2)
            loop = asyncio.get_running_loop()
            recorded = await asyncio.wait_for(loop.sock_recv(recorder, 2048), 5)
            recorder.sendto(recorded, addr_b)  # first delivery of the recorded packet is accepted ...
            await _until(lambda: len(got) == 2)
            recorder.sendto(recorded, addr_b)  # ... its replay is not
            await _until(lambda: b.dropped["replay"] == 1)
            forged = Keyring([generate_key()]).seal("a", b"dead b", 1e9 + 0.0)
            recorder.sendto(forged, addr_b)
            await _until(lambda: b.dropped["forged"] == 1)
            recorder.sendto(b"\x01garbage", addr_b)
            await _until(lambda: b.dropped["short"] == 1)
            recorder.sendto(b"x" * 1500, addr_b)
            await _until(lambda: b.dropped["oversized"] == 1)
            a.send_datagram(addr_b, b"ping 2")  # the socket still works after all of that
            await _until(lambda: got[-1] == ("a", b"ping 2"))
            assert got == [("a", b"ping 1"), ("a", b"alive a inc=1"), ("a", b"ping 2")]
            assert b.counters["bytes_in"] > 1500 and a.counters["bytes_out"] > 0
            assert addr_a[1] != addr_b[1]
        finally:
            recorder.close()
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_stream_request_reply_and_replayed_request_dropped():
    async def scenario() -> None:
        key = generate_key()
        a = SwarmTransport("a", Keyring([key]))
        b = SwarmTransport("b", Keyring([key]))
        requests: list[tuple[str, bytes]] = []

        def serve(sender: str, data: bytes, addr) -> bytes | None:
            requests.append((sender, data))
            return b"state of b" if data == b"push-pull" else None

        b.on_stream = serve
        await a.start(("127.0.0.1", 0))
        addr_b = await b.start(("127.0.0.1", 0))
        try:
            assert await a.request(addr_b, b"push-pull", 5) == b"state of b"
            assert await a.request(addr_b, b"nothing to say", 5) is None
            # A recorded request frame sent twice on fresh connections: the second is a replay.
            frame_body = Keyring([key]).seal("a", b"push-pull", time.time(), kind=KIND_STREAM_REQUEST)
            frame = len(frame_body).to_bytes(4, "big") + frame_body
            for _ in range(2):
                reader, writer = await asyncio.open_connection(*addr_b)
                writer.write(frame)
                await writer.drain()
                await reader.read()
                writer.close()
                await writer.wait_closed()
            await _until(lambda: b.dropped["replay"] == 1)
            assert [r for r in requests if r[1] == b"push-pull"] == [("a", b"push-pull")] * 2
            # A peer that is gone: the request fails with None, counted, nothing raised.
            await b.close()
            assert await a.request(addr_b, b"push-pull", 2) is None
            assert a.counters["stream_failures"] + a.counters["stream_timeouts"] == 1
            assert not a.dropped  # a peer that is gone is not a rejected packet
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_injected_loss_drops_about_that_share():
    async def scenario() -> None:
        key = generate_key()
        a = SwarmTransport("a", Keyring([key]))
        b = SwarmTransport("b", Keyring([key]), loss=0.5, rng=random.Random(7))
        got: list[bytes] = []
        b.on_datagram = lambda sender, data, addr: got.append(data)
        await a.start(("127.0.0.1", 0))
        addr_b = await b.start(("127.0.0.1", 0))
        try:
            for i in range(200):
                a.send_datagram(addr_b, b"%d" % i)
                await asyncio.sleep(0)
            await _until(lambda: len(got) + b.counters["injected_loss"] == 200)
            assert 60 < b.counters["injected_loss"] < 140
            assert not b.dropped  # injected loss is not a rejected packet
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())

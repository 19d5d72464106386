"""The offload hop over real TCP on 127.0.0.1: OffloadClient -> OffloadServer -> a real model -> reply.

Real sockets (ports from edgerun.testing.ports), real keyrings, and for the end-to-end hop the real BlazeFace
TFLite model serving a scikit-image photo. Where a test needs a helper that is slow on purpose (to hold a
request in flight, fill the queue or miss a deadline), its ``serve`` callable waits on an event the test sets:
a fault injected through the one callable the server is given, said at each such test. Raw sockets stand in
for a hostile or broken origin (forged key, replayed frame, oversized prefix, garbage inside a good envelope).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from edgerun.engines.base import EngineOptions, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.models.bundle import load_bundle
from edgerun.offload import codec
from edgerun.offload.client import OffloadClient
from edgerun.offload.protocol import (
    LENGTH_BYTES,
    MAX_REQUEST_BYTES,
    InferReply,
    InferRequest,
    OffloadError,
    encode_request,
    open_reply,
    reply_to_detections,
    seal_frame,
)
from edgerun.offload.server import CONNECTION_COST, OffloadServer, ServeResult
from edgerun.testing.ports import LOOPBACK, free_port
from edgerun.types import Detections
from swarm.keyring import KIND_OFFLOAD_REQUEST, Keyring, generate_key

REPO = Path(__file__).resolve().parents[2]
MODEL = "0123456789abcdef"
KEY = generate_key()

pytestmark = pytest.mark.timeout(120)


def _run(main: Callable[[], Coroutine[Any, Any, None]], loop: str = "asyncio") -> None:
    """On asyncio's loop or on uvloop (what a node runs on when it is installed)."""
    if loop == "uvloop":
        pytest.importorskip("uvloop").run(main())
    else:
        asyncio.run(main())


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def _request(image: np.ndarray | None = None, name: str = "zstd", budget_ms: int = 0) -> InferRequest:
    image = np.zeros((8, 8, 3), np.uint8) if image is None else image
    h, w = image.shape[:2]
    return InferRequest(0, MODEL, name, h, w, budget_ms, "", codec.encode(image, name))


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def _empty(model: str, image: np.ndarray, traceparent: str, origin: str) -> ServeResult:
    return ServeResult(Detections.empty(), infer_ms=0.1)


class _Gate:
    """A ``serve`` that holds every call until the test opens the gate (the injected fault: a slow helper)."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.opened = threading.Event()
        self.calls = 0

    def __call__(self, model: str, image: np.ndarray, traceparent: str, origin: str) -> ServeResult:
        self.calls += 1
        self.entered.release()
        self.opened.wait(30)
        return ServeResult(Detections.empty(), infer_ms=1.0)

    async def wait_entered(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.entered.acquire, True, 10)


@contextlib.asynccontextmanager
async def _hop(serve, *, client_key: bytes = KEY, window: int = 4, **server_options) -> AsyncIterator:
    server = OffloadServer(Keyring([KEY]), "helper", serve, **server_options)
    addr = await server.start((LOOPBACK, free_port()))
    client = OffloadClient(Keyring([client_key]), "origin", window=window)
    try:
        yield server, client, addr
    finally:
        if isinstance(serve, _Gate):
            serve.opened.set()
        await client.close()
        await server.close()


async def _raw(addr) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*addr)


async def _read_reply(reader: asyncio.StreamReader, keyring: Keyring) -> InferReply:
    length = int.from_bytes(await asyncio.wait_for(reader.readexactly(LENGTH_BYTES), 10), "big")
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return open_reply(keyring, body, time.time())[1]


async def _closed(reader: asyncio.StreamReader) -> bool:
    """True once the server has closed the connection (EOF or reset)."""
    try:
        return await asyncio.wait_for(reader.read(1), 10) == b""
    except ConnectionResetError:
        return True


# -- the real model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blazeface():
    """BlazeFace opened with edgerun's factory as a node opens it: the origin's runtime for the astronaut photo
    (512 x 512) and the helper's for model-size frames."""
    from skimage import data

    bundle = load_bundle(REPO / ".cache" / "models" / "blazeface_short")
    engine = engine_class("tflite")(bundle.variant_path("tflite"), EngineOptions(num_threads=1))
    photo = np.ascontiguousarray(data.astronaut()[:, :, ::-1])  # BGR, as frames are
    origin = build_runtime(bundle, engine, (photo.shape[1], photo.shape[0]))
    h, w = engine.input_spec.image_hw
    helper = build_runtime(bundle, engine, (w, h))
    yield engine, origin, helper, photo
    engine.close()


def test_detections_of_a_photo_come_back_as_the_engine_finds_them(blazeface):
    engine, origin, helper, photo = blazeface
    tensor = engine.allocate_input()
    origin.preprocessor(photo, tensor)
    direct = origin.decoder.decode(engine.infer(tensor))
    assert len(direct) >= 1  # the astronaut's face
    sent = origin.preprocessor.letterboxed(photo).copy()
    served_traces: list[str] = []

    def serve(model: str, image: np.ndarray, traceparent: str, origin: str) -> ServeResult:
        served_traces.append(traceparent)
        scratch = engine.allocate_input()
        helper.preprocessor(image, scratch)
        start = time.perf_counter()
        outputs = engine.infer(scratch)
        return ServeResult(helper.decoder.decode(outputs), infer_ms=(time.perf_counter() - start) * 1000.0)

    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    async def main() -> dict[str, Detections]:
        got = {}
        async with _hop(serve) as (server, client, addr):
            for name in ("zstd", "jpeg"):
                request = InferRequest(0, MODEL, name, *sent.shape[:2], 0, trace, codec.encode(sent, name))
                reply = await client.infer(addr, request, time.monotonic() + 30)
                assert reply.infer_ms > 0
                got[name] = reply_to_detections(reply)
            assert server.stats["served"] == 2 and server.stats["dropped"] == {}
            assert client.stats["replies"] == 2 and client.stats["dropped"] == {}
        return got

    got = asyncio.run(main())
    assert served_traces == [trace, trace]
    # zstd carries the exact pixels: the helper finds exactly what the origin's own engine finds.
    for name in ("boxes", "scores", "class_ids", "keypoints"):
        assert np.array_equal(getattr(got["zstd"], name), getattr(direct, name)), name
    # JPEG at quality 90 moves the face by a fraction of a pixel, not to another place.
    assert len(got["jpeg"]) == len(direct)
    assert np.abs(got["jpeg"].boxes - direct.boxes).max() < 0.02
    # And the origin maps the reply into its own frame as it maps its own detections.
    boxes = origin.preprocessor.letterbox.boxes_to_source(got["zstd"].boxes.copy())
    x1, y1, x2, y2 = boxes[0]
    assert 150 < x1 < x2 < 300 and 50 < y1 < y2 < 200  # the astronaut's face in the 512 x 512 photo


# -- hostile and broken origins --------------------------------------------------------------------------------------


@LOOPS
def test_a_forged_key_is_dropped_counted_and_its_connection_closed(loop):
    async def main() -> None:
        async with _hop(_empty, client_key=generate_key()) as (server, client, addr):
            with pytest.raises(OffloadError) as info:
                await client.infer(addr, _request(), time.monotonic() + 30)
            assert info.value.reason == "lost"  # closed at once, not left to run into the deadline
            assert server.stats["dropped"] == {"forged": 1}
            assert server.stats.get("requests", 0) == 0
            # The swarm's own members still get served.
            good = OffloadClient(Keyring([KEY]), "origin2")
            reply = await good.infer(addr, _request(), time.monotonic() + 30)
            assert reply.status == "ok"
            await good.close()

    _run(main, loop)


def test_a_replayed_frame_is_rejected_and_closes_the_connection():
    async def main() -> None:
        async with _hop(_empty) as (server, _client, addr):
            request = encode_request(_request(budget_ms=5000))
            frame = seal_frame(Keyring([KEY]), "origin", request, time.time(), KIND_OFFLOAD_REQUEST)
            reader, writer = await _raw(addr)
            writer.write(frame)
            assert (await _read_reply(reader, Keyring([KEY]))).status == "ok"
            writer.write(frame)  # the same bytes again, as a recorder on the link would send them
            assert await _closed(reader)
            writer.close()
            # On a fresh connection too: the replay window is the helper's, not the connection's.
            reader, writer = await _raw(addr)
            writer.write(frame)
            assert await _closed(reader)
            writer.close()
            assert server.stats["dropped"] == {"replay": 2}
            assert server.stats["served"] == 1

    asyncio.run(main())


def test_an_oversized_length_prefix_is_dropped_without_reading_the_body():
    async def main() -> None:
        async with _hop(_empty) as (server, _client, addr):
            reader, writer = await _raw(addr)
            writer.write((MAX_REQUEST_BYTES + 1).to_bytes(LENGTH_BYTES, "big"))
            assert await _closed(reader)
            writer.close()
            assert server.stats["dropped"] == {"oversized": 1}
            # Nothing of the body was ever charged, so nothing of it was ever held.
            assert server.stats["unauth_buffered_peak"] == CONNECTION_COST
            assert server.unauth.buffered == 0

    asyncio.run(main())


def test_garbage_inside_a_good_envelope_is_counted_and_the_connection_goes_on():
    async def main() -> None:
        async with _hop(_empty) as (server, _client, addr):
            keyring = Keyring([KEY])
            reader, writer = await _raw(addr)
            request = encode_request(_request(budget_ms=5000))
            for garbage in (b"\xc1\xc1", b"\x93\x01\x02\x03", request[:-3]):
                writer.write(seal_frame(keyring, "origin", garbage, time.time(), KIND_OFFLOAD_REQUEST))
            writer.write(seal_frame(keyring, "origin", request, time.time(), KIND_OFFLOAD_REQUEST))
            assert (await _read_reply(reader, Keyring([KEY]))).status == "ok"
            assert server.stats["dropped"] == {"malformed": 3}
            # A picture that is not the size the request says is answered "bad", not served.
            lie = InferRequest(5, MODEL, "zstd", 9, 8, 1000, "", codec.encode(np.zeros((8, 8, 3), np.uint8), "zstd"))
            writer.write(seal_frame(keyring, "origin", encode_request(lie), time.time(), KIND_OFFLOAD_REQUEST))
            reply = await _read_reply(reader, Keyring([KEY]))
            assert (reply.id, reply.status) == (5, "bad")
            assert server.stats["dropped"] == {"malformed": 3, "size": 1}
            writer.close()

    asyncio.run(main())


def test_unauthenticated_connections_share_one_budget():
    async def main() -> None:
        budget = 4 * CONNECTION_COST + 100
        async with _hop(_empty, unauth_budget_bytes=budget) as (server, client, addr):
            idle = [await _raw(addr) for _ in range(4)]  # each holds CONNECTION_COST until it authenticates
            await _until(lambda: server.unauth.buffered == 4 * CONNECTION_COST)
            reader, writer = await _raw(addr)
            assert await _closed(reader)
            assert server.stats["dropped"] == {"unauth_budget": 1}
            for _reader, idle_writer in idle:
                idle_writer.close()
            await _until(lambda: server.unauth.buffered == 0)
            assert (await client.infer(addr, _request(), time.monotonic() + 30)).status == "ok"
            writer.close()

    asyncio.run(main())


# -- a helper that dies, is slow, is full ---------------------------------------------------------------------------


@LOOPS
def test_a_closed_helper_fails_what_is_in_flight_as_lost_then_refuses(loop):
    """The gate holds both requests in flight inside the helper (injected: a slow helper)."""
    gate = _Gate()

    async def main() -> None:
        async with _hop(gate, workers=2) as (server, client, addr):
            flights = [asyncio.ensure_future(client.infer(addr, _request(), time.monotonic() + 60)) for _ in range(2)]
            await gate.wait_entered()
            await gate.wait_entered()
            assert client.in_flight(addr) == 2
            closing = asyncio.ensure_future(server.close())
            results = await asyncio.gather(*flights, return_exceptions=True)
            # "lost" at once, not "late" after the 60 s deadline.
            assert [getattr(r, "reason", r) for r in results] == ["lost", "lost"]
            assert client.in_flight(addr) == 0
            with pytest.raises(OffloadError) as info:
                await client.infer(addr, _request(), time.monotonic() + 60)
            assert info.value.reason == "refused"
            gate.opened.set()
            await closing
            assert client.stats["lost"] == 2 and client.stats["refused"] == 1

    _run(main, loop)


_HELPER_PROCESS = """
import asyncio, base64, sys, threading
from edgerun.offload.server import OffloadServer, ServeResult
from edgerun.types import Detections
from swarm.keyring import Keyring

def serve(model, image, traceparent, origin):
    print("serving", flush=True)
    threading.Event().wait(60)  # a helper stuck in its engine when it is killed
    return ServeResult(Detections.empty())

async def main():
    server = OffloadServer(Keyring([base64.b64decode(sys.argv[1])]), "helper", serve, workers=2)
    await server.start(("127.0.0.1", int(sys.argv[2])))
    print("listening", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_sigkilled_helper_process_costs_the_frames_in_flight_then_refuses():
    """A helper process whose serve hangs (injected: stuck in its engine) is SIGKILLed with two frames in flight."""
    import base64

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    helper = subprocess.Popen(
        [sys.executable, "-c", _HELPER_PROCESS, base64.b64encode(KEY).decode(), str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert helper.stdout is not None
        assert helper.stdout.readline().strip() == "listening"

        async def main() -> None:
            client = OffloadClient(Keyring([KEY]), "origin")
            addr = (LOOPBACK, port)
            flights = [asyncio.ensure_future(client.infer(addr, _request(), time.monotonic() + 60)) for _ in range(2)]
            loop = asyncio.get_running_loop()
            for _ in range(2):
                assert (await loop.run_in_executor(None, helper.stdout.readline)).strip() == "serving"
            helper.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*flights, return_exceptions=True)
            assert [getattr(r, "reason", r) for r in results] == ["lost", "lost"]
            # Once the process is gone (its listening socket with it), the next frame cannot connect.
            await loop.run_in_executor(None, helper.wait, 10)
            with pytest.raises(OffloadError) as info:
                await client.infer(addr, _request(), time.monotonic() + 60)
            assert info.value.reason == "refused"
            await client.close()

        asyncio.run(main())
    finally:
        helper.kill()
        helper.wait(10)
        if helper.stdout is not None:
            helper.stdout.close()


@LOOPS
def test_a_reply_after_the_deadline_is_late_and_counted(loop):
    """The gate holds the request past its deadline (injected: a slow helper)."""
    gate = _Gate()

    async def main() -> None:
        async with _hop(gate) as (server, client, addr):
            with pytest.raises(OffloadError) as info:
                await client.infer(addr, _request(), time.monotonic() + 0.3)
            assert info.value.reason == "late"
            assert client.in_flight(addr) == 0
            gate.opened.set()
            await _until(lambda: client.stats.get("late_replies", 0) == 1)
            assert client.stats["late"] == 1 and client.stats.get("replies", 0) == 0
            # The connection carries on: the next frame is answered.
            assert (await client.infer(addr, _request(), time.monotonic() + 30)).status == "ok"

    _run(main, loop)


def test_a_caller_that_gives_up_leaves_nothing_pending():
    """The lead's worker threads call infer through run_coroutine_threadsafe and may stop waiting."""
    gate = _Gate()

    async def main() -> None:
        async with _hop(gate) as (_server, client, addr):
            loop = asyncio.get_running_loop()

            def worker() -> str:
                future = asyncio.run_coroutine_threadsafe(client.infer(addr, _request(), time.monotonic() + 60), loop)
                try:
                    future.result(timeout=0.3)
                except concurrent.futures.TimeoutError:  # not the builtin TimeoutError on Python 3.10
                    future.cancel()
                    return "gave up"
                return "answered"

            assert await loop.run_in_executor(None, worker) == "gave up"
            await _until(lambda: client.in_flight(addr) == 0)
            gate.opened.set()
            await _until(lambda: client.stats.get("late_replies", 0) == 1)

    asyncio.run(main())


def test_a_full_window_is_refused_at_once():
    """The gate holds two requests in flight (injected: a slow helper)."""
    gate = _Gate()

    async def main() -> None:
        async with _hop(gate, window=2, workers=2) as (_server, client, addr):
            flights = [asyncio.ensure_future(client.infer(addr, _request(), time.monotonic() + 30)) for _ in range(2)]
            await _until(lambda: client.in_flight(addr) == 2)
            with pytest.raises(OffloadError) as info:
                await client.infer(addr, _request(), time.monotonic() + 30)
            assert info.value.reason == "window"
            gate.opened.set()
            assert [r.status for r in await asyncio.gather(*flights)] == ["ok", "ok"]
            assert client.stats["window"] == 1

    asyncio.run(main())


def test_a_full_queue_answers_busy_at_once():
    """One worker held by the gate (injected: a slow helper), one request waiting: the next one is busy."""
    gate = _Gate()

    async def main() -> None:
        async with _hop(gate, workers=1, max_queue=1) as (server, client, addr):
            first = asyncio.ensure_future(client.infer(addr, _request(), time.monotonic() + 30))
            await gate.wait_entered()
            second = asyncio.ensure_future(client.infer(addr, _request(), time.monotonic() + 30))
            await _until(lambda: server.queue == 1)
            with pytest.raises(OffloadError) as info:
                await client.infer(addr, _request(), time.monotonic() + 30)
            assert info.value.reason == "busy"
            gate.opened.set()
            assert [(await first).status, (await second).status] == ["ok", "ok"]
            assert server.stats["busy"] == 1 and server.stats["served"] == 2 and gate.calls == 2

    asyncio.run(main())


def test_a_request_whose_budget_ran_out_in_the_queue_is_expired_without_serving():
    """The helper's clock is the test's (set forward while the gate holds the worker: injected slowness)."""
    gate = _Gate()
    now = [100.0]

    async def main() -> None:
        async with _hop(gate, workers=1, clock=lambda: now[0]) as (server, client, addr):
            first = asyncio.ensure_future(client.infer(addr, _request(), time.monotonic() + 30))
            await gate.wait_entered()
            # The origin keeps the return trip back: the helper gets 50 ms of its 30 s.
            second = asyncio.ensure_future(client.infer(addr, _request(budget_ms=50), time.monotonic() + 30))
            await _until(lambda: server.queue == 1)
            now[0] += 0.051
            gate.opened.set()
            assert (await first).status == "ok"
            with pytest.raises(OffloadError) as info:
                await second
            assert info.value.reason == "expired"
            assert gate.calls == 1  # serve never saw the expired frame
            assert server.stats["expired"] == 1 and client.stats["expired"] == 1

    asyncio.run(main())


def test_what_serve_says_reaches_the_origin():
    """``serve`` refuses one model and fails on another (injected: a helper's engine raising)."""
    seen: list[str] = []

    def serve(model: str, image: np.ndarray, traceparent: str, origin: str) -> ServeResult:
        seen.append(traceparent)
        if model == "ffffffffffffffff":
            return ServeResult(None, status="model")
        if model == "eeeeeeeeeeeeeeee":
            raise RuntimeError("the engine fell over")
        return ServeResult(Detections.empty(), infer_ms=2.0)

    async def main() -> None:
        async with _hop(serve) as (server, client, addr):
            for model, reason in (("ffffffffffffffff", "model"), ("eeeeeeeeeeeeeeee", "error")):
                request = msgspec.structs.replace(_request(), model=model)
                with pytest.raises(OffloadError) as info:
                    await client.infer(addr, request, time.monotonic() + 30)
                assert info.value.reason == reason
            # A trace header that is not W3C costs the trace, not the frame.
            request = msgspec.structs.replace(_request(), traceparent="00-not-a-trace")
            assert (await client.infer(addr, request, time.monotonic() + 30)).status == "ok"
            assert seen == ["", "", ""]
            stats = server.stats
            assert (stats["model"], stats["errors"], stats["served"], stats["traceparent_ignored"]) == (1, 1, 1, 1)
            assert stats["dropped"] == {}
            assert (client.stats["model"], client.stats["error"], client.stats["replies"]) == (1, 1, 3)

    asyncio.run(main())


def test_a_frame_that_stalls_half_way_is_closed_after_the_frame_timeout():
    async def main() -> None:
        async with _hop(_empty, frame_timeout_s=0.2) as (server, _client, addr):
            reader, writer = await _raw(addr)
            writer.write((1000).to_bytes(LENGTH_BYTES, "big") + b"x" * 10)  # then nothing more
            assert await _closed(reader)
            writer.close()
            assert server.stats["dropped"] == {"timeout": 1}
            assert server.unauth.buffered == 0  # its connection and declared body given back

    asyncio.run(main())


def test_a_request_the_helper_would_refuse_is_refused_before_it_is_sent():
    async def main() -> None:
        async with _hop(_empty) as (server, client, addr):
            request = msgspec.structs.replace(_request(), model="not-a-hash")
            with pytest.raises(OffloadError, match="model") as info:
                await client.infer(addr, request, time.monotonic() + 30)
            assert info.value.reason == "protocol"
            assert client.stats["dropped"] == {"invalid_out": 1} and client.stats["bytes_out"] == 0
            assert server.stats["requests"] == 0

    asyncio.run(main())

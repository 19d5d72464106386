"""The offload hop's wire (edgerun.offload.protocol) and image codec (edgerun.offload.codec), without sockets.

Bounds are checked on real encodings: what a node sends decodes to the same thing, and each thing out of
bounds is refused with the reason the client and server count it by. A property test feeds arbitrary bytes
through the server's receive path (frame parser, envelope, request, image) and checks that nothing but the
protocol's own errors comes out.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import example, given
from hypothesis import strategies as st

from edgerun.offload import codec
from edgerun.offload.protocol import (
    LENGTH_BYTES,
    MAX_DETECTIONS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    EnvelopeRejected,
    FrameParser,
    InferReply,
    InferRequest,
    OffloadProtocolError,
    decode_reply,
    decode_request,
    detections_to_reply,
    encode_reply,
    encode_request,
    open_reply,
    open_request,
    reply_to_detections,
    seal_frame,
    valid_traceparent,
)
from edgerun.types import Detections
from swarm.keyring import KIND_DATAGRAM, KIND_OFFLOAD_REPLY, KIND_OFFLOAD_REQUEST, Keyring

KEY = bytes(range(32))
NOW = 1_800_000_000.0
MODEL = "0123456789abcdef"
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _request(**fields) -> InferRequest:
    values = {
        "id": 7,
        "model": MODEL,
        "codec": "zstd",
        "height": 2,
        "width": 3,
        "budget_ms": 150,
        "traceparent": TRACE,
        "data": b"\x01\x02",
    }
    values.update(fields)
    return InferRequest(**values)


def _detections(n: int, k: int = 6, seed: int = 0) -> Detections:
    rng = np.random.default_rng(seed)
    return Detections(
        boxes=rng.random((n, 4), np.float32),
        scores=rng.random(n, np.float32),
        class_ids=rng.integers(0, 5, n).astype(np.int32),
        keypoints=rng.random((n, k, 2), np.float32) if k else None,
    )


# -- messages --------------------------------------------------------------------------------------------------


def test_request_and_reply_survive_the_wire():
    request = _request()
    assert decode_request(encode_request(request)) == request
    reply = detections_to_reply(3, _detections(5), infer_ms=4.25, queue_ms=0.5)
    back = decode_reply(encode_reply(reply))
    assert back == reply
    got, sent = reply_to_detections(back), _detections(5)
    for name in ("boxes", "scores", "class_ids", "keypoints"):
        assert np.array_equal(getattr(got, name), getattr(sent, name)), name
    assert (back.id, back.status, back.k, back.infer_ms, back.queue_ms) == (3, "ok", 6, 4.25, 0.5)


def test_detections_without_keypoints_come_back_without_keypoints():
    got = reply_to_detections(decode_reply(encode_reply(detections_to_reply(1, _detections(2, k=0), 1.0, 0.0))))
    assert got.keypoints is None and len(got) == 2


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"height": 0}, "height"),
        ({"width": 4097}, "width"),
        ({"model": "0123456789ABCDEF"}, "model"),
        ({"model": "0123"}, "model"),
        ({"model": MODEL + "\n"}, "model"),
        ({"budget_ms": -1}, "budget_ms"),
        ({"budget_ms": 60_001}, "budget_ms"),
        ({"traceparent": "x" * 56}, "traceparent"),
        ({"id": -1}, "id"),
        ({"codec": "x" * 17}, "codec"),
    ],
)
def test_a_request_out_of_bounds_is_malformed(fields, what):
    raw = msgspec.msgpack.encode(msgspec.structs.astuple(_request()))
    values = list(msgspec.msgpack.decode(raw))
    names = list(InferRequest.__struct_fields__)
    for name, value in fields.items():
        values[names.index(name)] = value
    with pytest.raises(OffloadProtocolError) as info:
        decode_request(msgspec.msgpack.encode(values))
    assert info.value.reason == "malformed"
    assert what in str(info.value)


def test_request_data_over_the_bound_is_malformed():
    values = list(msgspec.structs.astuple(_request()))
    values[-1] = bytes(MAX_REQUEST_BYTES + 1)
    with pytest.raises(OffloadProtocolError, match="data"):
        decode_request(msgspec.msgpack.encode(values))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_reply_with_impossible_times_is_malformed(bad):
    values = list(msgspec.structs.astuple(detections_to_reply(1, _detections(1), 1.0, 0.0)))
    values[-2] = bad
    with pytest.raises(OffloadProtocolError, match="infer_ms") as info:
        decode_reply(msgspec.msgpack.encode(values))
    assert info.value.reason == "malformed"


def test_garbage_is_not_a_request_or_a_reply():
    for garbage in (b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"id": 1})):
        with pytest.raises(OffloadProtocolError):
            decode_request(garbage)
        with pytest.raises(OffloadProtocolError):
            decode_reply(garbage)


@pytest.mark.parametrize(
    ("change", "reason", "message"),
    [
        ({"scores": b"\x00" * 6}, "shape", "not float32s"),
        ({"boxes": b"\x00" * 16}, "shape", "2 scores but 16 bytes of boxes"),
        ({"class_ids": b""}, "shape", "0 of class ids"),
        ({"keypoints": b"\x00" * 8}, "shape", "8 bytes of keypoints for 2 detections of 6 keypoints"),
        ({"k": 0}, "shape", "keypoints"),
        ({"status": "busy"}, "status", "'busy'"),
    ],
)
def test_reply_arrays_must_agree(change, reason, message):
    reply = msgspec.structs.replace(detections_to_reply(1, _detections(2), 1.0, 0.0), **change)
    with pytest.raises(OffloadProtocolError, match=message) as info:
        reply_to_detections(reply)
    assert info.value.reason == reason


def test_reply_values_must_be_finite():
    det = _detections(3)
    det.boxes[1, 2] = np.nan
    with pytest.raises(OffloadProtocolError, match="not finite") as info:
        reply_to_detections(detections_to_reply(1, det, 1.0, 0.0))
    assert info.value.reason == "value"
    det = _detections(3)
    det.keypoints[2, 0, 1] = np.inf  # type: ignore[index]
    with pytest.raises(OffloadProtocolError, match="not finite"):
        reply_to_detections(detections_to_reply(1, det, 1.0, 0.0))


def test_too_many_detections_are_refused_and_never_sent():
    n = MAX_DETECTIONS + 1
    reply = InferReply(1, "ok", bytes(16 * n), bytes(4 * n), bytes(4 * n))
    with pytest.raises(OffloadProtocolError, match="1001 detections") as info:
        reply_to_detections(reply)
    assert info.value.reason == "shape"
    # The helper sends the most confident ones that fit, so the origin never has to drop a whole reply.
    det = _detections(1500, k=6, seed=3)
    sent = detections_to_reply(1, det, 1.0, 0.0)
    got = reply_to_detections(sent)
    assert len(got) == MAX_DETECTIONS
    assert got.scores.min() >= np.sort(det.scores)[-MAX_DETECTIONS]
    # 64 keypoints each: 1000 would be 536 KB, over the reply bound; what is sent fits it.
    many = detections_to_reply(1, _detections(1000, k=64), 1.0, 0.0)
    assert len(encode_reply(many)) < MAX_REPLY_BYTES - 200
    assert len(reply_to_detections(many)) < 1000


def test_traceparent_shape():
    assert valid_traceparent("") and valid_traceparent(TRACE)
    assert not valid_traceparent(TRACE.upper())
    assert not valid_traceparent("01" + TRACE[2:])
    assert not valid_traceparent(TRACE + "\n")


# -- envelopes ---------------------------------------------------------------------------------------------------


def test_sealed_request_opens_and_other_kinds_do_not():
    sender, receiver = Keyring([KEY]), Keyring([KEY])
    frame = seal_frame(sender, "origin", encode_request(_request()), NOW, KIND_OFFLOAD_REQUEST)
    assert int.from_bytes(frame[:LENGTH_BYTES], "big") == len(frame) - LENGTH_BYTES
    name, request = open_request(receiver, frame[LENGTH_BYTES:], NOW)
    assert (name, request) == ("origin", _request())
    # The same bytes once more: a replay.
    with pytest.raises(EnvelopeRejected) as info:
        open_request(receiver, frame[LENGTH_BYTES:], NOW)
    assert info.value.reason == "replay"
    # A request cannot be taken for a reply, nor a gossip datagram for a request.
    with pytest.raises(EnvelopeRejected) as info:
        open_reply(Keyring([KEY]), frame[LENGTH_BYTES:], NOW)
    assert info.value.reason == "kind"
    datagram = sender.seal("origin", encode_request(_request()), NOW, kind=KIND_DATAGRAM)
    with pytest.raises(EnvelopeRejected) as info:
        open_request(Keyring([KEY]), datagram, NOW)
    assert info.value.reason == "kind"
    reply = seal_frame(sender, "helper", encode_reply(InferReply(1, "busy")), NOW, KIND_OFFLOAD_REPLY)
    assert open_reply(Keyring([KEY]), reply[LENGTH_BYTES:], NOW)[1].status == "busy"


def test_envelopes_under_another_key_or_clock_are_rejected():
    frame = seal_frame(Keyring([bytes(32)]), "mallory", encode_request(_request()), NOW, KIND_OFFLOAD_REQUEST)
    with pytest.raises(EnvelopeRejected) as info:
        open_request(Keyring([KEY]), frame[LENGTH_BYTES:], NOW)
    assert info.value.reason == "forged"
    frame = seal_frame(Keyring([KEY]), "origin", encode_request(_request()), NOW - 3600, KIND_OFFLOAD_REQUEST)
    with pytest.raises(EnvelopeRejected) as info:
        open_request(Keyring([KEY]), frame[LENGTH_BYTES:], NOW)
    assert info.value.reason == "stale"


def test_authentic_garbage_is_malformed_not_rejected():
    frame = seal_frame(Keyring([KEY]), "origin", b"\xc1garbage", NOW, KIND_OFFLOAD_REQUEST)
    with pytest.raises(OffloadProtocolError) as info:
        open_request(Keyring([KEY]), frame[LENGTH_BYTES:], NOW)
    assert info.value.reason == "malformed" and not isinstance(info.value, EnvelopeRejected)


# -- framing -----------------------------------------------------------------------------------------------------


def _framed(*bodies: bytes) -> bytes:
    return b"".join(len(body).to_bytes(LENGTH_BYTES, "big") + body for body in bodies)


def test_frames_come_out_whole_however_the_stream_is_cut():
    stream = _framed(b"a", b"bc" * 300, b"def")
    for cut in (1, 2, 3, 5, 7, 600, len(stream)):
        parser = FrameParser(1000)
        frames = []
        for start in range(0, len(stream), cut):
            frames += parser.feed(stream[start : start + cut])
        assert frames == [b"a", b"bc" * 300, b"def"], cut
        assert parser.error is None and not parser.in_frame


def test_an_oversized_prefix_stops_the_parser_before_its_body():
    charged: list[int] = []
    parser = FrameParser(100, charge=lambda n: charged.append(n) or True)
    assert parser.feed(_framed(b"x" * 100) + (101).to_bytes(4, "big") + b"y" * 101 + _framed(b"z")) == [b"x" * 100]
    assert parser.error == "oversized"
    assert charged == [100]  # the oversized body was never charged, so never given a buffer
    assert parser.feed(_framed(b"later")) == []


def test_a_body_the_budget_cannot_hold_is_refused():
    parser = FrameParser(1000, charge=lambda n: n <= 10)
    assert parser.feed(_framed(b"0123456789")) == [b"0123456789"]
    assert parser.feed(_framed(b"01234567890")) == []
    assert parser.error == "budget"


def test_an_empty_frame_is_refused():
    parser = FrameParser(100)
    assert parser.feed(bytes(4) + _framed(b"x")) == []
    assert parser.error == "empty"


# -- codec -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def photo_128(astronaut_rgb) -> np.ndarray:
    import cv2

    return np.ascontiguousarray(cv2.resize(astronaut_rgb[:, :, ::-1], (128, 96), interpolation=cv2.INTER_AREA))


def test_zstd_is_exact_and_jpeg_close(photo_128):
    raw = codec.encode(photo_128, "zstd")
    assert np.array_equal(codec.decode(raw, "zstd", 96, 128), photo_128)
    jpeg = codec.encode(photo_128, "jpeg")
    back = codec.decode(jpeg, "jpeg", 96, 128)
    assert back.shape == (96, 128, 3) and back.dtype == np.uint8
    assert len(jpeg) < len(raw)
    assert np.abs(back.astype(int) - photo_128).mean() < 4.0  # quality 90


@pytest.mark.parametrize("name", ["zstd", "jpeg"])
def test_a_picture_of_another_size_is_refused(photo_128, name):
    data = codec.encode(photo_128, name)
    with pytest.raises(codec.CodecError) as info:
        codec.decode(data, name, 96, 127)
    assert info.value.reason == "size"
    with pytest.raises(codec.CodecError, match="outside 1..4096"):
        codec.decode(data, name, 96, 4097)


def test_a_zstd_bomb_is_refused_before_it_is_inflated():
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))  # 64 MiB of zeros in a few KB
    with pytest.raises(codec.CodecError, match="zstd frame of 67108864 bytes") as info:
        codec.decode(bomb, "zstd", 128, 128)
    assert info.value.reason == "size"
    # Without a declared size, inflating stops at the size the request declares.
    quiet = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(64 << 20))
    with pytest.raises(codec.CodecError) as info:
        codec.decode(quiet, "zstd", 128, 128)
    assert info.value.reason == "image"


def test_a_jpeg_header_is_read_before_decoding(photo_128):
    jpeg = bytearray(codec.encode(photo_128, "jpeg"))
    assert codec.jpeg_size(bytes(jpeg)) == (96, 128)
    # A header claiming 60000 x 60000 pixels is refused without decoding (OpenCV would try 10 GB).
    sof = next(i for i in range(2, len(jpeg) - 1) if jpeg[i] == 0xFF and jpeg[i + 1] in (0xC0, 0xC2))
    jpeg[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") * 2
    with pytest.raises(codec.CodecError, match="JPEG of 60000x60000") as info:
        codec.decode(bytes(jpeg), "jpeg", 96, 128)
    assert info.value.reason == "size"


@pytest.mark.parametrize(
    ("data", "name", "reason"),
    [
        (b"not a picture", "jpeg", "image"),
        (b"\xff\xd8\xff\xd9", "jpeg", "image"),
        (b"not zstd", "zstd", "image"),
        (b"", "zstd", "image"),
        (b"\x00" * 9, "webp", "codec"),
    ],
)
def test_garbage_is_not_a_picture(data, name, reason):
    with pytest.raises(codec.CodecError) as info:
        codec.decode(data, name, 4, 4)
    assert info.value.reason == reason


# -- property ----------------------------------------------------------------------------------------------------


def _receive(keyring: Keyring, chunks: list[bytes]) -> None:
    """What the server does with bytes from a socket, minus the socket: frames, envelopes, requests, images."""
    parser = FrameParser(MAX_REQUEST_BYTES, charge=lambda n: n <= 1 << 20)
    for chunk in chunks:
        for frame in parser.feed(chunk):
            try:
                _sender, request = open_request(keyring, frame, NOW)
            except OffloadProtocolError:
                continue
            try:
                codec.decode(request.data, request.codec, request.height, request.width)
            except codec.CodecError:
                pass
        if parser.error is not None:
            return


@given(st.lists(st.binary(max_size=300), max_size=6))
@example([_framed(b"\x00" * 80)])
@example([(1 << 31).to_bytes(4, "big"), b"x"])
def test_arbitrary_bytes_never_raise_out_of_the_receive_path(chunks):
    _receive(Keyring([KEY]), chunks)


@given(st.binary(max_size=400), st.sampled_from(["jpeg", "zstd", "png"]), st.integers(1, 64), st.integers(1, 64))
def test_authentic_arbitrary_plaintext_never_raises_out_of_the_receive_path(plaintext, name, height, width):
    """Bytes from a peer that holds the key: the envelope opens, whatever is inside is refused by reason."""
    sender = Keyring([KEY])
    framed = seal_frame(sender, "origin", plaintext, NOW, KIND_OFFLOAD_REQUEST)
    request = _request(codec=name, height=height, width=width, data=plaintext)
    _receive(Keyring([KEY]), [framed, seal_frame(sender, "origin", encode_request(request), NOW, KIND_OFFLOAD_REQUEST)])

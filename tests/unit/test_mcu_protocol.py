"""edgelink in Python: the shared vectors both ways, decoder properties, exact errors, link counters."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.mcu.link import McuLink
from edgerun.mcu.protocol import (
    MAX_CHUNK,
    MAX_ENCODED_BODY,
    Ack,
    Detection,
    Frame,
    FrameDecoder,
    Heartbeat,
    Hello,
    Log,
    MsgType,
    OtaBegin,
    OtaChunk,
    OtaEnd,
    ProtocolError,
    decode_message,
    encode_frame,
    encode_message,
)

VECTORS = Path(__file__).resolve().parents[2] / "firmware_mcu" / "tests" / "vectors"


def _load(name: str) -> list[dict]:
    return json.loads((VECTORS / name).read_text())["vectors"]


def _results(data: bytes) -> str:
    return ",".join("frame" if isinstance(r, Frame) else r for r in FrameDecoder().feed(data))


@pytest.mark.parametrize("vector", _load("c_frames.json"), ids=lambda v: v["name"])
def test_c_encoded_frames_decode_the_same_in_python(vector: dict) -> None:
    if vector["kind"] == "stream":
        assert _results(bytes.fromhex(vector["stream"])) == vector["results"]
        return
    frame = bytes.fromhex(vector["frame"])
    items = FrameDecoder().feed(frame)
    assert len(items) == 1 and isinstance(items[0], Frame), items
    msg = decode_message(items[0])
    assert msg.describe() == vector["describe"]
    assert items[0].seq == vector["seq"]
    assert encode_message(msg, vector["seq"]) == frame  # byte for byte


def test_c_vectors_cover_every_message_type_and_drop_reasons() -> None:
    vectors = _load("c_frames.json")
    kinds = {v["describe"].split()[0] for v in vectors if v["kind"] == "message"}
    assert kinds == {"hello", "detection", "heartbeat", "log", "ota_begin", "ota_chunk", "ota_end", "ack", "nack"}
    reasons = {r for v in vectors if v["kind"] == "stream" for r in v["results"].split(",")}
    assert {"frame", "bad_crc", "too_long"} <= reasons


def test_python_vectors_file_is_what_the_python_encoder_writes_now() -> None:
    spec = importlib.util.spec_from_file_location("make_python_vectors", VECTORS / "make_python_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (VECTORS / "python_vectors.json").read_text() == module.render(), (
        "run .venv/bin/python firmware_mcu/tests/vectors/make_python_vectors.py and `make -C firmware_mcu test`"
    )
    reasons = {r for v in _load("python_vectors.json") if v["kind"] == "stream" for r in v["results"].split(",")}
    assert reasons == {"frame", "bad_crc", "too_long", "bad_cobs", "too_short", "bad_version", "bad_length"}


def test_decode_errors_name_the_type_and_length() -> None:
    with pytest.raises(ProtocolError, match=r"^DETECTION: payload of 15 bytes, expected 16$") as err:
        decode_message(Frame(MsgType.DETECTION, 0, bytes(15)))
    assert err.value.code == "length"
    with pytest.raises(ProtocolError, match=r"^unknown message type 0x7f$"):
        decode_message(Frame(0x7F, 0, b""))
    with pytest.raises(ProtocolError, match=r"^OTA_CHUNK: payload of 4 bytes, expected \(5, 240\)$"):
        decode_message(Frame(MsgType.OTA_CHUNK, 0, bytes(4)))
    with pytest.raises(ProtocolError, match="at most 240"):
        encode_frame(MsgType.LOG, 0, bytes(241))
    with pytest.raises(ProtocolError, match="expected 1..236"):
        OtaChunk(0, bytes(MAX_CHUNK + 1)).payload()


MESSAGES = st.one_of(
    st.builds(
        Hello,
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 65535),
        st.integers(0, 65535),
        st.integers(0, 255),
        st.integers(0, 255),
        st.binary(min_size=16, max_size=16),
    ),
    st.builds(
        Detection,
        st.integers(0, 2**32 - 1),
        st.integers(0, 65535),
        st.integers(0, 65535),
        st.tuples(*[st.integers(0, 65535)] * 4),
    ),
    st.builds(Heartbeat, *[st.integers(0, 2**32 - 1)] * 4),
    st.builds(Log, st.integers(0, 255), st.binary(max_size=239)),
    st.builds(
        OtaBegin,
        st.binary(min_size=64, max_size=64),
        st.binary(min_size=8, max_size=8),
        st.binary(min_size=64, max_size=64),
    ),
    st.builds(OtaChunk, st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=MAX_CHUNK)),
    st.just(OtaEnd()),
    st.builds(
        Ack, st.integers(0, 255), st.integers(0, 65535), st.integers(0, 2**32 - 1), st.integers(0, 255), st.booleans()
    ),
)


@settings(max_examples=300, deadline=None)
@given(msgs=st.lists(MESSAGES, min_size=1, max_size=8), cuts=st.lists(st.integers(0, 4000), max_size=10))
def test_streaming_in_any_split_equals_one_shot(msgs: list, cuts: list[int]) -> None:
    stream = b"".join(encode_message(m, i) for i, m in enumerate(msgs))
    decoder = FrameDecoder()
    out: list = []
    edges = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for a, b in zip(edges, edges[1:]):
        out += decoder.feed(stream[a:b])
    assert [decode_message(f) for f in out] == msgs


@settings(max_examples=500, deadline=None)
@given(garbage=st.binary(max_size=2000))
def test_garbage_never_raises_and_the_next_frame_still_decodes(garbage: bytes) -> None:
    link = McuLink()
    link.receive(garbage)  # never raises
    good = encode_message(Detection(1, 2, 3, (4, 5, 6, 7)), 0)
    msgs = link.receive(b"\0" + good)
    assert msgs[-1] == Detection(1, 2, 3, (4, 5, 6, 7))
    assert link.counters.frames >= 1


def test_link_counts_drops_by_reason_and_sequence_gaps() -> None:
    link = McuLink()
    frames = [encode_message(Heartbeat(i, 0, 0, 0), i) for i in range(10)]
    damaged = bytearray(frames[3])
    damaged[-3] ^= 0x80  # inside the CRC: still valid COBS
    stream = frames[0] + frames[1] + bytes(damaged) + frames[5] + frames[6] + b"\x41" * (MAX_ENCODED_BODY + 1) + b"\0"
    stream += encode_frame(MsgType.DETECTION, 7, bytes(3))  # well framed, wrong payload size
    stream += frames[8]
    msgs = link.receive(stream)
    assert [m.uptime_ms for m in msgs] == [0, 1, 5, 6, 8]
    assert link.counters.drops["bad_crc"] == 1
    assert link.counters.drops["too_long"] == 1
    assert link.counters.drops["payload_length"] == 1
    # Frames 2, 3 and 4 never arrived whole: 3 is also counted as bad_crc, so lost counts its number too.
    assert link.counters.lost == 3
    assert link.heartbeat == Heartbeat(8, 0, 0, 0)


def test_link_counts_wraparound_gaps_but_not_a_rebooted_mcu() -> None:
    link = McuLink()
    link.receive(encode_message(Heartbeat(0, 0, 0, 0), 65534))
    link.receive(encode_message(Heartbeat(0, 0, 0, 0), 1))  # 65535 and 0 lost across the wrap
    assert link.counters.lost == 2
    link.receive(encode_message(Hello(1, 1, 1, 96, 96), 0))  # a reboot: HELLO is frame 0
    assert link.counters.lost == 2

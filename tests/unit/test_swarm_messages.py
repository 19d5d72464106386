"""Wire messages of the membership protocol: round trips, bounds, and a decoder that only raises WireError."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.messages import (
    MAX_MESSAGES_PER_PACKET,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Alive,
    Dead,
    IndirectPing,
    Nack,
    Ping,
    PushMember,
    PushPull,
    Suspect,
    UserMsg,
    WireError,
    decode_packet,
    decode_stream,
    encode_message,
    encode_packet,
    encode_stream,
    packet_overhead,
)

names = st.text(min_size=1, max_size=40)
counters = st.integers(min_value=0, max_value=2**63 - 1)
addrs = st.tuples(st.text(min_size=1, max_size=60), st.integers(min_value=0, max_value=65535))
metas = st.binary(max_size=MAX_META_BYTES)

messages = st.one_of(
    st.builds(Ping, seq=counters, target=names, source=names),
    st.builds(IndirectPing, seq=counters, target=names, target_addr=addrs, nack=st.booleans()),
    st.builds(Ack, seq=counters),
    st.builds(Nack, seq=counters),
    st.builds(Alive, name=names, addr=addrs, incarnation=counters, meta=metas),
    st.builds(Suspect, name=names, incarnation=counters, source=names),
    st.builds(Dead, name=names, incarnation=counters, source=names),
    st.builds(UserMsg, sender=names, key=st.binary(max_size=128), seq=counters, payload=st.binary(max_size=1024)),
)
push_members = st.builds(
    PushMember, name=names, addr=addrs, incarnation=counters, state=st.integers(min_value=0, max_value=3), meta=metas
)
push_pulls = st.builds(
    PushPull,
    join=st.booleans(),
    source=names,
    members=st.lists(push_members, max_size=8),
    broadcasts=st.lists(
        st.builds(UserMsg, sender=names, key=st.binary(max_size=16), seq=counters, payload=st.binary(max_size=64)),
        max_size=4,
    ),
)


@given(st.lists(messages, min_size=1, max_size=20))
def test_packet_round_trip(batch: list) -> None:
    parts = [encode_message(m) for m in batch]
    packet = encode_packet(parts)
    # the sender packs by exact size: the packet is the parts plus the fixed overhead, nothing more
    assert len(packet) == sum(len(p) for p in parts) + packet_overhead(len(parts))
    assert decode_packet(packet) == batch


@given(st.one_of(push_pulls, st.builds(Ping, seq=counters, target=names, source=names), st.builds(Ack, seq=counters)))
def test_stream_round_trip(message) -> None:
    assert decode_stream(encode_stream(message)) == message


@settings(max_examples=500)
@given(st.binary(max_size=2000))
def test_no_byte_string_makes_the_packet_decoder_raise_anything_but_wire_error(data: bytes) -> None:
    for candidate in (data, bytes([PROTOCOL_VERSION]) + data):
        try:
            decoded = decode_packet(candidate)
        except WireError as exc:
            assert exc.reason in {"short", "oversized", "version", "malformed"}
        else:
            assert 1 <= len(decoded) <= MAX_MESSAGES_PER_PACKET


@settings(max_examples=300)
@given(st.binary(max_size=2000))
def test_no_byte_string_makes_the_stream_decoder_raise_anything_but_wire_error(data: bytes) -> None:
    for candidate in (data, bytes([PROTOCOL_VERSION]) + data):
        try:
            decode_stream(candidate)
        except WireError as exc:
            assert exc.reason in {"short", "oversized", "version", "malformed"}


@settings(max_examples=300)
@given(st.lists(messages, min_size=1, max_size=5), st.data())
def test_corrupted_valid_packets_decode_or_raise_wire_error(batch: list, data) -> None:
    packet = bytearray(encode_packet([encode_message(m) for m in batch]))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        index = data.draw(st.integers(min_value=0, max_value=len(packet) - 1))
        packet[index] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(packet)))
    try:
        decode_packet(bytes(packet[:cut]))
    except WireError:
        pass


def _raw_packet(*items) -> bytes:
    """A packet built around the typed encoder, to smuggle in values the types forbid."""
    return bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(list(items))


@pytest.mark.parametrize(
    ("packet", "reason", "detail"),
    [
        (b"", "short", "0 bytes"),
        (b"\x01", "short", "1 bytes"),
        (b"\x07\x90", "version", "protocol 7"),
        (b"\x01\x90", "malformed", "0 messages"),
        (b"\x01" + b"\x00" * 70000, "oversized", "70001 bytes"),
        (_raw_packet([5, "n", ["h", 1], 1, b"x" * (MAX_META_BYTES + 1)]), "malformed", "length <= 512"),
        (_raw_packet([1, 1, "x" * 129, "s"]), "malformed", "length <= 128"),
        (_raw_packet([5, "n", ["h", 70000], 1, b""]), "malformed", "<= 65535"),
        (_raw_packet([3, -1]), "malformed", ">= 0"),
        (_raw_packet([99, 1]), "malformed", "Invalid value 99"),
        (_raw_packet([3]), "malformed", "at least length 2"),
        (_raw_packet(*[[3, 1]] * (MAX_MESSAGES_PER_PACKET + 1)), "malformed", "256 messages"),
    ],
)
def test_bad_packets_name_what_is_wrong(packet: bytes, reason: str, detail: str) -> None:
    with pytest.raises(WireError) as caught:
        decode_packet(packet)
    assert caught.value.reason == reason
    assert detail in str(caught.value)


def test_encode_packet_refuses_an_empty_or_overfull_packet() -> None:
    with pytest.raises(ValueError, match="1..255"):
        encode_packet([])
    with pytest.raises(ValueError, match="1..255"):
        encode_packet([encode_message(Ack(seq=1))] * (MAX_MESSAGES_PER_PACKET + 1))

"""Typed wire messages of the membership protocol, encoded with msgspec's msgpack.

A datagram is one version byte followed by a msgpack array of tagged messages (a compound packet: several
messages in one datagram, like memberlist's compoundMsg). Each message is encoded once, so a sender packs
piggybacked updates by their exact encoded size. A stream (TCP push-pull or fallback ping) carries one
version byte and one tagged message.

Decoding never trusts a length: the packet size is checked before parsing, every string, byte string and
list has a bound in its type, and anything wrong raises :class:`WireError` (a ``ValueError``) with a short
reason, never any other exception.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PROTOCOL_VERSION = 1
MAX_NAME_BYTES = 128
MAX_HOST_BYTES = 253
MAX_META_BYTES = 512
MAX_KEY_BYTES = 128
MAX_USER_PAYLOAD_BYTES = 1024
MAX_MESSAGES_PER_PACKET = 255
MAX_DATAGRAM_BYTES = 65507
MAX_STREAM_BYTES = 8 * 1024 * 1024
MAX_PUSH_MEMBERS = 4096
MAX_PUSH_BROADCASTS = 4096

_COUNTER_MAX = 2**63 - 1

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_BYTES)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_BYTES)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Counter = Annotated[int, msgspec.Meta(ge=0, le=_COUNTER_MAX)]
Meta = Annotated[bytes, msgspec.Meta(max_length=MAX_META_BYTES)]
Key = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)]
Payload = Annotated[bytes, msgspec.Meta(max_length=MAX_USER_PAYLOAD_BYTES)]
Addr = tuple[Host, Port]
StateCode = Annotated[int, msgspec.Meta(ge=0, le=3)]


class WireError(ValueError):
    """Bytes that are not a valid message; ``reason`` is a short label for drop counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class _Message(msgspec.Struct, tag_field="t", array_like=True, frozen=True, forbid_unknown_fields=True):
    """Base of every wire message: array-like (no field names on the wire), tagged by a small integer.

    Subclasses repeat ``frozen=True``: msgspec inherits it, but a type checker reads each class's own options.
    """


class Ping(_Message, tag=1, frozen=True):
    """Are you alive? ``target`` names the member meant (an address can be reused by another member)."""

    seq: Counter
    target: Name
    source: Name


class IndirectPing(_Message, tag=2, frozen=True):
    """Please ping ``target`` for me and relay its ack (and a nack if it stays silent)."""

    seq: Counter
    target: Name
    target_addr: Addr
    nack: bool


class Ack(_Message, tag=3, frozen=True):
    seq: Counter


class Nack(_Message, tag=4, frozen=True):
    """The relay of an indirect ping is alive but heard nothing from the target (Lifeguard's health signal)."""

    seq: Counter


class Alive(_Message, tag=5, frozen=True):
    name: Name
    addr: Addr
    incarnation: Counter
    meta: Meta


class Suspect(_Message, tag=6, frozen=True):
    name: Name
    incarnation: Counter
    source: Name


class Dead(_Message, tag=7, frozen=True):
    """``source == name`` means the member left gracefully."""

    name: Name
    incarnation: Counter
    source: Name


class UserMsg(_Message, tag=8, frozen=True):
    """An application broadcast; ``seq`` grows per sender so a newer payload for one key replaces an older one."""

    sender: Name
    key: Key
    seq: Counter
    payload: Payload


class PushMember(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    name: Name
    addr: Addr
    incarnation: Counter
    state: StateCode
    meta: Meta


class PushPull(_Message, tag=9, frozen=True):
    """Full state exchanged over a stream: members and the app broadcasts still within their lifetime."""

    join: bool
    source: Name
    members: Annotated[list[PushMember], msgspec.Meta(max_length=MAX_PUSH_MEMBERS)]
    broadcasts: Annotated[list[UserMsg], msgspec.Meta(max_length=MAX_PUSH_BROADCASTS)]


Message = Ping | IndirectPing | Ack | Nack | Alive | Suspect | Dead | UserMsg
StreamMessage = Ping | Ack | PushPull

_encoder = msgspec.msgpack.Encoder()
_packet_decoder: msgspec.msgpack.Decoder[list[Message]] = msgspec.msgpack.Decoder(list[Message])
_stream_decoder: msgspec.msgpack.Decoder[StreamMessage] = msgspec.msgpack.Decoder(StreamMessage)
_VERSION_BYTE = bytes([PROTOCOL_VERSION])


def encode_message(message: Message | PushPull) -> bytes:
    """One message's msgpack bytes, to pack into a compound packet (or a stream) later."""
    return _encoder.encode(message)


def array_header_size(count: int) -> int:
    """Bytes msgpack spends on an array header of ``count`` items."""
    return 1 if count < 16 else 3


def packet_overhead(count: int) -> int:
    """Bytes a packet of ``count`` messages adds beyond the messages themselves."""
    return 1 + array_header_size(count)


def encode_packet(parts: list[bytes]) -> bytes:
    """A datagram from already-encoded messages (see :func:`encode_message`)."""
    if not 1 <= len(parts) <= MAX_MESSAGES_PER_PACKET:
        raise ValueError(f"a packet holds 1..{MAX_MESSAGES_PER_PACKET} messages, got {len(parts)}")
    return _VERSION_BYTE + _encoder.encode([msgspec.Raw(part) for part in parts])


def decode_packet(data: bytes) -> list[Message]:
    """The messages of one datagram; raises :class:`WireError` and nothing else."""
    if len(data) < 2:
        raise WireError("short", f"{len(data)} bytes")
    if len(data) > MAX_DATAGRAM_BYTES:
        raise WireError("oversized", f"{len(data)} bytes")
    if data[0] != PROTOCOL_VERSION:
        raise WireError("version", f"protocol {data[0]}, expected {PROTOCOL_VERSION}")
    try:
        messages = _packet_decoder.decode(memoryview(data)[1:])
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise WireError("malformed", str(exc)) from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
        raise WireError("malformed", f"{type(exc).__name__}: {exc}") from None
    if not 1 <= len(messages) <= MAX_MESSAGES_PER_PACKET:
        raise WireError("malformed", f"{len(messages)} messages in one packet")
    return messages


def encode_stream(message: Ping | Ack | PushPull) -> bytes:
    return _VERSION_BYTE + _encoder.encode(message)


def decode_stream(data: bytes) -> Ping | Ack | PushPull:
    """The message of one stream request or reply; raises :class:`WireError` and nothing else."""
    if len(data) < 2:
        raise WireError("short", f"{len(data)} bytes")
    if len(data) > MAX_STREAM_BYTES:
        raise WireError("oversized", f"{len(data)} bytes")
    if data[0] != PROTOCOL_VERSION:
        raise WireError("version", f"protocol {data[0]}, expected {PROTOCOL_VERSION}")
    try:
        return _stream_decoder.decode(memoryview(data)[1:])
    except msgspec.DecodeError as exc:
        raise WireError("malformed", str(exc)) from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
        raise WireError("malformed", f"{type(exc).__name__}: {exc}") from None

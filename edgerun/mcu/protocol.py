"""edgelink, the serial protocol of MCU sensor nodes, as in ``firmware_mcu/include/edgelink.h``.

One frame on the wire is ``COBS(version | type | seq:u16 | len:u16 | payload | crc32c:u32) 0x00``,
little-endian throughout. The C library and this module agree byte for byte: the vectors in
``firmware_mcu/tests/vectors/`` are written by one side and checked by the other.

Nothing here does I/O. ``FrameDecoder.feed`` takes whatever bytes arrived and returns frames and
the reasons frames were dropped; it never raises on input.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import ClassVar

import crc32c as _crc32c
from cobs import cobs

from edgerun.errors import EdgerunError

VERSION = 1
HEADER = struct.Struct("<BBHH")
CRC = struct.Struct("<I")
MAX_PAYLOAD = 240
MAX_FRAME = HEADER.size + MAX_PAYLOAD + CRC.size
# A frame's COBS bytes without the delimiter, as the C decoder's buffer.
MAX_ENCODED_BODY = MAX_FRAME + MAX_FRAME // 254 + 1
MANIFEST_LEN = 64
KEY_ID_LEN = 8
SIGNATURE_LEN = 64
MODEL_NAME_LEN = 16
CHUNK_HEADER = 4
MAX_CHUNK = MAX_PAYLOAD - CHUNK_HEADER
MAX_LOG = MAX_PAYLOAD - 1


class ProtocolError(EdgerunError):
    """A message that cannot be encoded or a payload that does not parse; ``code`` names why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class MsgType(enum.IntEnum):
    HELLO = 0x01
    DETECTION = 0x02
    HEARTBEAT = 0x03
    LOG = 0x04
    OTA_BEGIN = 0x10
    OTA_CHUNK = 0x11
    OTA_END = 0x12
    ACK = 0x20
    NACK = 0x21


class NackReason(enum.IntEnum):
    MALFORMED = 1
    UNKNOWN_TYPE = 2
    UNKNOWN_KEY = 3
    BAD_SIGNATURE = 4
    BAD_MANIFEST = 5
    ROLLBACK = 6
    TOO_LARGE = 7
    NO_SESSION = 8
    BAD_OFFSET = 9
    INCOMPLETE = 10
    HASH_MISMATCH = 11
    STORAGE = 12


# Why the decoder dropped a frame; the names match el_rx_result_name() in C.
DROP_REASONS = ("too_long", "bad_cobs", "too_short", "bad_crc", "bad_version", "bad_length")


def crc32c(data: bytes) -> int:
    return _crc32c.crc32c(data)


@dataclass(frozen=True, slots=True)
class Hello:
    TYPE: ClassVar[MsgType] = MsgType.HELLO
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<IIIHHBBH16s")
    device_id: int
    fw_version: int
    model_version: int
    frame_width: int
    frame_height: int
    active_slot: int = 0xFF
    flags: int = 0
    model_name: bytes = b""

    def payload(self) -> bytes:
        return self.FORMAT.pack(
            self.device_id,
            self.fw_version,
            self.model_version,
            self.frame_width,
            self.frame_height,
            self.active_slot,
            self.flags,
            0,
            self.model_name,
        )

    @classmethod
    def parse(cls, data: bytes) -> Hello:
        f = cls.FORMAT.unpack(data)
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[8])

    @property
    def name(self) -> str:
        return self.model_name.rstrip(b"\0").decode("ascii", "replace")

    def describe(self) -> str:
        name = self.model_name.ljust(MODEL_NAME_LEN, b"\0").hex()
        return (
            f"hello device_id={self.device_id} fw_version={self.fw_version} model_version={self.model_version} "
            f"frame={self.frame_width}x{self.frame_height} slot={self.active_slot} flags={self.flags} name={name}"
        )


@dataclass(frozen=True, slots=True)
class Detection:
    TYPE: ClassVar[MsgType] = MsgType.DETECTION
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<IHH4H")
    timestamp_ms: int
    class_id: int
    score_q16: int
    box: tuple[int, int, int, int]

    @property
    def score(self) -> float:
        return self.score_q16 / 65535.0

    def payload(self) -> bytes:
        return self.FORMAT.pack(self.timestamp_ms, self.class_id, self.score_q16, *self.box)

    @classmethod
    def parse(cls, data: bytes) -> Detection:
        f = cls.FORMAT.unpack(data)
        return cls(f[0], f[1], f[2], (f[3], f[4], f[5], f[6]))

    def describe(self) -> str:
        box = ",".join(str(v) for v in self.box)
        return f"detection ts={self.timestamp_ms} class={self.class_id} score_q16={self.score_q16} box={box}"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<IIII")
    uptime_ms: int
    detections_sent: int
    detections_dropped: int
    rx_bad_frames: int

    def payload(self) -> bytes:
        return self.FORMAT.pack(self.uptime_ms, self.detections_sent, self.detections_dropped, self.rx_bad_frames)

    @classmethod
    def parse(cls, data: bytes) -> Heartbeat:
        return cls(*cls.FORMAT.unpack(data))

    def describe(self) -> str:
        return (
            f"heartbeat uptime={self.uptime_ms} sent={self.detections_sent} dropped={self.detections_dropped} "
            f"rx_bad={self.rx_bad_frames}"
        )


@dataclass(frozen=True, slots=True)
class Log:
    TYPE: ClassVar[MsgType] = MsgType.LOG
    level: int
    text: bytes

    def payload(self) -> bytes:
        if len(self.text) > MAX_LOG:
            raise ProtocolError("length", f"log text: {len(self.text)} bytes, at most {MAX_LOG}")
        return bytes([self.level]) + self.text

    @classmethod
    def parse(cls, data: bytes) -> Log:
        return cls(data[0], bytes(data[1:]))

    def describe(self) -> str:
        return f"log level={self.level} text={self.text.hex()}"


@dataclass(frozen=True, slots=True)
class OtaBegin:
    TYPE: ClassVar[MsgType] = MsgType.OTA_BEGIN
    manifest: bytes
    key_id: bytes
    signature: bytes

    def payload(self) -> bytes:
        if (len(self.manifest), len(self.key_id), len(self.signature)) != (MANIFEST_LEN, KEY_ID_LEN, SIGNATURE_LEN):
            raise ProtocolError("length", "ota_begin: manifest 64, key id 8 and signature 64 bytes expected")
        return self.manifest + self.key_id + self.signature

    @classmethod
    def parse(cls, data: bytes) -> OtaBegin:
        m, k = MANIFEST_LEN, MANIFEST_LEN + KEY_ID_LEN
        return cls(bytes(data[:m]), bytes(data[m:k]), bytes(data[k:]))

    def describe(self) -> str:
        return f"ota_begin manifest={self.manifest.hex()} key_id={self.key_id.hex()} sig={self.signature.hex()}"


@dataclass(frozen=True, slots=True)
class OtaChunk:
    TYPE: ClassVar[MsgType] = MsgType.OTA_CHUNK
    offset: int
    data: bytes

    def payload(self) -> bytes:
        if not 1 <= len(self.data) <= MAX_CHUNK:
            raise ProtocolError("length", f"ota_chunk: {len(self.data)} data bytes, expected 1..{MAX_CHUNK}")
        return struct.pack("<I", self.offset) + self.data

    @classmethod
    def parse(cls, data: bytes) -> OtaChunk:
        return cls(struct.unpack_from("<I", data)[0], bytes(data[CHUNK_HEADER:]))

    def describe(self) -> str:
        return f"ota_chunk offset={self.offset} data={self.data.hex()}"


@dataclass(frozen=True, slots=True)
class OtaEnd:
    TYPE: ClassVar[MsgType] = MsgType.OTA_END

    def payload(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, data: bytes) -> OtaEnd:
        return cls()

    def describe(self) -> str:
        return "ota_end"


@dataclass(frozen=True, slots=True)
class Ack:
    """ACK (``reason`` 0) or NACK; ``value`` is the next offset the MCU expects, or its model version."""

    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BBHI")
    acked_type: int
    acked_seq: int
    value: int = 0
    reason: int = 0
    nack: bool = False

    @property
    def TYPE(self) -> MsgType:
        return MsgType.NACK if self.nack else MsgType.ACK

    def payload(self) -> bytes:
        return self.FORMAT.pack(self.acked_type, self.reason, self.acked_seq, self.value)

    @classmethod
    def parse(cls, data: bytes, nack: bool = False) -> Ack:
        t, reason, seq, value = cls.FORMAT.unpack(data)
        return cls(t, seq, value, reason, nack)

    def describe(self) -> str:
        word = "nack" if self.nack else "ack"
        return f"{word} type={self.acked_type} reason={self.reason} seq={self.acked_seq} value={self.value}"


Message = Hello | Detection | Heartbeat | Log | OtaBegin | OtaChunk | OtaEnd | Ack

# Payload lengths each type accepts: an exact size, or (min, max).
_LENGTHS: dict[int, int | tuple[int, int]] = {
    MsgType.HELLO: Hello.FORMAT.size,
    MsgType.DETECTION: Detection.FORMAT.size,
    MsgType.HEARTBEAT: Heartbeat.FORMAT.size,
    MsgType.LOG: (1, 1 + MAX_LOG),
    MsgType.OTA_BEGIN: MANIFEST_LEN + KEY_ID_LEN + SIGNATURE_LEN,
    MsgType.OTA_CHUNK: (CHUNK_HEADER + 1, CHUNK_HEADER + MAX_CHUNK),
    MsgType.OTA_END: 0,
    MsgType.ACK: Ack.FORMAT.size,
    MsgType.NACK: Ack.FORMAT.size,
}


@dataclass(frozen=True, slots=True)
class Frame:
    type: int
    seq: int
    payload: bytes


def encode_frame(msg_type: int, seq: int, payload: bytes) -> bytes:
    """One frame: COBS-encoded, with its trailing 0x00."""
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError("length", f"payload of {len(payload)} bytes, at most {MAX_PAYLOAD}")
    raw = HEADER.pack(VERSION, msg_type, seq & 0xFFFF, len(payload)) + payload
    raw += CRC.pack(crc32c(raw))
    return cobs.encode(raw) + b"\0"


def encode_message(msg: Message, seq: int) -> bytes:
    return encode_frame(int(msg.TYPE), seq, msg.payload())


def decode_message(frame: Frame) -> Message:
    """A typed message from a checked frame; ProtocolError ``type`` or ``length`` when it does not parse."""
    want = _LENGTHS.get(frame.type)
    if want is None:
        raise ProtocolError("type", f"unknown message type 0x{frame.type:02x}")
    n = len(frame.payload)
    ok = n == want if isinstance(want, int) else want[0] <= n <= want[1]
    if not ok:
        name = MsgType(frame.type).name
        raise ProtocolError("length", f"{name}: payload of {n} bytes, expected {want}")
    data = frame.payload
    t = frame.type
    if t == MsgType.HELLO:
        return Hello.parse(data)
    if t == MsgType.DETECTION:
        return Detection.parse(data)
    if t == MsgType.HEARTBEAT:
        return Heartbeat.parse(data)
    if t == MsgType.LOG:
        return Log.parse(data)
    if t == MsgType.OTA_BEGIN:
        return OtaBegin.parse(data)
    if t == MsgType.OTA_CHUNK:
        return OtaChunk.parse(data)
    if t == MsgType.OTA_END:
        return OtaEnd.parse(data)
    return Ack.parse(data, nack=t == MsgType.NACK)


def check_frame(body: bytes) -> Frame | str:
    """One delimited frame's COBS bytes to a Frame, or the reason it is dropped (same order of checks as C)."""
    if len(body) > MAX_ENCODED_BODY:
        return "too_long"
    try:
        raw = cobs.decode(body)
    except cobs.DecodeError:
        return "bad_cobs"
    if len(raw) > MAX_FRAME:
        return "too_long"
    if len(raw) < HEADER.size + CRC.size:
        return "too_short"
    if crc32c(raw[:-4]) != CRC.unpack_from(raw, len(raw) - 4)[0]:
        return "bad_crc"
    version, msg_type, seq, length = HEADER.unpack_from(raw)
    if version != VERSION:
        return "bad_version"
    if length != len(raw) - HEADER.size - CRC.size:
        return "bad_length"
    return Frame(msg_type, seq, raw[HEADER.size : HEADER.size + length])


class FrameDecoder:
    """Streaming decoder: bytes in, frames and drop reasons out, resynchronising at each 0x00."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> list[Frame | str]:
        out: list[Frame | str] = []
        start = 0
        while True:
            end = data.find(b"\0", start)
            piece = data[start:] if end < 0 else data[start:end]
            if not self._discarding:
                self._buf += piece
                if len(self._buf) > MAX_ENCODED_BODY:
                    self._buf.clear()
                    self._discarding = True
            if end < 0:
                return out
            if self._discarding:
                out.append("too_long")
                self._discarding = False
            elif self._buf:
                out.append(check_frame(bytes(self._buf)))
                self._buf.clear()
            start = end + 1

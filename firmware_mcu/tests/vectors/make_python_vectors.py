"""Write python_vectors.json: frames encoded by edgerun.mcu.protocol, for the C tests to check.

    .venv/bin/python firmware_mcu/tests/vectors/make_python_vectors.py

One vector per line (the C test reads lines). Kinds: ``message`` (a frame, its canonical
description, re-encoded byte for byte by C), ``reject`` (a well-framed payload the message
decoder refuses: ``length`` or ``type``) and ``stream`` (bytes and the decoder's results).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from edgerun.mcu.protocol import (
    MAX_CHUNK,
    Ack,
    Detection,
    Frame,
    FrameDecoder,
    Heartbeat,
    Hello,
    Log,
    MsgType,
    NackReason,
    OtaBegin,
    OtaChunk,
    OtaEnd,
    encode_frame,
    encode_message,
)

HERE = Path(__file__).resolve().parent


def stream_results(data: bytes) -> str:
    return ",".join("frame" if isinstance(r, Frame) else r for r in FrameDecoder().feed(data))


def vectors() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []

    def message(name: str, msg: object, seq: int) -> None:
        out.append({"name": name, "kind": "message", "seq": seq, "describe": msg.describe(),  # type: ignore[attr-defined]
                    "frame": encode_message(msg, seq).hex()})  # type: ignore[arg-type]

    message("py_hello", Hello(7, 0x00010002, 3, 160, 120, 0, 1, b"kws-int8"), 0)
    message("py_hello_no_model", Hello(0xFFFFFFFF, 1, 0, 96, 96), 1)
    message("py_detection", Detection(4000000000, 65535, 65535, (0, 0, 65535, 65535)), 2)
    message("py_detection_zeros", Detection(0, 0, 0, (0, 0, 0, 0)), 0)
    message("py_heartbeat", Heartbeat(1, 2, 3, 4), 0xFFFF)
    message("py_log", Log(3, b"\x00\x01 model loaded \xff"), 5)
    message("py_log_empty", Log(0, b""), 6)
    message("py_ota_begin", OtaBegin(bytes(range(64)), b"\x00" * 8, bytes(range(64, 128))), 7)
    message("py_ota_chunk_one_byte", OtaChunk(0, b"\x00"), 8)
    message("py_ota_chunk_full", OtaChunk(123456, bytes((i * 13) & 0xFF for i in range(MAX_CHUNK))), 9)
    message("py_ota_end", OtaEnd(), 10)
    message("py_ack", Ack(MsgType.OTA_CHUNK, 9, 123456 + MAX_CHUNK), 11)
    message("py_nack", Ack(MsgType.OTA_BEGIN, 7, 0, NackReason.BAD_SIGNATURE, nack=True), 12)

    def reject(name: str, msg_type: int, payload: bytes, error: str) -> None:
        out.append({"name": name, "kind": "reject", "frame": encode_frame(msg_type, 0, payload).hex(), "error": error})

    reject("py_detection_short", MsgType.DETECTION, bytes(15), "length")
    reject("py_hello_long", MsgType.HELLO, bytes(37), "length")
    reject("py_chunk_no_data", MsgType.OTA_CHUNK, bytes(4), "length")
    reject("py_end_with_payload", MsgType.OTA_END, b"\x01", "length")
    reject("py_log_empty_payload", MsgType.LOG, b"", "length")
    reject("py_unknown_type", 0x7F, b"\x01\x02", "type")

    good = encode_message(Detection(5, 1, 2, (3, 4, 5, 6)), 42)

    def stream(name: str, data: bytes) -> None:
        out.append({"name": name, "kind": "stream", "stream": data.hex(), "results": stream_results(data)})

    flipped = bytearray(good)
    flipped[7] ^= 0x80
    stream("py_stream_flip_then_good", bytes(flipped) + good)
    stream("py_stream_truncated_then_good", good[: len(good) // 2] + b"\0" + good)
    stream("py_stream_idle_delimiters", b"\0\0\0" + good + b"\0\0")
    stream("py_stream_too_long", b"\x41" * 251 + b"\0" + b"\x41" * 252 + b"\0" + good)
    stream("py_stream_bad_cobs", b"\x09\x01\x02\0" + good)
    stream("py_stream_too_short", bytes([5, 1, 1, 1, 1]) + b"\0" + good)
    bad_version = bytearray(good)
    # A version-2 frame with a correct CRC: re-framed by hand.
    raw_v2 = encode_frame(MsgType.DETECTION, 1, bytes(16))
    stream("py_stream_bad_version", _reversion(raw_v2) + bytes(bad_version))
    stream("py_stream_bad_length", _relength(encode_frame(MsgType.DETECTION, 1, bytes(16))) + good)
    return out


def _reframe(frame: bytes, edit: int, value: int) -> bytes:
    from cobs import cobs

    from edgerun.mcu.protocol import CRC, crc32c

    raw = bytearray(cobs.decode(frame[:-1]))
    raw[edit] = value
    body = bytes(raw[:-4])
    return cobs.encode(body + CRC.pack(crc32c(body))) + b"\0"


def _reversion(frame: bytes) -> bytes:
    return _reframe(frame, 0, 2)


def _relength(frame: bytes) -> bytes:
    return _reframe(frame, 4, 15)


def render() -> str:
    lines = ",\n".join("  " + json.dumps(v) for v in vectors())
    return '{"producer": "firmware_mcu/tests/vectors/make_python_vectors.py", "vectors": [\n' + lines + "\n]}\n"


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "python_vectors.json"
    target.write_text(render(), encoding="ascii")

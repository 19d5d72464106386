"""The OTA relay's state machine on a virtual clock: the MCU's answers are scripted here (the real
MCU side is driven in tests/integration/test_mcu_sim.py)."""

from __future__ import annotations

import hashlib

from edgerun.mcu.ota_relay import OtaRelay, RelayState
from edgerun.mcu.protocol import Ack, MsgType, NackReason, OtaBegin, OtaChunk, OtaEnd
from edgerun.mcu.release import McuManifest, McuRelease
from edgerun.ota.minisign import SecretKey

IMAGE = bytes(range(256)) * 3  # 768 bytes: 4 chunks of 200


def _release() -> McuRelease:
    manifest = McuManifest("kws", 4, len(IMAGE), hashlib.sha256(IMAGE).digest())
    data = manifest.encode()
    sig = SecretKey.generate().sign(data, manifest.trusted_comment(1))
    return McuRelease(manifest, data, sig, IMAGE)


def _step(relay: OtaRelay, seq: int, now: float = 0.0):
    msg = relay.next_message()
    assert msg is not None
    relay.sent(int(msg.TYPE), seq, now)
    return msg


def test_full_transfer_follows_the_mcu_offsets() -> None:
    relay = OtaRelay(_release(), chunk_size=200)
    begin = _step(relay, 1)
    assert isinstance(begin, OtaBegin) and begin.manifest == relay.release.manifest_bytes
    assert relay.next_message() is None  # stop-and-wait
    relay.on_ack(Ack(MsgType.OTA_BEGIN, 1, 0))
    offsets = []
    seq = 2
    while relay.state is RelayState.CHUNKS:
        chunk = _step(relay, seq)
        assert isinstance(chunk, OtaChunk)
        offsets.append(chunk.offset)
        relay.on_ack(Ack(MsgType.OTA_CHUNK, seq, chunk.offset + len(chunk.data)))
        seq += 1
    assert offsets == [0, 200, 400, 600]
    assert isinstance(_step(relay, seq), OtaEnd)
    relay.on_ack(Ack(MsgType.OTA_END, seq, 4))
    result = relay.result()
    assert result.ok and result.version == 4 and result.chunks_sent == 4 and result.resends == 0


def test_resume_starts_where_the_mcu_is() -> None:
    relay = OtaRelay(_release(), chunk_size=200)
    _step(relay, 1)
    relay.on_ack(Ack(MsgType.OTA_BEGIN, 1, 400))  # the MCU already holds 400 bytes of this manifest
    chunk = _step(relay, 2)
    assert chunk.offset == 400
    assert relay.result().resumed_from == 400


def test_nack_bad_offset_moves_to_the_offset_the_mcu_expects() -> None:
    relay = OtaRelay(_release(), chunk_size=200)
    _step(relay, 1)
    relay.on_ack(Ack(MsgType.OTA_BEGIN, 1, 0))
    _step(relay, 2)
    relay.on_ack(Ack(MsgType.OTA_CHUNK, 2, 200, NackReason.BAD_OFFSET, nack=True))
    assert _step(relay, 3).offset == 200


def test_stale_or_foreign_answers_are_ignored() -> None:
    relay = OtaRelay(_release(), chunk_size=200)
    _step(relay, 5)
    relay.on_ack(Ack(MsgType.OTA_BEGIN, 4, 0))  # an answer to an older try
    relay.on_ack(Ack(MsgType.OTA_CHUNK, 5, 0))  # wrong type
    assert relay.state is RelayState.BEGIN and relay.next_message() is None


def test_timeouts_resend_then_give_up() -> None:
    relay = OtaRelay(_release(), chunk_size=200, ack_timeout_s=1.0, retries=2)
    now = 0.0
    for _ in range(3):
        assert isinstance(_step(relay, 1, now), OtaBegin)
        relay.poll(now + 0.5)
        assert relay.next_message() is None  # not yet timed out
        now += 1.0
        relay.poll(now)
    assert relay.state is RelayState.FAILED and relay.reason == "timeout"
    assert relay.result().resends == 3


def test_refusal_by_the_mcu_fails_with_its_reason() -> None:
    relay = OtaRelay(_release())
    _step(relay, 1)
    relay.on_ack(Ack(MsgType.OTA_BEGIN, 1, 0, NackReason.BAD_SIGNATURE, nack=True))
    assert relay.result().ok is False and relay.result().reason == "bad_signature"


def test_end_acknowledged_with_another_version_is_not_success() -> None:
    relay = OtaRelay(_release(), chunk_size=200)
    _step(relay, 1)
    relay.on_ack(Ack(MsgType.OTA_BEGIN, 1, 768))  # the MCU holds it all already
    assert isinstance(_step(relay, 3), OtaEnd)
    relay.on_ack(Ack(MsgType.OTA_END, 3, 3))  # the MCU still runs v3 (its trial failed and it rolled back)
    assert relay.result().reason == "not_activated"

"""Sending a verified release to an MCU: OTA_BEGIN, chunks, OTA_END, each acknowledged, without I/O.

Stop-and-wait: one message in flight, resent after ``ack_timeout_s`` up to ``retries`` times.
The MCU's ACK carries the next offset it expects, so a resent chunk it already stored, a NACK
``bad_offset`` or a relay restarted after a dropped link (OTA_BEGIN with the same manifest is
answered with the offset it has) all continue from where the MCU is. The clock is passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from edgerun.mcu.protocol import MAX_CHUNK, Ack, Message, MsgType, NackReason, OtaBegin, OtaChunk, OtaEnd
from edgerun.mcu.release import McuRelease


class RelayState(enum.Enum):
    BEGIN = "begin"
    CHUNKS = "chunks"
    END = "end"
    DONE = "done"
    FAILED = "failed"


@dataclass
class RelayResult:
    ok: bool
    reason: str  # "" when ok; a NackReason name in lower case, or "timeout"
    version: int  # the MCU's model version after OTA_END
    resumed_from: int
    chunks_sent: int
    resends: int


class OtaRelay:
    def __init__(
        self, release: McuRelease, chunk_size: int = MAX_CHUNK, ack_timeout_s: float = 1.0, retries: int = 5
    ) -> None:
        if not 1 <= chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size {chunk_size}: expected 1..{MAX_CHUNK}")
        self.release = release
        self.chunk_size = chunk_size
        self.ack_timeout_s = ack_timeout_s
        self.retries = retries
        self.state = RelayState.BEGIN
        self.offset = 0
        self.resumed_from = 0
        self.chunks_sent = 0
        self.resends = 0
        self.version = 0
        self.reason = ""
        self._inflight_seq: int | None = None
        self._inflight_type = 0
        self._deadline = 0.0
        self._attempts = 0

    @property
    def finished(self) -> bool:
        return self.state in (RelayState.DONE, RelayState.FAILED)

    def result(self) -> RelayResult:
        return RelayResult(
            self.state is RelayState.DONE, self.reason, self.version, self.resumed_from, self.chunks_sent, self.resends
        )

    def next_message(self) -> Message | None:
        """What to send now, or None while waiting for an answer (or when finished)."""
        if self.finished or self._inflight_seq is not None:
            return None
        if self.state is RelayState.BEGIN:
            sig = self.release.signature
            return OtaBegin(self.release.manifest_bytes, sig.key_id, sig.signature)
        if self.state is RelayState.CHUNKS:
            data = self.release.image[self.offset : self.offset + self.chunk_size]
            return OtaChunk(self.offset, data)
        return OtaEnd()

    def sent(self, msg_type: int, seq: int, now: float) -> None:
        """Record that the message from next_message() went out with ``seq``."""
        self._inflight_seq = seq
        self._inflight_type = msg_type
        self._deadline = now + self.ack_timeout_s
        if msg_type == MsgType.OTA_CHUNK:
            self.chunks_sent += 1

    def on_ack(self, ack: Ack) -> None:
        if self._inflight_seq is None or ack.acked_seq != self._inflight_seq or ack.acked_type != self._inflight_type:
            return  # an answer to something no longer in flight
        self._inflight_seq = None
        self._attempts = 0
        if ack.nack:
            if ack.reason == NackReason.BAD_OFFSET and self.state is RelayState.CHUNKS:
                self._move_to(ack.value)
                return
            self._fail(_reason_name(ack.reason))
            return
        if self.state is RelayState.BEGIN:
            self.resumed_from = ack.value
            self.state = RelayState.CHUNKS
            self._move_to(ack.value)
        elif self.state is RelayState.CHUNKS:
            self._move_to(ack.value)
        elif self.state is RelayState.END:
            self.version = ack.value
            if ack.value == self.release.manifest.version:
                self.state = RelayState.DONE
            else:
                self._fail("not_activated")

    def _move_to(self, offset: int) -> None:
        if offset > self.release.manifest.size:
            self._fail("bad_offset")
            return
        self.offset = offset
        self.state = RelayState.END if offset == self.release.manifest.size else RelayState.CHUNKS

    def poll(self, now: float) -> None:
        """Give up on an unanswered message after its timeout: resend it, or fail after ``retries``."""
        if self._inflight_seq is None or now < self._deadline or self.finished:
            return
        self._inflight_seq = None
        self._attempts += 1
        self.resends += 1
        if self._attempts > self.retries:
            self._fail("timeout")

    def next_deadline(self) -> float | None:
        return None if self._inflight_seq is None else self._deadline

    def _fail(self, reason: str) -> None:
        self.state = RelayState.FAILED
        self.reason = reason


def _reason_name(reason: int) -> str:
    try:
        return NackReason(reason).name.lower()
    except ValueError:
        return f"nack_{reason}"

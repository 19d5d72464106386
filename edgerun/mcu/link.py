"""The host end of one edgelink connection, without I/O (like h11): bytes in, messages and counters out.

``McuLink.receive(data)`` returns the messages that arrived; every frame that did not is counted by
reason (``drops``), and so is every frame the MCU sent that never arrived (a gap in the 16-bit
sequence numbers: ``lost``). ``McuLink.send(msg)`` returns the bytes to write. The same object runs
over a real serial port (``edgerun.mcu.bridge``), a pty to ``edgelink-sim``, and in unit tests.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from edgerun.mcu.protocol import (
    DROP_REASONS,
    Frame,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    MsgType,
    ProtocolError,
    decode_message,
    encode_message,
)


@dataclass
class LinkCounters:
    frames: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    lost: int = 0  # frames the MCU numbered that never arrived (sequence gaps)
    drops: collections.Counter[str] = field(default_factory=collections.Counter)  # dropped frames by reason
    by_type: collections.Counter[str] = field(default_factory=collections.Counter)


class McuLink:
    def __init__(self) -> None:
        self._decoder = FrameDecoder()
        self._next_rx: int | None = None
        self._tx_seq = 0
        self.counters = LinkCounters()
        self.hello: Hello | None = None
        self.heartbeat: Heartbeat | None = None

    def receive(self, data: bytes) -> list[Message]:
        """Messages decoded from ``data``; bad frames and unparseable payloads are counted, never raised."""
        self.counters.bytes_in += len(data)
        out: list[Message] = []
        for item in self._decoder.feed(data):
            if not isinstance(item, Frame):
                self.counters.drops[item] += 1
                continue
            if item.type == MsgType.HELLO and item.seq == 0:
                self._next_rx = None  # an MCU boots with HELLO as frame 0: a new numbering, not a gap
            self._track_seq(item.seq)
            try:
                msg = decode_message(item)
            except ProtocolError as err:
                self.counters.drops[f"payload_{err.code}"] += 1
                continue
            self.counters.frames += 1
            self.counters.by_type[type(msg).__name__.lower()] += 1
            if isinstance(msg, Hello):
                self.hello = msg
            elif isinstance(msg, Heartbeat):
                self.heartbeat = msg
            out.append(msg)
        return out

    def _track_seq(self, seq: int) -> None:
        if self._next_rx is not None:
            self.counters.lost += (seq - self._next_rx) & 0xFFFF
        self._next_rx = (seq + 1) & 0xFFFF

    def send(self, msg: Message) -> tuple[int, bytes]:
        """The sequence number used and the bytes to write."""
        seq = self._tx_seq
        self._tx_seq = (self._tx_seq + 1) & 0xFFFF
        data = encode_message(msg, seq)
        self.counters.bytes_out += len(data)
        return seq, data

    def reset_rx(self) -> None:
        """After a reconnect: the next frame starts a new sequence, and a half frame is discarded."""
        self._decoder = FrameDecoder()
        self._next_rx = None

    def drop_totals(self) -> dict[str, int]:
        return {reason: self.counters.drops.get(reason, 0) for reason in DROP_REASONS} | {
            k: v for k, v in self.counters.drops.items() if k not in DROP_REASONS
        }

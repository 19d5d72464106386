"""SWIM membership with the Lifeguard extensions, as HashiCorp memberlist does it; sans-I/O.

Skeleton: the signatures are the interface in SWARM_INTERFACES.md; bodies follow.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from swarm.config import SwarmTiming

DEFAULT_PACKET_BUDGET = 1400 - 64
MAX_META_BYTES = 512


class MemberState(enum.Enum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass
class Member:
    name: str
    addr: tuple[str, int]
    state: MemberState
    incarnation: int
    meta: bytes
    state_since: float


@dataclass
class MemberEvent:
    kind: str  # "join" | "update" | "suspect" | "alive" | "dead" | "leave" | "refute"
    member: Member


@dataclass
class UserBroadcast:
    payload: bytes
    sender: str


class Membership:
    def __init__(self, name: str, addr: tuple[str, int], timing: SwarmTiming, *, now: float,
                 meta: bytes = b"", rng: random.Random | None = None,
                 packet_budget: int = DEFAULT_PACKET_BUDGET) -> None:
        self.local_name = name
        self.incarnation = 0
        self.health_score = 0
        self.stats: dict = {}

    def join(self, seeds: list[tuple[str, int]], now: float) -> None:
        raise NotImplementedError

    def leave(self, now: float) -> None:
        raise NotImplementedError

    def set_meta(self, meta: bytes, now: float) -> None:
        raise NotImplementedError

    def queue_broadcast(self, key: bytes, payload: bytes) -> None:
        raise NotImplementedError

    def receive_datagram(self, data: bytes, addr: tuple[str, int], now: float) -> None:
        raise NotImplementedError

    def handle_stream(self, data: bytes, addr: tuple[str, int], now: float) -> bytes | None:
        raise NotImplementedError

    def stream_result(self, token: int, reply: bytes | None, now: float) -> None:
        raise NotImplementedError

    def handle_timer(self, now: float) -> None:
        raise NotImplementedError

    def datagrams_to_send(self) -> list[tuple[tuple[str, int], bytes]]:
        raise NotImplementedError

    def streams_to_open(self) -> list[tuple[int, tuple[str, int], bytes]]:
        raise NotImplementedError

    def get_timer(self) -> float | None:
        raise NotImplementedError

    def pop_events(self) -> list[MemberEvent | UserBroadcast]:
        raise NotImplementedError

    def members(self) -> list[Member]:
        raise NotImplementedError

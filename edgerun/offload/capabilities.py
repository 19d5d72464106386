"""What a node advertises for offload, how much it can take, when that is worth gossiping, and who can help us.

The advertisement is five fields of the node's member metadata (``edgerun.fleet.member_meta.MemberMeta``):
``serve_hash`` (16 hex chars of the served model's hash, "" = serves nobody), ``serve_port`` (the offload TCP
port on the member's gossip host), ``spare_fps``, ``infer_ms`` and ``queue``. Every metadata change is a new
incarnation gossiped to the whole swarm, so capacity figures go out at most every ``CAPABILITY_INTERVAL_S``
and only when one moved by more than ``CAPABILITY_CHANGE``; a change of what is served goes out at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from edgerun.fleet.member_meta import MemberMeta, decode_meta
from edgerun.offload.chooser import HelperCandidate
from swarm.membership import Member, MemberState

__all__ = [
    "CAPABILITY_CHANGE",
    "CAPABILITY_INTERVAL_S",
    "capabilities_due",
    "capabilities_moved",
    "candidates_from_members",
    "spare_fps",
]

CAPABILITY_INTERVAL_S = 5.0
CAPABILITY_CHANGE = 0.2
# Below these a change is noise, not news: 0.4 -> 0.6 fps is +50 % but not a frame a second.
_FLOORS = {"spare_fps": 1.0, "infer_ms": 1.0, "queue": 1.0}
MAX_PORT = 65535


def spare_fps(concurrent_calls: int, infer_ms: float, own_fps: float, served_fps: float) -> float:
    """Frames per second this node could still take for others: what its engine can run in parallel at its
    measured time per frame, less its own frames and those it already serves; 0 until a time is measured."""
    if concurrent_calls <= 0 or not math.isfinite(infer_ms) or infer_ms <= 0.0:
        return 0.0
    capacity = concurrent_calls * 1000.0 / infer_ms
    return round(max(0.0, capacity - own_fps - served_fps), 1)


def capabilities_moved(meta: MemberMeta, last: MemberMeta, change: float = CAPABILITY_CHANGE) -> bool:
    """Whether what ``meta`` advertises differs from ``last`` enough to tell the swarm: a new serve_hash or
    port, or spare_fps, infer_ms or queue moved by more than ``change`` of the last value."""
    if (meta.serve_hash, meta.serve_port) != (last.serve_hash, last.serve_port):
        return True
    for name, floor in _FLOORS.items():
        old, new = float(getattr(last, name)), float(getattr(meta, name))
        if abs(new - old) > change * max(abs(old), floor):
            return True
    return False


def capabilities_due(
    meta: MemberMeta,
    last: MemberMeta | None,
    last_at: float,
    now: float,
    *,
    interval_s: float = CAPABILITY_INTERVAL_S,
    change: float = CAPABILITY_CHANGE,
) -> bool:
    """Whether this node's metadata goes out again for its capabilities (``last`` published at ``last_at``).

    What is served (hash, port) at once: a neighbour that still sends to a port that closed, or for a model
    that was swapped, loses frames. Capacity figures at most every ``interval_s``: on a busy node they move
    with every frame, and each update costs every member a few packets.
    """
    if last is None:
        return True
    if (meta.serve_hash, meta.serve_port) != (last.serve_hash, last.serve_port):
        return True
    return now - last_at >= interval_s and capabilities_moved(meta, last, change)


def candidates_from_members(
    members: Iterable[Member],
    my_name: str,
    my_model_hash: str,
    rtt_ms: Callable[[str], float | None],
) -> list[HelperCandidate]:
    """The live members other than this node that serve its model (same hash) on an offload port.

    A member's metadata is untrusted bytes: one that does not decode, or advertises a port or figures that
    cannot be (out of range, negative, not finite), is left out; nothing here raises.
    """
    if not my_model_hash:
        return []
    out: list[HelperCandidate] = []
    for member in members:
        if member.name == my_name or member.state is not MemberState.ALIVE:
            continue
        meta = decode_meta(member.meta)
        if meta is None or meta.serve_hash != my_model_hash or not _plausible(meta):
            continue
        out.append(
            HelperCandidate(
                name=member.name,
                addr=(member.addr[0], meta.serve_port),
                spare_fps=float(meta.spare_fps),
                infer_ms=float(meta.infer_ms),
                queue=meta.queue,
                rtt_ms=rtt_ms(member.name),
            )
        )
    return out


def _plausible(meta: MemberMeta) -> bool:
    return (
        0 < meta.serve_port <= MAX_PORT
        and math.isfinite(meta.spare_fps)
        and meta.spare_fps >= 0.0
        and math.isfinite(meta.infer_ms)
        and meta.infer_ms >= 0.0
        and meta.queue >= 0
    )

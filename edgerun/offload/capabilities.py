"""What a node advertises for offload, how much it can take, when that is worth gossiping, and who can help us.

The advertisement is five fields of the node's member metadata (``edgerun.fleet.member_meta.MemberMeta``):
``serve_hash`` (16 hex chars of the served model's hash, "" = serves nobody), ``serve_port`` (the offload TCP
port on the member's gossip host), ``spare_fps``, ``infer_ms`` and ``queue``. What is served (hash, port) is an
urgent update, broadcast at once; capacity is a quiet one (spread by push-pull, minutes old where it arrives),
advertised in coarse steps (``quantised_capacity``) and sent at most every ``CAPABILITY_INTERVAL_S``. What a
helper's load is right now reaches the origin with every reply; the metadata's capacity is the hint for
picking a first helper.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from edgerun.fleet.member_meta import MemberMeta, MetaUpdate, decode_meta
from edgerun.offload.chooser import HelperCandidate
from swarm.membership import Member, MemberState

__all__ = [
    "CAPABILITY_INTERVAL_S",
    "LocalEngineRate",
    "capabilities_due",
    "candidates_from_members",
    "quantised_capacity",
    "spare_fps",
]

# A quiet update (what capacity is) at most this often: it reaches every member by push-pull in minutes anyway.
CAPABILITY_INTERVAL_S = 30.0
# Capacity in coarse steps (about x1.5 apart), so a figure wandering with every frame is no news. Each rounds
# to the side that promises less: spare_fps down, infer_ms and queue up.
SPARE_FPS_STEPS = (0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 50.0, 80.0, 120.0, 200.0, 300.0, 500.0)
INFER_MS_STEPS = (1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 50.0, 80.0, 120.0, 200.0, 300.0, 500.0, 800.0, 1000.0)
QUEUE_STEPS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_PORT = 65535


def spare_fps(concurrent_calls: int, infer_ms: float, own_fps: float, served_fps: float) -> float:
    """Frames per second this node could still take for others: what its engine can run in parallel at its
    measured time per frame, less its own frames and those it already serves; 0 until a time is measured."""
    if concurrent_calls <= 0 or not math.isfinite(infer_ms) or infer_ms <= 0.0:
        return 0.0
    capacity = concurrent_calls * 1000.0 / infer_ms
    return round(max(0.0, capacity - own_fps - served_fps), 1)


def _step_down(value: float, steps: tuple[float, ...]) -> float:
    if not math.isfinite(value) or value <= steps[0]:
        return steps[0]
    return steps[bisect.bisect_right(steps, value) - 1]


def _step_up(value: float, steps: tuple[float, ...]) -> float:
    if not math.isfinite(value) or value <= 0.0:
        return value  # not measured (0) stays 0; nonsense is the reader's to refuse
    i = bisect.bisect_left(steps, value)
    return steps[i] if i < len(steps) else float(math.ceil(value))


def quantised_capacity(meta: MemberMeta) -> MemberMeta:
    """``meta`` with spare_fps, infer_ms and queue in the coarse steps a node advertises."""
    queue = _step_up(float(meta.queue), tuple(float(q) for q in QUEUE_STEPS))
    return msgspec.structs.replace(
        meta,
        spare_fps=_step_down(float(meta.spare_fps), SPARE_FPS_STEPS),
        infer_ms=_step_up(float(meta.infer_ms), INFER_MS_STEPS),
        queue=int(queue) if math.isfinite(queue) else meta.queue,
    )


def capabilities_due(
    meta: MemberMeta,
    last: MemberMeta | None,
    last_at: float,
    now: float,
    *,
    interval_s: float = CAPABILITY_INTERVAL_S,
) -> MetaUpdate:
    """How this node's capabilities go out again (``last`` published at ``last_at``, by either kind).

    What is served (hash, port): urgent, a neighbour that still sends to a port that closed, or for a model
    that was swapped, loses frames. So is the first measured time per frame (or its loss): until then the
    node advertises no spare capacity and no neighbour picks it, which would otherwise last a quiet update's
    minutes after every start. Capacity: quiet, and only when a step changed and ``interval_s`` passed; on a
    busy node the figures move with every frame.
    """
    if last is None or (meta.serve_hash, meta.serve_port) != (last.serve_hash, last.serve_port):
        return MetaUpdate.URGENT
    if (meta.infer_ms > 0.0) != (last.infer_ms > 0.0):
        return MetaUpdate.URGENT
    if now - last_at < interval_s:
        return MetaUpdate.NONE
    new, old = quantised_capacity(meta), quantised_capacity(last)
    if (new.spare_fps, new.infer_ms, new.queue) != (old.spare_fps, old.infer_ms, old.queue):
        return MetaUpdate.QUIET
    return MetaUpdate.NONE


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


class LocalEngineRate:
    """What the local engine can do and how fast the source delivers, from the pipeline's counters.

    ``update`` once a second: the engine's time per frame (its busy time over the frames it served, smoothed)
    and the source's frame rate (frames captured, stale frames skipped included). Frames a helper served
    are not in the engine's figures, so offloading does not change the measure that decides it.
    """

    SMOOTHING = 0.5

    def __init__(self) -> None:
        self.infer_ms = 0.0
        self.source_fps = 0.0
        self._last: tuple[float, int, float, int] | None = None

    def update(self, stats: Any, now: float) -> LocalEngineRate:
        stage = stats.stages["infer"]
        with stats.lock:
            frames, busy = stage.frames, stage.busy_s
        captured = stats.captured
        if self._last is not None:
            t0, frames0, busy0, captured0 = self._last
            if frames > frames0:
                ms = (busy - busy0) / (frames - frames0) * 1000.0
                self.infer_ms = (
                    ms if self.infer_ms == 0.0 else self.SMOOTHING * self.infer_ms + (1 - self.SMOOTHING) * ms
                )
            if now > t0:
                self.source_fps = (captured - captured0) / (now - t0)
        self._last = (now, frames, busy, captured)
        return self

    def capacity_fps(self, calls: int) -> float:
        """Frames per second the local engine can serve with ``calls`` at once; 0 until measured."""
        return calls * 1000.0 / self.infer_ms if self.infer_ms > 0 else 0.0

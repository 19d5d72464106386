"""What a node tells its swarm about itself: model, engine, health and where its camera is.

Gossiped as each member's metadata (memberlist caps it at 512 bytes), so the ground station
and every neighbour see the fleet without a broker. A member whose metadata does not decode is
shown without it, never dropped.

Every push-pull exchange carries every member's metadata both ways, so its size is paid N times
per exchange: at 20 drones it was most of what push-pull cost (docs/swarm.md, quiet updates). So
version 2 goes on the wire as a msgpack *array* in field order (no keys) with the numbers as
integers in the units the node rounds them to (fps, angles and capacity in tenths, positions in
centimetres), trailing defaults left out: about 45 % of version 1's map with named keys. Version 1
maps from older nodes still decode.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import msgspec

META_VERSION = 2
MAX_META_BYTES = 512


class MemberMeta(msgspec.Struct, array_like=False, omit_defaults=True, forbid_unknown_fields=False):
    """One node's metadata. Positions in the swarm's local east/north/up frame (metres)."""

    v: int = META_VERSION
    model: str = ""
    version: int = 0
    engine: str = ""
    fallback: bool = False  # serving on the CPU last resort behind a failed accelerator
    health: str = ""
    fps: float = 0.0
    east: float | None = None
    north: float | None = None
    up: float | None = None
    yaw: float | None = None
    hfov: float | None = None
    # What this node serves for others (edgerun.offload.capabilities). Short keys on the wire: every member's
    # metadata rides in every push-pull, so each byte here is paid N times per exchange.
    serve_hash: str = msgspec.field(default="", name="sh")  # 16 hex chars of the served model's hash; "" none
    serve_port: int = msgspec.field(default=0, name="sp")  # offload TCP port on the member's gossip host
    spare_fps: float = msgspec.field(default=0.0, name="sf")
    infer_ms: float = msgspec.field(default=0.0, name="im")  # the engine's time per frame
    queue: int = msgspec.field(default=0, name="q")  # offload requests waiting

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__}


class MetaUpdate(Enum):
    """How a metadata change goes out (swarm.membership.Membership.set_meta)."""

    NONE = "none"  # not worth an update
    QUIET = "quiet"  # a new incarnation spread by push-pull only: may be minutes old where it arrives
    URGENT = "urgent"  # broadcast on the gossip: every member within seconds


class _WireMeta(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=False):
    """Version 2 on the wire: ``MemberMeta`` as an array, numbers as integers in the units noted."""

    v: int = META_VERSION
    model: str = ""
    version: int = 0
    engine: str = ""
    fallback: bool = False
    health: str = ""
    fps: int = 0  # tenths
    east: int | None = None  # centimetres
    north: int | None = None
    up: int | None = None
    yaw: int | None = None  # tenths of a degree
    hfov: int | None = None
    serve_hash: str = ""
    serve_port: int = 0
    spare_fps: int = 0  # tenths
    infer_ms: int = 0  # tenths
    queue: int = 0


def _scaled(value: float | None, scale: float) -> int | None:
    return None if value is None or not math.isfinite(value) else int(round(value * scale))


def _unscaled(value: int | None, scale: float) -> float | None:
    return None if value is None else value / scale


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_WireMeta)
_decoder_v1 = msgspec.msgpack.Decoder(MemberMeta)  # maps with named keys, from nodes before version 2


def encode_meta(meta: MemberMeta) -> bytes:
    # Strings are the only unbounded fields: cut them rather than lose the whole record.
    wire = _WireMeta(
        model=meta.model[:64],
        version=meta.version,
        engine=meta.engine[:32],
        fallback=meta.fallback,
        health=meta.health[:32],
        fps=_scaled(meta.fps, 10) or 0,
        east=_scaled(meta.east, 100),
        north=_scaled(meta.north, 100),
        up=_scaled(meta.up, 100),
        yaw=_scaled(meta.yaw, 10),
        hfov=_scaled(meta.hfov, 10),
        serve_hash=meta.serve_hash[:16],
        serve_port=meta.serve_port,
        spare_fps=_scaled(meta.spare_fps, 10) or 0,
        infer_ms=_scaled(meta.infer_ms, 10) or 0,
        queue=meta.queue,
    )
    return _encoder.encode(wire)


def decode_meta(data: bytes) -> MemberMeta | None:
    """The metadata a peer gossiped, or None when it is empty or not ours (a peer's bytes are untrusted)."""
    if not data or len(data) > MAX_META_BYTES:
        return None
    try:
        if data[0] & 0xF0 == 0x80 or data[0] in (0xDE, 0xDF):  # a msgpack map: version 1
            return _decoder_v1.decode(data)
        wire = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return MemberMeta(
        v=wire.v,
        model=wire.model,
        version=wire.version,
        engine=wire.engine,
        fallback=wire.fallback,
        health=wire.health,
        fps=wire.fps / 10,
        east=_unscaled(wire.east, 100),
        north=_unscaled(wire.north, 100),
        up=_unscaled(wire.up, 100),
        yaw=_unscaled(wire.yaw, 10),
        hfov=_unscaled(wire.hfov, 10),
        serve_hash=wire.serve_hash,
        serve_port=wire.serve_port,
        spare_fps=wire.spare_fps / 10,
        infer_ms=wire.infer_ms / 10,
        queue=wire.queue,
    )

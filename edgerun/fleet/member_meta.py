"""What a node tells its swarm about itself: model, engine, health and where its camera is.

Gossiped as each member's metadata (memberlist caps it at 512 bytes), so the ground station
and every neighbour see the fleet without a broker. Encoded as msgpack with short field names;
a member whose metadata does not decode is shown without it, never dropped.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import msgspec

META_VERSION = 1
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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MemberMeta)


def encode_meta(meta: MemberMeta) -> bytes:
    data = _encoder.encode(meta)
    if len(data) > MAX_META_BYTES:
        # Strings are the only unbounded fields: cut them rather than lose the whole record.
        meta = msgspec.structs.replace(
            meta,
            model=meta.model[:64],
            engine=meta.engine[:32],
            health=meta.health[:32],
            serve_hash=meta.serve_hash[:16],
        )
        data = _encoder.encode(meta)
    return data


def decode_meta(data: bytes) -> MemberMeta | None:
    """The metadata a peer gossiped, or None when it is empty or not ours (a peer's bytes are untrusted)."""
    if not data or len(data) > MAX_META_BYTES:
        return None
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None

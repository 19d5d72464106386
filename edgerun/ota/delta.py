"""Binary deltas between two payloads: bsdiff4, and zstd's patch-from (the old payload as a raw dictionary).

bsdiff finds moved and slightly changed blocks (good for executables and
for models whose weights moved); zstd patch-from is an LZ match against the
old bytes (fast, good when whole tensors are unchanged). ``make_best`` builds
both and keeps the smaller. Neither helps much when every weight changed a
little: a dense fine-tune changes nearly every byte, and the caller is told
when the full payload is smaller.

Applying is capped: the output may not exceed the signed target size, so a
hostile patch cannot make the node allocate without bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from edgerun.ota.errors import Rejected

ZSTD_LEVEL = 19
BSDIFF_MAGIC = b"BSDIFF40"


def _zstd_window_log(old_size: int, new_size: int) -> int:
    # The window must reach back over the whole dictionary (the old payload) from the end of the new one.
    return max(10, min(31, (old_size + new_size).bit_length()))


def make_delta(old: bytes, new: bytes, algorithm: str) -> bytes:
    if algorithm == "bsdiff4":
        import bsdiff4

        return bsdiff4.diff(old, new)
    if algorithm == "zstd":
        import zstandard

        dictionary = zstandard.ZstdCompressionDict(old, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        params = zstandard.ZstdCompressionParameters.from_level(
            ZSTD_LEVEL, source_size=len(new), window_log=_zstd_window_log(len(old), len(new)), enable_ldm=True
        )
        return zstandard.ZstdCompressor(dict_data=dictionary, compression_params=params).compress(new)
    raise ValueError(f"unknown delta algorithm {algorithm!r}")


def _bsdiff_new_size(patch: bytes) -> int:
    """The output size a BSDIFF40 header declares (bytes 24..32, sign-magnitude little endian)."""
    if len(patch) < 32 or patch[:8] != BSDIFF_MAGIC:
        raise Rejected("bad_delta", "delta: not a BSDIFF40 patch")
    raw = int.from_bytes(patch[24:32], "little")
    size = raw & ~(1 << 63)
    return -size if raw >> 63 else size


def apply_delta(old: bytes, patch: bytes, algorithm: str, target_size: int) -> bytes:
    """The new payload, never larger than ``target_size``; Rejected('bad_delta') on a malformed patch."""
    if algorithm == "bsdiff4":
        import bsdiff4

        declared = _bsdiff_new_size(patch)
        if declared != target_size:
            raise Rejected("bad_delta", f"delta: declares {declared} bytes of output, the manifest {target_size}")
        try:
            return bsdiff4.patch(old, patch)
        except Exception as err:  # bsdiff4 raises ValueError or a bare Exception on corrupt input
            raise Rejected("bad_delta", f"delta: bsdiff4 patch failed ({err})") from None
    if algorithm == "zstd":
        import zstandard

        try:
            declared = zstandard.frame_content_size(patch)
        except zstandard.ZstdError:
            raise Rejected("bad_delta", "delta: not a zstd frame") from None
        if declared not in (-1, target_size):
            raise Rejected("bad_delta", f"delta: declares {declared} bytes of output, the manifest {target_size}")
        dictionary = zstandard.ZstdCompressionDict(old, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        window = 1 << _zstd_window_log(len(old), target_size)
        try:
            out = zstandard.ZstdDecompressor(dict_data=dictionary, max_window_size=window).decompress(
                patch, max_output_size=target_size
            )
        except zstandard.ZstdError as err:
            raise Rejected("bad_delta", f"delta: zstd patch failed ({err})") from None
        if len(out) != target_size:
            raise Rejected("bad_delta", f"delta: produced {len(out)} bytes, the manifest says {target_size}")
        return out
    raise Rejected("bad_delta", f"delta: unknown algorithm {algorithm!r}")


@dataclass(frozen=True)
class DeltaChoice:
    algorithm: str  # "bsdiff4", "zstd", or "full" when no delta beats the full payload
    patch: bytes
    sizes: dict[str, int]  # algorithm -> bytes, plus "full"
    seconds: dict[str, float]  # time to make each delta

    @property
    def full_is_smaller(self) -> bool:
        return self.algorithm == "full"


def make_best(old: bytes, new: bytes, algorithms: tuple[str, ...] = ("bsdiff4", "zstd")) -> DeltaChoice:
    """Build each delta kind and keep the smallest; ``algorithm == "full"`` when none is smaller than ``new``."""
    patches: dict[str, bytes] = {}
    seconds: dict[str, float] = {}
    for algorithm in algorithms:
        t0 = time.perf_counter()
        patches[algorithm] = make_delta(old, new, algorithm)
        seconds[algorithm] = time.perf_counter() - t0
    sizes = {name: len(p) for name, p in patches.items()}
    sizes["full"] = len(new)
    best = min(patches, key=lambda name: len(patches[name]))
    if len(patches[best]) >= len(new):
        return DeltaChoice("full", b"", sizes, seconds)
    return DeltaChoice(best, patches[best], sizes, seconds)

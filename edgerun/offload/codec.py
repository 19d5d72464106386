"""The model-size BGR uint8 image of an offloaded frame <-> bytes: ``jpeg`` (OpenCV, quality 90) or ``zstd``.

``jpeg`` is lossy and 5-10x smaller than ``zstd``; ``zstd`` (the raw pixels, level 1) is exact, so a helper
finds what the origin's own engine would. ``edgerun bench --offload-codec`` measures both (docs/offload.md).

Decoding takes untrusted bytes and the size the request declares: nothing larger than that size is ever
allocated (the JPEG header is read before the image is decoded, zstd stops at the declared size), and the
result must be exactly height x width x 3, or ``CodecError`` says what is wrong.
"""

from __future__ import annotations

import threading

import cv2
import numpy as np
import zstandard

from edgerun.offload.protocol import CODECS, MAX_IMAGE_SIDE

JPEG_QUALITY = 90
ZSTD_LEVEL = 1  # the fastest level; higher ones save a few % on camera pixels at several times the CPU


class CodecError(ValueError):
    """Bytes that are not a picture of the declared size in the named codec; ``reason`` to count by."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# zstandard's compressor and decompressor objects are not safe to share between threads; each infer worker
# (origin) and serving thread (helper) keeps its own.
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    comp = getattr(_local, "compressor", None)
    if comp is None:
        comp = _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def encode(image_u8: np.ndarray, codec: str) -> bytes:
    """``image_u8`` (H, W, 3 uint8, BGR) as bytes in ``codec``."""
    if image_u8.dtype != np.uint8 or image_u8.ndim != 3 or image_u8.shape[2] != 3:
        raise ValueError(f"expected an H x W x 3 uint8 image, got {image_u8.shape} {image_u8.dtype}")
    if codec == "jpeg":
        ok, buffer = cv2.imencode(".jpg", image_u8, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        if not ok:
            raise ValueError("OpenCV could not encode the image as JPEG")
        return buffer.tobytes()
    if codec == "zstd":
        return _compressor().compress(np.ascontiguousarray(image_u8).data)
    raise ValueError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")


def decode(data: bytes, codec: str, height: int, width: int) -> np.ndarray:
    """The H x W x 3 uint8 BGR image ``data`` holds; raises CodecError (never allocates more than H x W x 3)."""
    if not (1 <= height <= MAX_IMAGE_SIDE and 1 <= width <= MAX_IMAGE_SIDE):
        raise CodecError(f"image size {width}x{height} is outside 1..{MAX_IMAGE_SIDE}", "size")
    size = height * width * 3
    if codec == "zstd":
        try:
            # decompress() allocates what a frame header declares and reads max_output_size only when the
            # header declares nothing: the declared size is checked first.
            content_size = zstandard.frame_content_size(data)
            if content_size not in (-1, size):
                raise CodecError(f"zstd frame of {content_size} bytes, {width}x{height}x3 is {size}", "size")
            raw = _decompressor().decompress(data, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CodecError(f"not zstd data of at most {size} bytes: {exc}", "image") from None
        if len(raw) != size:
            raise CodecError(f"zstd data holds {len(raw)} bytes, {width}x{height}x3 is {size}", "size")
        return np.frombuffer(raw, np.uint8).reshape(height, width, 3)
    if codec == "jpeg":
        declared = jpeg_size(data)
        if declared != (height, width):
            raise CodecError(f"JPEG of {declared[1]}x{declared[0]}, the request says {width}x{height}", "size")
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if image is None or image.shape != (height, width, 3):
            raise CodecError("OpenCV could not decode the JPEG", "image")
        return image
    raise CodecError(f"unknown codec {codec[:16]!r}", "codec")


# Start-of-frame markers that carry the image size: SOF0..SOF15 but DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM carry no length


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a JPEG's start-of-frame header, before anything is decoded; raises CodecError."""
    if data[:2] != b"\xff\xd8":
        raise CodecError("not a JPEG (no start-of-image marker)", "image")
    i, end = 2, len(data)
    while i + 4 <= end:
        if data[i] != 0xFF:
            raise CodecError(f"JPEG marker expected at byte {i}", "image")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            break
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            raise CodecError(f"JPEG segment of length {length} at byte {i}", "image")
        if marker in _SOF_MARKERS:
            if i + 9 > end:
                break
            return int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
        i += 2 + length
    raise CodecError("JPEG has no frame header", "image")

"""``edgerun bench --offload-codec``: what an offloaded frame costs on the link and in CPU, per codec and model.

For each demo model's input size (BlazeFace 128 x 128, the pose detector 224 x 224) and three scikit-image
photos letterboxed as the node's Preprocessor does: the bytes of the payload and of the whole sealed frame on
the wire (msgpack request + keyring envelope + length prefix), the 1500-MTU TCP segments it takes, and the
encode + decode time (median of ``repeats``) for

* ``jpeg``: the letterboxed BGR uint8 image, OpenCV quality 90 (lossy);
* ``zstd``: the same image raw, zstandard level 1 (exact);
* ``zstd_f32``: the model's float32 input tensor, zstandard level 1 (what sending the preprocessed tensor
  would cost; not a wire codec).

It also runs the model on the JPEG-decoded image and says how far its detections moved from those of the exact
image, so the choice of codec shows its cost in accuracy beside its bytes; and ``hop_loopback`` times whole
round trips through OffloadClient and OffloadServer on 127.0.0.1 with a helper that finds nothing, so the
hop's own cost (encode, seal, TCP, open, decode, reply) shows without any engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from edgerun.offload import codec
from edgerun.offload.protocol import LENGTH_BYTES, InferRequest, encode_request, seal_frame
from swarm.keyring import KIND_OFFLOAD_REQUEST, Keyring

MODELS = ("blazeface_short", "pose_detector")
PHOTOS = ("astronaut", "coffee", "chelsea")
CODECS = ("jpeg", "zstd", "zstd_f32")
TCP_PAYLOAD = 1448  # a 1500-byte MTU less IPv4, TCP and its timestamp option


def _photo(name: str) -> np.ndarray:
    from skimage import data

    rgb = getattr(data, name)()
    return np.ascontiguousarray(rgb[:, :, ::-1])  # BGR, as frames are


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return round(statistics.median(times), 4)


def _frame_bytes(keyring: Keyring, data: bytes, height: int, width: int) -> int:
    request = InferRequest(0, "0" * 16, "zstd", height, width, 100, "", data)
    return len(seal_frame(keyring, "node-0001", encode_request(request), time.time(), KIND_OFFLOAD_REQUEST))


def bench_model(model: str, repeats: int) -> list[dict[str, Any]]:
    from edgerun.bench.pipeline import resolve_bundle
    from edgerun.engines.base import EngineOptions, engine_class
    from edgerun.engines.factory import build_runtime

    bundle = resolve_bundle(model)
    path = bundle.variant_path("tflite")
    assert path is not None  # both demo bundles are TFLite
    engine = engine_class("tflite")(path, EngineOptions(num_threads=1))
    keyring = Keyring([bytes(32)])
    rows: list[dict[str, Any]] = []
    try:
        height, width = engine.input_spec.image_hw
        helper = build_runtime(bundle, engine, (width, height))  # serves model-size frames, as a helper does
        tensor = engine.allocate_input()

        def detect(image: np.ndarray) -> Any:
            helper.preprocessor(image, tensor)
            return helper.decoder.decode(engine.infer(tensor))

        for photo_name in PHOTOS:
            photo = _photo(photo_name)
            origin = build_runtime(bundle, engine, (photo.shape[1], photo.shape[0]))
            image = origin.preprocessor.letterboxed(photo).copy()
            origin.preprocessor(photo, tensor)
            floats = np.ascontiguousarray(tensor, np.float32)
            exact = detect(image)
            for name in CODECS:
                data, encode_ms, decode_ms = _encode_decode(name, image, floats, repeats)
                shift = None
                if name != "zstd_f32":
                    shift = _box_shift(exact, detect(codec.decode(data, name, height, width)))
                frame = _frame_bytes(keyring, data, height, width)
                rows.append(
                    {
                        "model": bundle.name,
                        "input": f"{width}x{height}",
                        "photo": photo_name,
                        "codec": name,
                        "raw_bytes": floats.nbytes if name == "zstd_f32" else image.nbytes,
                        "bytes": len(data),
                        "frame_bytes": frame,
                        "tcp_segments": math.ceil((frame + LENGTH_BYTES) / TCP_PAYLOAD),
                        "encode_ms": encode_ms,
                        "decode_ms": decode_ms,
                        "encode_decode_ms": round(encode_ms + decode_ms, 4),
                        "detections": None if shift is None else shift["detections"],
                        "detections_exact": len(exact),
                        "max_box_shift": None if shift is None else shift["max_box_shift"],
                    }
                )
    finally:
        engine.close()
    return rows


def _encode_decode(name: str, image: np.ndarray, floats: np.ndarray, repeats: int) -> tuple[bytes, float, float]:
    """(payload, encode ms, decode ms) of ``image`` in a wire codec, or of the float tensor for "zstd_f32"."""
    height, width = image.shape[:2]
    if name == "zstd_f32":
        comp = zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL)
        dec = zstandard.ZstdDecompressor()
        data = comp.compress(floats.data)
        encode_ms = _median_ms(lambda: comp.compress(floats.data), repeats)
        decode_ms = _median_ms(lambda: np.frombuffer(dec.decompress(data), np.float32).reshape(floats.shape), repeats)
        return data, encode_ms, decode_ms
    data = codec.encode(image, name)
    encode_ms = _median_ms(lambda: codec.encode(image, name), repeats)
    decode_ms = _median_ms(lambda: codec.decode(data, name, height, width), repeats)
    return data, encode_ms, decode_ms


def _box_shift(exact: Any, got: Any) -> dict[str, Any]:
    """How far the detections of a decoded image moved from those of the exact one (normalised units)."""
    shift = None
    if len(exact) and len(exact) == len(got):
        # Pair each exact box with its nearest decoded box by centre.
        centres = (exact.boxes[:, :2] + exact.boxes[:, 2:]) / 2
        other = (got.boxes[:, :2] + got.boxes[:, 2:]) / 2
        nearest = np.argmin(((centres[:, None, :] - other[None, :, :]) ** 2).sum(-1), axis=1)
        shift = round(float(np.abs(exact.boxes - got.boxes[nearest]).max()), 5)
    elif not len(exact) and not len(got):
        shift = 0.0
    return {"detections": len(got), "max_box_shift": shift}


def bench_hop_loopback(side: int, frames: int) -> dict[str, Any]:
    """Median and p90 round trip (ms) of ``frames`` sequential requests per codec, astronaut at ``side`` px."""
    import cv2

    from edgerun.offload.client import OffloadClient
    from edgerun.offload.server import OffloadServer, ServeResult
    from edgerun.testing.ports import LOOPBACK, free_port
    from edgerun.types import Detections

    image = np.ascontiguousarray(cv2.resize(_photo("astronaut"), (side, side), interpolation=cv2.INTER_AREA))

    def serve(model: str, frame: np.ndarray, traceparent: str, origin: str) -> ServeResult:
        return ServeResult(Detections.empty())

    async def main() -> dict[str, Any]:
        key = bytes(32)
        server = OffloadServer(Keyring([key]), "helper", serve)
        addr = await server.start((LOOPBACK, free_port()))
        client = OffloadClient(Keyring([key]), "origin")
        result: dict[str, Any] = {"input": f"{side}x{side}", "frames": frames}
        try:
            for name in ("jpeg", "zstd"):
                times = []
                for _ in range(frames):
                    start = time.perf_counter()
                    data = codec.encode(image, name)
                    request = InferRequest(0, "0" * 16, name, side, side, 0, "", data)
                    await client.infer(addr, request, time.monotonic() + 5.0)
                    times.append((time.perf_counter() - start) * 1000.0)
                times.sort()
                result[f"{name}_ms_p50"] = round(statistics.median(times), 3)
                result[f"{name}_ms_p90"] = round(times[int(0.9 * (len(times) - 1))], 3)
        finally:
            await client.close()
            await server.close()
        return result

    return asyncio.run(main())


def run_offload_codec_bench(repeats: int = 50) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for model in MODELS:
        rows += bench_model(model, repeats)
    summary: dict[str, dict[str, Any]] = {}
    for model in MODELS:
        for name in CODECS:
            mine = [r for r in rows if r["model"] == model and r["codec"] == name]
            if not mine:
                continue
            summary[f"{model}/{name}"] = {
                "input": mine[0]["input"],
                "bytes_median": int(statistics.median(r["bytes"] for r in mine)),
                "frame_bytes_median": int(statistics.median(r["frame_bytes"] for r in mine)),
                "tcp_segments_max": max(r["tcp_segments"] for r in mine),
                "encode_decode_ms_median": round(statistics.median(r["encode_decode_ms"] for r in mine), 4),
            }
    return {
        "bench": "offload_codec",
        "repeats": repeats,
        "cores": os.cpu_count(),
        "jpeg_quality": codec.JPEG_QUALITY,
        "zstd_level": codec.ZSTD_LEVEL,
        "photos": list(PHOTOS),
        "summary": summary,
        "hop_loopback": [bench_hop_loopback(side, 4 * repeats) for side in (128, 224)],
        "rows": rows,
    }


def format_offload_codec_table(result: dict[str, Any]) -> str:
    lines = [f"{'model/codec':<30} {'input':>8} {'bytes':>8} {'frame':>8} {'segs':>5} {'enc+dec ms':>11}"]
    for key, row in result["summary"].items():
        lines.append(
            f"{key:<30} {row['input']:>8} {row['bytes_median']:>8} {row['frame_bytes_median']:>8} "
            f"{row['tcp_segments_max']:>5} {row['encode_decode_ms_median']:>11}"
        )
    for hop in result["hop_loopback"]:
        lines.append(
            f"loopback round trip {hop['input']}: jpeg {hop['jpeg_ms_p50']} ms (p90 {hop['jpeg_ms_p90']}), "
            f"zstd {hop['zstd_ms_p50']} ms (p90 {hop['zstd_ms_p90']})"
        )
    return "\n".join(lines)


def run_offload_codec_bench_command(args: argparse.Namespace) -> int:
    from edgerun.bench.pipeline import emit_result

    repeats = 50 if args.seconds >= 2.0 else 5  # a short --seconds is the CI smoke run
    result = run_offload_codec_bench(repeats)
    emit_result(result, args, summary=format_offload_codec_table(result))
    return 0

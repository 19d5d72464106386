"""The cost and size of the picture of each find: crop (decode thread) and JPEG encode (executor) per find.

Every true face of a seeded replay flight is treated as a find with the node's default
``[swarm.images]`` settings: cropped out of its frame (``FindCropper``) and encoded
(``encode_jpeg``); a full-frame box (the largest crop, 320 px) is encoded too. Times are
per find, in microseconds, on this machine's CPU.

    python -m edgerun.bench.find_images --frames 200 --json find-images.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from edgerun.config import ReplayConfig, SwarmImagesConfig
from edgerun.fleet.find_images import FindCropper, encode_jpeg
from edgerun.sources.replay import ReplaySource
from edgerun.types import DetectionBatch, Detections


def _batch(meta: Any, boxes: np.ndarray) -> DetectionBatch:
    n = len(boxes)
    det = Detections(boxes.astype(np.float32), np.full(n, 0.8, np.float32), np.zeros(n, np.int32))
    return DetectionBatch("bench", meta, det, ("face",), "bench", 1, "bench")


def _pct(values: list[float], p: float) -> float:
    return round(float(np.percentile(values, p)), 1) if values else 0.0


def run(frames: int = 200, seed: int = 1) -> dict[str, Any]:
    cfg = SwarmImagesConfig()
    source = ReplaySource(ReplayConfig(seed=seed))
    source.open()
    image = np.zeros((source.height, source.width, 3), np.uint8)
    cropper = FindCropper(cfg)
    crop_us: list[float] = []
    encode_us: list[float] = []
    sizes: list[int] = []
    sides: list[int] = []
    meta = None
    for seq in range(frames):
        meta = source.read(image, seq)
        if meta is None or meta.truth_boxes is None or not len(meta.truth_boxes):
            continue
        t0 = time.perf_counter()
        crops = cropper.crop(image, _batch(meta, meta.truth_boxes)) or {}
        if crops:
            crop_us.append((time.perf_counter() - t0) * 1e6 / len(crops))
        for crop in crops.values():
            assert crop.image is not None
            sides.append(max(crop.image.shape[:2]))
            t0 = time.perf_counter()
            jpeg = encode_jpeg(crop.image, cfg.max_bytes)
            encode_us.append((time.perf_counter() - t0) * 1e6)
            sizes.append(len(jpeg) if jpeg is not None else 0)
    full_us: list[float] = []
    full_bytes = 0
    if meta is not None:
        whole = np.array([[0, 0, source.width - 1, source.height - 1]], np.float32)
        big = (FindCropper(cfg).crop(image, _batch(meta, whole)) or {})[0]
        assert big.image is not None
        for _ in range(20):
            t0 = time.perf_counter()
            jpeg = encode_jpeg(big.image, cfg.max_bytes)
            full_us.append((time.perf_counter() - t0) * 1e6)
            full_bytes = len(jpeg or b"")
    return {
        "bench": "find_images",
        "frames": frames,
        "finds": len(encode_us),
        "crop_us_p50": _pct(crop_us, 50),
        "crop_us_p90": _pct(crop_us, 90),
        "encode_us_p50": _pct(encode_us, 50),
        "encode_us_p90": _pct(encode_us, 90),
        "bytes_p50": _pct([float(s) for s in sizes], 50),
        "bytes_max": max(sizes, default=0),
        "max_bytes": cfg.max_bytes,
        "side_px_p50": _pct([float(s) for s in sides], 50),
        "side_px_max": max(sides, default=0),
        "full_320px_encode_us_p50": _pct(full_us, 50),
        "full_320px_bytes": full_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgerun.bench.find_images", description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", dest="json_out", default=None, help="write the result to this file")
    args = parser.parse_args(argv)
    result = run(args.frames, args.seed)
    text = json.dumps(result, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as out:
            out.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Ground error of projected detections: BlazeFace over the replay flight, scored against the scene's truth.

The node runs the demo model over a seeded replay (offline: every frame, as
fast as the CPU goes); each face box is projected onto the ground through its
bottom centre from the frame's pose (``swarm.geo``) and compared with the
nearest true face's ground position: the bottom centre of its box on the
ground (the scene's ``boxes_m``), which is where the projection aims. Reported:
median and p90 error in metres over detections that match a true face in the
image (IoU >= 0.5), the same for every face detection, the error of projecting
the true pixel boxes themselves (the geometry alone), and how often the error
is within one and two of the projection's own sigma.

    python -m edgerun.bench.geo --frames 600 --json geo.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.config import Config, parse_config
from edgerun.fleet.service import camera_pose
from edgerun.node import Node
from edgerun.sources.replay import build_scene
from edgerun.testing.scoring import MATCH_IOU, iou_matrix
from edgerun.types import DetectionBatch
from swarm.geo import project_boxes


class GroundErrorMeter:
    """Observer of DetectionBatches: projected face positions against the scene's true face positions."""

    def __init__(self, truth_ground: np.ndarray, label: str = "face") -> None:
        self.truth = truth_ground  # (M, 2) east, north of each true face's ground point
        self.label = label
        self.matched: list[float] = []  # error of detections matching a true face box in the image
        self.matched_sigma: list[float] = []
        self.all: list[float] = []  # error of every face detection (false ones too) to the nearest true face
        self.geometry: list[float] = []  # error of the true pixel boxes projected the same way
        self.no_ground = 0
        self.frames = 0

    def _nearest(self, points: np.ndarray) -> np.ndarray:
        if self.truth.shape[0] == 0:
            return np.full(points.shape[0], np.inf)
        d = np.linalg.norm(points[:, None, :] - self.truth[None, :, :], axis=2)
        return d.min(axis=1)

    def __call__(self, batch: DetectionBatch) -> None:
        meta = batch.meta
        if meta.pose is None:
            return
        self.frames += 1
        pose = camera_pose(meta.pose)
        det = batch.detections
        faces = np.flatnonzero([batch.label_of(c) == self.label for c in det.class_ids.tolist()])
        boxes = det.boxes[faces].astype(np.float64)
        fixes = project_boxes(boxes, pose, meta.width, meta.height)
        ok = np.isfinite(fixes[:, 0])
        self.no_ground += int((~ok).sum())
        errors = self._nearest(fixes[:, :2])
        self.all.extend(errors[ok].tolist())
        if meta.truth_boxes is None or not len(meta.truth_labels):
            return
        truth_boxes = meta.truth_boxes[np.asarray(meta.truth_labels) == self.label].astype(np.float64)
        if truth_boxes.shape[0] == 0:
            return
        truth_fix = project_boxes(truth_boxes, pose, meta.width, meta.height)
        self.geometry.extend(self._nearest(truth_fix[:, :2])[np.isfinite(truth_fix[:, 0])].tolist())
        if boxes.shape[0]:
            hit = (iou_matrix(boxes, truth_boxes).max(axis=1) >= MATCH_IOU) & ok
            self.matched.extend(errors[hit].tolist())
            self.matched_sigma.extend(fixes[hit, 2].tolist())

    def summary(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, Any]:
            if not values:
                return {"count": 0, "median_m": None, "p90_m": None}
            arr = np.asarray(values)
            return {
                "count": int(arr.size),
                "median_m": round(float(np.median(arr)), 3),
                "p90_m": round(float(np.percentile(arr, 90)), 3),
            }

        out: dict[str, Any] = {
            "frames": self.frames,
            "matched": stats(self.matched),
            "all_detections": stats(self.all),
            "truth_boxes": stats(self.geometry),
            "no_ground": self.no_ground,
        }
        if self.matched:
            err, sigma = np.asarray(self.matched), np.asarray(self.matched_sigma)
            out["matched"]["median_sigma_m"] = round(float(np.median(sigma)), 3)
            out["matched"]["within_1_sigma"] = round(float(np.mean(err <= sigma)), 3)
            out["matched"]["within_2_sigma"] = round(float(np.mean(err <= 2 * sigma)), 3)
        return out


def truth_ground_points(seed: int, scene: str = "", label: str = "face") -> np.ndarray:
    """(M, 2) east, north of the bottom centre of every ``label`` box on the scene's ground."""
    s = build_scene(seed, scene)
    return s.ground_points[np.asarray(s.labels) == label]


def bench_config(frames: int, seed: int, bundle: str | None) -> Config:
    if not bundle:
        from edgerun.models.demo import ensure_demo_bundle

        bundle = str(ensure_demo_bundle().root)
    return parse_config(
        {
            "node": {"id": "geo-bench"},
            "source": {"kind": "replay", "fps": 0.0, "replay": {"seed": seed, "frames": frames}},
            "model": {"bundle": bundle},
            "pipeline": {"policy": "block"},
            "sinks": {"jsonl": {"enabled": False}},
            "service": {"http_enabled": False},
        }
    )


async def run_geo_bench(frames: int = 600, seed: int = 1, bundle: str | None = None) -> dict[str, Any]:
    cfg = bench_config(frames, seed, bundle)
    meter = GroundErrorMeter(truth_ground_points(seed, cfg.source.replay.scene))
    t0 = time.monotonic()
    node = Node(cfg, observers=[meter])
    await node.run(seconds=None)
    result = meter.summary()
    result.update(
        {
            "bench": "geo",
            "seed": seed,
            "altitude_m": cfg.source.replay.altitude_m,
            "hfov_deg": cfg.source.replay.hfov_deg,
            "model": Path(cfg.model.bundle).name,
            "wall_s": round(time.monotonic() - t0, 2),
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgerun.bench.geo", description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=600, help="replay frames to run (15 per flight second)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default=None, help="bundle directory; default: the demo bundle")
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args(argv)
    result = asyncio.run(run_geo_bench(args.frames, args.seed, args.model))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A camera's footprint on flat ground: the four image corners cast onto the east/north plane."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edgerun.sources.replay import ground_to_image
from edgerun.types import Pose

MAX_RANGE_FACTOR = 20.0  # a corner farther than this many altitudes away is near the horizon: no footprint


def pose_from_payload(pose: Any) -> Pose | None:
    """The ``pose`` object of an ``edgerun.detections/1`` payload, or None when absent or not numbers."""
    if not isinstance(pose, dict):
        return None
    try:
        values = [float(pose[k]) for k in ("east_m", "north_m", "up_m")]
        rest = [
            float(pose.get(k, d))
            for k, d in (("yaw_deg", 0.0), ("pitch_deg", 0.0), ("roll_deg", 0.0), ("hfov_deg", 60.0))
        ]
    except (KeyError, TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in values + rest) or not 1.0 < rest[3] < 170.0:
        return None
    return Pose(*values, *rest)


def footprint(pose: Pose, width: int, height: int) -> list[tuple[float, float]] | None:
    """Ground corners (east, north) of the image, clockwise from top-left; None when a corner misses the ground."""
    if pose.up_m <= 0.0 or width <= 0 or height <= 0:
        return None
    h = ground_to_image(pose, width, height)
    try:
        inv = np.linalg.inv(h)
    except np.linalg.LinAlgError:
        return None
    corners = np.array([[0.0, 0.0, 1.0], [width, 0.0, 1.0], [width, height, 1.0], [0.0, height, 1.0]]).T
    ground = inv @ corners
    if np.any(np.abs(ground[2]) < 1e-12):
        return None
    ground = ground / ground[2]
    depth = h[2] @ ground  # the third row of the homography is the camera-frame depth of a ground point
    if np.any(depth <= 0.0):
        return None
    reach = np.hypot(ground[0] - pose.east_m, ground[1] - pose.north_m)
    if np.any(reach > MAX_RANGE_FACTOR * pose.up_m):
        return None
    return [(round(float(e), 2), round(float(n), 2)) for e, n in zip(ground[0], ground[1])]

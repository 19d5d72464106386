"""Ground position of a detection: a flat-ground projection of its box from the camera pose.

Pose convention (the same as ``edgerun/sources/replay.py``): position is
east/north/up in metres in a local frame whose ground is the plane up = 0;
attitude is the aerospace Z-Y-X Euler angles in degrees (yaw clockwise from
north, pitch nose-up positive, roll right-wing-down positive) of a body whose
camera looks straight down the body's z axis, with image up = the nose and
image right = the right wing. Level flight looks at nadir.

A gimbal, when given, replaces that fixed belly camera. Its angles follow
MAVLink's gimbal device convention in the vehicle frame: roll and pitch are
relative to the horizon (a stabilised gimbal), yaw is relative to the
vehicle's heading, and the camera looks along the gimbal's x axis (all zero:
forward at the horizon; pitch -90: straight down, image up = the heading), so
the body's pitch and roll do not move the view.

The point projected is the bottom centre of the box (where a standing person
meets the ground). Its uncertainty (one sigma, metres, isotropic) grows with
slant range and with how flat the ray meets the ground.

Positions the swarm shares are geodetic (WGS84 latitude/longitude, heights in
metres above mean sea level as MAVLink reports them): every drone agrees on them
whatever its launch point. A ``LocalFrame`` is the east/north/up tangent plane of
one geodetic origin, used only inside the maths (a pose's projection, a track's
filter); ``ground_offset_m`` is the horizontal offset between two nearby points,
the one distance dedup compares claims by.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

if TYPE_CHECKING:
    from pyproj import Transformer

# Camera axes (x right, y down, z along the view) in the belly body (x nose, y right wing, z down).
_CAMERA_TO_BODY = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
# Camera axes in a gimbal frame whose x axis is the view direction (y right, z down).
_CAMERA_TO_GIMBAL = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
_NED_TO_ENU = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, -1.0]])

# The default geographic anchor of the replay scene, the simulator and the HIL scene: a flat field by
# Llyn Padarn near Llanberis, Snowdonia (Wales), ground 100 m above mean sea level. (lat, lon, ground AMSL m)
DEFAULT_ANCHOR: Final = (53.1170, -4.1300, 100.0)

# WGS84 ellipsoid: semi-major axis (m) and first eccentricity squared.
_WGS84_A = 6378137.0
_WGS84_E2 = 6.69437999014e-3


def check_latlon(lat: float, lon: float, what: str = "position") -> None:
    """Raise ValueError unless (lat, lon) are finite degrees within [-90, 90] x [-180, 180]."""
    if not (math.isfinite(lat) and math.isfinite(lon) and -90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0):
        raise ValueError(f"{what}: expected latitude -90..90 and longitude -180..180 degrees, got {lat}, {lon}")


def _radii(lat_deg: float) -> tuple[float, float]:
    """WGS84 meridional and prime-vertical radii of curvature (m) at a latitude."""
    s = math.sin(math.radians(lat_deg))
    w2 = 1.0 - _WGS84_E2 * s * s
    return _WGS84_A * (1.0 - _WGS84_E2) / (w2 * math.sqrt(w2)), _WGS84_A / math.sqrt(w2)


def ground_offset_m(lat0: float, lon0: float, lat: float, lon: float) -> tuple[float, float]:
    """Metres east and north from (lat0, lon0) to (lat, lon), for points a few km apart at most.

    The tangent plane at the pair's mean latitude (WGS84 radii of curvature): under 1e-4 of the distance off
    within 10 km. A closed form on purpose: dedup compares every pair of claims with it, and every node must get
    the same distance from the same claim bytes. Longitudes wrap at the antimeridian.
    """
    meridional, prime = _radii((lat0 + lat) / 2.0)
    dlon = (lon - lon0 + 180.0) % 360.0 - 180.0
    mean = math.radians((lat0 + lat) / 2.0)
    return math.radians(dlon) * prime * math.cos(mean), math.radians(lat - lat0) * meridional


def offset_latlon(lat0: float, lon0: float, east_m: float, north_m: float) -> tuple[float, float]:
    """The inverse of ``ground_offset_m``: the point ``east_m``/``north_m`` from (lat0, lon0) (small offsets)."""
    meridional, prime = _radii(lat0)
    lat = lat0 + math.degrees(north_m / meridional)
    meridional, prime = _radii((lat0 + lat) / 2.0)
    lat = lat0 + math.degrees(north_m / meridional)
    lon = lon0 + math.degrees(east_m / (prime * math.cos(math.radians((lat0 + lat) / 2.0))))
    return lat, (lon + 180.0) % 360.0 - 180.0


Coord = float | np.ndarray  # a coordinate or an array of them; results come back in the same kind


class LocalFrame:
    """The east/north/up tangent plane at one geodetic origin (PROJ's topocentric conversion, WGS84).

    ``alt0_m`` is the origin's height; the frame's up = 0 plane passes through it (a pose's flat ground).
    Heights are metres above mean sea level and are used as ellipsoidal heights here: the geoid's separation
    (tens of metres) moves a horizontal position by centimetres per km, well inside a fix's uncertainty.
    Methods take floats or numpy arrays. Thread-safe (one PROJ transformer per thread).
    """

    def __init__(self, lat0: float, lon0: float, alt0_m: float = 0.0) -> None:
        check_latlon(lat0, lon0, "frame origin")
        if not math.isfinite(alt0_m):
            raise ValueError(f"frame origin: height must be finite, got {alt0_m}")
        self.lat0, self.lon0, self.alt0_m = float(lat0), float(lon0), float(alt0_m)
        self._pipeline = (
            "+proj=pipeline +step +proj=unitconvert +xy_in=deg +xy_out=rad +step +proj=cart +ellps=WGS84 "
            f"+step +proj=topocentric +ellps=WGS84 +lat_0={self.lat0!r} +lon_0={self.lon0!r} +h_0={self.alt0_m!r}"
        )
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"LocalFrame({self.lat0}, {self.lon0}, {self.alt0_m})"

    def _transformer(self) -> Transformer:
        t: Transformer | None = getattr(self._local, "t", None)
        if t is None:
            from pyproj import Transformer  # imported on first use: 0.2 s that a node without a swarm never pays

            t = self._local.t = Transformer.from_pipeline(self._pipeline)
        return t

    def to_geodetic(self, east: Coord, north: Coord, up: Coord = 0.0) -> tuple[Any, Any, Any]:
        """Local east/north/up metres -> (lat, lon, alt_m)."""
        lon, lat, alt = self._transformer().transform(east, north, up, direction="INVERSE")
        return lat, lon, alt

    def from_geodetic(self, lat: Coord, lon: Coord, alt_m: Coord) -> tuple[Any, Any, Any]:
        """(lat, lon, alt_m) -> local east/north/up metres."""
        east, north, up = self._transformer().transform(lon, lat, alt_m)
        return east, north, up


@dataclass(frozen=True, slots=True)
class CameraPose:
    """Where the camera is and where it looks (see the module docstring for the convention)."""

    east_m: float
    north_m: float
    up_m: float
    yaw_deg: float = 0.0
    pitch_deg: float = 0.0
    roll_deg: float = 0.0
    hfov_deg: float = 60.0
    # A gimbal in MAVLink's vehicle frame; None: the camera is fixed to the body, looking down its z axis.
    gimbal_yaw_deg: float | None = None
    gimbal_pitch_deg: float | None = None
    gimbal_roll_deg: float | None = None

    @property
    def has_gimbal(self) -> bool:
        return self.gimbal_pitch_deg is not None or self.gimbal_yaw_deg is not None or self.gimbal_roll_deg is not None


@dataclass(frozen=True, slots=True)
class GroundFix:
    """A point on the ground (local east/north metres) and its one-sigma uncertainty."""

    east_m: float
    north_m: float
    sigma_m: float


@dataclass(frozen=True, slots=True)
class ErrorModel:
    """The error sources that make a ground fix uncertain (one sigma each)."""

    box_px: float = 4.0  # where the detector puts the box's bottom edge
    attitude_deg: float = 1.0  # autopilot attitude and camera mounting
    altitude_m: float = 0.5  # height above the (assumed flat) ground
    position_m: float = 1.0  # the vehicle's own horizontal position (GNSS)
    # Rays flatter than this meet the ground too far away to mean anything: no fix.
    min_grazing_deg: float = 1.0


DEFAULT_ERRORS = ErrorModel()


def rotation_zyx(yaw_deg: float, pitch_deg: float, roll_deg: float) -> np.ndarray:
    """Body (x forward, y right, z down) -> NED for aerospace Z-Y-X Euler angles."""
    y, p, r = math.radians(yaw_deg), math.radians(pitch_deg), math.radians(roll_deg)
    cy, sy, cp, sp, cr, sr = math.cos(y), math.sin(y), math.cos(p), math.sin(p), math.cos(r), math.sin(r)
    return np.array(
        [
            [cy * cp, cy * sp * sr - sy * cr, cy * sp * cr + sy * sr],
            [sy * cp, sy * sp * sr + cy * cr, sy * sp * cr - cy * sr],
            [-sp, cp * sr, cp * cr],
        ]
    )


def angles_zyx(rotation: np.ndarray) -> tuple[float, float, float]:
    """Inverse of ``rotation_zyx``: (yaw, pitch, roll) degrees; at pitch +-90 the roll is folded into the yaw."""
    pitch = math.asin(max(-1.0, min(1.0, -float(rotation[2, 0]))))
    if abs(rotation[2, 0]) < 1.0 - 1e-9:
        yaw = math.atan2(rotation[1, 0], rotation[0, 0])
        roll = math.atan2(rotation[2, 1], rotation[2, 2])
    else:
        yaw = math.atan2(-rotation[0, 1], rotation[1, 1])
        roll = 0.0
    return math.degrees(yaw), math.degrees(pitch), math.degrees(roll)


def camera_to_world(pose: CameraPose) -> np.ndarray:
    """3x3 rotation from camera axes (x right, y down, z along the view) to world east/north/up."""
    if pose.has_gimbal:
        gimbal = rotation_zyx(
            pose.yaw_deg + (pose.gimbal_yaw_deg or 0.0), pose.gimbal_pitch_deg or 0.0, pose.gimbal_roll_deg or 0.0
        )
        rotation: np.ndarray = _NED_TO_ENU @ gimbal @ _CAMERA_TO_GIMBAL  # numpy types a matmul as Any
        return rotation
    rotation = _NED_TO_ENU @ rotation_zyx(pose.yaw_deg, pose.pitch_deg, pose.roll_deg) @ _CAMERA_TO_BODY
    return rotation


def fold_gimbal(pose: CameraPose) -> CameraPose:
    """The same view expressed as a fixed belly camera (no gimbal angles): what a plain Pose can carry."""
    if not pose.has_gimbal:
        return pose
    body_to_ned = _NED_TO_ENU.T @ camera_to_world(pose) @ _CAMERA_TO_BODY.T
    yaw, pitch, roll = angles_zyx(body_to_ned)
    return replace(
        pose,
        yaw_deg=yaw,
        pitch_deg=pitch,
        roll_deg=roll,
        gimbal_yaw_deg=None,
        gimbal_pitch_deg=None,
        gimbal_roll_deg=None,
    )


def focal_px(hfov_deg: float, width: int) -> float:
    """Focal length in pixels of a pinhole camera whose ``hfov_deg`` spans ``width`` pixels."""
    return (width / 2.0) / math.tan(math.radians(hfov_deg) / 2.0)


def project_points(
    points_xy: np.ndarray, pose: CameraPose, width: int, height: int, errors: ErrorModel = DEFAULT_ERRORS
) -> np.ndarray:
    """Image points (N, 2) (continuous pixels, principal point at the centre) -> (N, 3) east, north, sigma.

    Rows whose ray does not meet the ground (at or above the horizon, or flatter
    than ``errors.min_grazing_deg``) are NaN.
    """
    pts = np.asarray(points_xy, np.float64).reshape(-1, 2)
    f = focal_px(pose.hfov_deg, width)
    rays_cam = np.empty((pts.shape[0], 3))
    rays_cam[:, 0] = (pts[:, 0] - width / 2.0) / f
    rays_cam[:, 1] = (pts[:, 1] - height / 2.0) / f
    rays_cam[:, 2] = 1.0
    rays = rays_cam @ camera_to_world(pose).T  # (N, 3) east, north, up
    norm = np.linalg.norm(rays, axis=1)
    sin_grazing = -rays[:, 2] / norm
    out = np.full((pts.shape[0], 3), np.nan)
    hit = (sin_grazing > math.sin(math.radians(errors.min_grazing_deg))) & (pose.up_m > 0.0)
    if not hit.any():
        return out
    r, s = rays[hit], sin_grazing[hit]
    t = pose.up_m / -r[:, 2]
    out[hit, 0] = pose.east_m + t * r[:, 0]
    out[hit, 1] = pose.north_m + t * r[:, 1]
    slant = t * norm[hit]
    cos_grazing = np.sqrt(np.maximum(0.0, 1.0 - s * s))
    angle = math.hypot(errors.box_px / f, math.radians(errors.attitude_deg))
    # An angular error moves the point by range x angle across the ray and that / sin(grazing) along it;
    # a height error moves it by dh / tan(grazing) along the ray.
    along = slant * angle / s
    height_term = errors.altitude_m * cos_grazing / s
    out[hit, 2] = np.sqrt(along**2 + height_term**2 + errors.position_m**2)
    return out


def project_boxes(
    boxes_xyxy: np.ndarray, pose: CameraPose, width: int, height: int, errors: ErrorModel = DEFAULT_ERRORS
) -> np.ndarray:
    """(N, 4) x1, y1, x2, y2 boxes -> (N, 3) east, north, sigma of each bottom centre (NaN: no ground)."""
    boxes = np.asarray(boxes_xyxy, np.float64).reshape(-1, 4)
    bottom = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2.0, boxes[:, 3]], axis=1)
    return project_points(bottom, pose, width, height, errors)


def project_box(
    box_xyxy: tuple[float, float, float, float] | np.ndarray,
    pose: CameraPose,
    width: int,
    height: int,
    errors: ErrorModel = DEFAULT_ERRORS,
) -> GroundFix | None:
    """One box's ground fix, or None when its bottom centre looks at or above the horizon."""
    east, north, sigma = project_boxes(np.asarray(box_xyxy, np.float64), pose, width, height, errors)[0]
    if math.isnan(east):
        return None
    return GroundFix(float(east), float(north), float(sigma))

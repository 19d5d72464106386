"""A seeded synthetic flight over a scene of real photos, with ground truth for every frame.

The scene is a flat 40 m x 40 m ground plane (1 cm per pixel) of grass and
gravel texture with scikit-image's photos laid on it at known positions: the
astronaut's head and shoulders (faces, in several sizes and tones), the
cameraman (a person) and a few objects that are neither. A camera flies a
smooth, closed lawnmower path over it; each frame is the perspective view of
the ground from the camera pose (one ``cv2.warpPerspective`` into the caller's
buffer), and its ``FrameMeta`` carries the pose and the pixel box of every
object that is mostly in view. Everything is a pure function of the seed, the
config and the frame index, so a run can be scored and repeated exactly.

Pose convention (``types.Pose``), shared with anything that projects boxes back
onto the ground: position is east/north/up in metres; attitude is the aerospace
Z-Y-X Euler angles (yaw clockwise from north, pitch nose-up positive, roll
right-wing-down positive) of a body whose camera looks straight down along the
body's z axis, with image up = the body's nose and image right = its right
wing. Level flight is pitch 0, roll 0 and looks at nadir. ``ground_to_image``
gives the homography for a pose.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from edgerun.config import ReplayConfig, SourceConfig
from edgerun.errors import SourceError
from edgerun.sources.base import Source
from edgerun.types import FrameMeta, Pose

log = logging.getLogger(__name__)

# Scene size and resolution: 100 px/m is a little finer than the default view
# (about 92 px/m at 6 m, 60 degrees, 640 px), so the ground is never upsampled there.
SCENE_EXTENT_M = 40.0
SCENE_PX_PER_M = 100.0

# The astronaut's face in astronaut.png (512x512 photo pixels, x1, y1, x2, y2):
# forehead to chin, ear to ear, as BlazeFace short range reports it on the whole
# photo and on crops of it at 25-60 px face height (measured: within 3 px).
ASTRONAUT_FACE_BOX = (174.0, 75.0, 274.0, 175.0)
# The crop of astronaut.png laid on the ground: the face with hair and collar
# around it (the context BlazeFace expects), cut tight enough to leave out the
# glove on the helmet ring, which BlazeFace takes for a face when the real one
# is out of view.
ASTRONAUT_CROP = (149, 35, 299, 205)
# The cameraman in camera.png: top of the head to the bottom edge, back (cut by
# the photo's left edge) to the front of his gloves; the tripod is not him. His
# face, in profile behind the camera, is not a truth face: BlazeFace finds it in
# some frames, which scores as a detection without truth, never as a miss.
CAMERAMAN_PERSON_BOX = (0.0, 64.0, 326.0, 512.0)

# Flight: north-south lanes 6 m apart (the default footprint is 6.9 m x 5.2 m, so
# lanes overlap a little), objects laid along the lanes so each pass sees them whole.
_LANES_X_M = (5.0, 11.0, 17.0, 23.0, 29.0, 35.0)
_LANE_SOUTH_M = 4.5
_LANE_NORTH_M = 35.5
_RETURN_NORTH_M = 2.5
_OBJECTS_SOUTH_M = 6.5
_OBJECTS_NORTH_M = 33.5
# Face boxes on the ground span this many metres: 120-240 px tall at the default view.
_FACE_SIZE_M = (1.3, 2.6)
# Truth keeps objects whose projected box is at least this much inside the frame.
MIN_VISIBLE_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class Scene:
    """The ground image and where its objects are, in ground metres."""

    image: np.ndarray  # (H, W, 3) uint8 BGR, read-only; row 0 is the northern edge
    px_per_m: float
    extent_m: tuple[float, float]  # east, north size of the ground the image covers
    boxes_m: np.ndarray  # (M, 4) float64 east_min, north_min, east_max, north_max
    labels: tuple[str, ...]
    border: tuple[float, float, float]  # ground colour shown beyond the scene's edge

    @property
    def ground_points(self) -> np.ndarray:
        """(M, 2) east, north of each object's bottom centre: where the bottom of its box projects to the ground."""
        b = self.boxes_m
        return np.stack([(b[:, 0] + b[:, 2]) / 2.0, b[:, 1]], axis=1)

    @property
    def corners(self) -> np.ndarray:
        """(M, 4, 3) homogeneous ground corners (east, north, 1) of every object box."""
        b = self.boxes_m
        east = b[:, [0, 2, 2, 0]]
        north = b[:, [1, 1, 3, 3]]
        return np.stack([east, north, np.ones_like(east)], axis=-1)


@dataclass(frozen=True, slots=True)
class _Photo:
    """A picture to lay on the ground, with the box of its labelled object in photo pixels."""

    image: np.ndarray  # (h, w, 3) uint8 BGR
    label: str  # "face", "person" or "" for clutter
    box: tuple[float, float, float, float]


def _skimage_photo(name: str) -> np.ndarray:
    """One of scikit-image's bundled photos as BGR, read with OpenCV.

    The files are found without importing ``skimage`` (its I/O stack takes half
    a second to import); a layout we do not know falls back to ``skimage.data``.
    """
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("replay: the built-in scene needs scikit-image's photos (pip install 'edgerun[demo]')")
    for root in spec.submodule_search_locations:
        for ext in (".png", ".jpg"):
            path = Path(root) / "data" / f"{name}{ext}"
            image = cv2.imread(str(path), cv2.IMREAD_COLOR) if path.is_file() else None
            if image is not None:
                return image
    from skimage import data

    pixels = getattr(data, name)()
    code = cv2.COLOR_GRAY2BGR if pixels.ndim == 2 else cv2.COLOR_RGB2BGR
    return cv2.cvtColor(pixels, code)


def _photos() -> tuple[list[_Photo], list[_Photo], list[_Photo]]:
    """Faces, persons and clutter, made from scikit-image's bundled photos."""
    astronaut = _skimage_photo("astronaut")
    x1, y1, x2, y2 = ASTRONAUT_CROP
    head = np.ascontiguousarray(astronaut[y1:y2, x1:x2])
    fx1, fy1, fx2, fy2 = ASTRONAUT_FACE_BOX
    face_box = (fx1 - x1, fy1 - y1, fx2 - x1, fy2 - y1)
    mirrored_box = (head.shape[1] - face_box[2], face_box[1], head.shape[1] - face_box[0], face_box[3])

    def gamma(img: np.ndarray, g: float) -> np.ndarray:
        lut = (255.0 * (np.arange(256) / 255.0) ** g).round().astype(np.uint8)
        return cv2.LUT(img, lut)

    grey = cv2.cvtColor(cv2.cvtColor(head, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    # Tone variants stand in for other people and light: darker, brighter, grey, cooler.
    cool = cv2.convertScaleAbs(head * np.array([1.15, 1.0, 0.85], np.float32))
    faces = [
        _Photo(head, "face", face_box),
        _Photo(np.ascontiguousarray(head[:, ::-1]), "face", mirrored_box),
        _Photo(gamma(head, 1.35), "face", face_box),
        _Photo(gamma(head[:, ::-1], 0.75), "face", mirrored_box),
        _Photo(grey, "face", face_box),
        _Photo(cool, "face", face_box),
    ]
    camera = _skimage_photo("camera")
    persons = [
        _Photo(camera, "person", CAMERAMAN_PERSON_BOX),
        _Photo(np.ascontiguousarray(camera[:, ::-1]), "person", (512.0 - 326.0, 64.0, 512.0, 512.0)),
    ]
    clutter = [
        _Photo(_skimage_photo("coffee"), "", (0.0, 0.0, 0.0, 0.0)),
        _Photo(_skimage_photo("rocket"), "", (0.0, 0.0, 0.0, 0.0)),
    ]
    return faces, persons, clutter


def _tint(gray: np.ndarray, gains: tuple[float, float, float], offsets: tuple[float, float, float]) -> np.ndarray:
    return cv2.merge([cv2.convertScaleAbs(gray, alpha=a, beta=b) for a, b in zip(gains, offsets)])


def _ground_texture(size: int, rng: np.random.Generator) -> np.ndarray:
    """Grass and gravel in soft patches, from scikit-image's textures; uint8 work only (16 Mpx)."""
    tile = 512
    n = -(-size // tile)

    def mosaic(texture: np.ndarray) -> np.ndarray:
        # Each tile gets one of the 8 flips/rotations so the 5 m repeat does not show as a grid.
        rows = []
        for _ in range(n):
            row = []
            for k in rng.integers(0, 8, n):
                t = np.rot90(texture, int(k) % 4)
                row.append(t[:, ::-1] if k >= 4 else t)
            rows.append(np.hstack(row))
        return np.ascontiguousarray(np.vstack(rows)[:size, :size])

    grass = cv2.cvtColor(_skimage_photo("grass"), cv2.COLOR_BGR2GRAY)
    gravel = cv2.cvtColor(_skimage_photo("gravel"), cv2.COLOR_BGR2GRAY)
    # Tint the 512 px tiles, not the 16 Mpx mosaic: same pixels, 64 times less work.
    grass_bgr = mosaic(_tint(grass, (0.45, 0.75, 0.50), (15.0, 40.0, 25.0)))
    gravel_bgr = mosaic(_tint(gravel, (0.60, 0.62, 0.66), (45.0, 50.0, 55.0)))
    # Soft patch mask: cubic upsampling of coarse noise, sharpened, made at 1/4 size first.
    noise = rng.random((12, 12)).astype(np.float32)
    coarse = cv2.resize(noise, (size // 4, size // 4), interpolation=cv2.INTER_CUBIC)
    coarse = np.clip((coarse - 0.35) * 4.0 * 255.0, 0.0, 255.0).astype(np.uint8)
    mask = cv2.merge([cv2.resize(coarse, (size, size), interpolation=cv2.INTER_LINEAR)] * 3)
    ground = cv2.multiply(grass_bgr, mask, scale=1.0 / 255.0)
    cv2.add(ground, cv2.multiply(gravel_bgr, cv2.bitwise_not(mask), scale=1.0 / 255.0), dst=ground)
    return ground


def _user_ground(path: str, size: int) -> np.ndarray:
    """The user's picture scaled to cover the square scene (centre crop)."""
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    if image is None:
        raise SourceError(f"replay: scene image {path!r} could not be read")
    h, w = image.shape[:2]
    scale = size / min(h, w)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    interp = cv2.INTER_AREA if scale < 1.0 else cv2.INTER_LINEAR
    resized = cv2.resize(image, (nw, nh), interpolation=interp)
    x0, y0 = (nw - size) // 2, (nh - size) // 2
    return np.ascontiguousarray(resized[y0 : y0 + size, x0 : x0 + size])


def _lay_out(
    rng: np.random.Generator, faces: list[_Photo], persons: list[_Photo], clutter: list[_Photo]
) -> list[tuple[_Photo, float, float, float]]:
    """Objects along the flight lanes: (photo, east centre, north of its bottom edge, height) in metres."""
    placed: list[tuple[_Photo, float, float, float]] = []
    rects: list[tuple[float, float, float, float]] = []
    margin = 0.3
    for lane in _LANES_X_M:
        north = _OBJECTS_SOUTH_M + rng.uniform(0.0, 2.0)
        while True:
            kind = rng.choice(4, p=[0.6, 0.2, 0.1, 0.1])
            if kind == 3:  # a stretch of bare ground between objects
                north += rng.uniform(2.0, 4.0)
                if north > _OBJECTS_NORTH_M:
                    break
                continue
            pool = (faces, persons, clutter)[kind]
            photo = pool[int(rng.integers(len(pool)))]
            ph, pw = photo.image.shape[:2]
            if photo.label == "face":
                face_h = rng.uniform(*_FACE_SIZE_M)
                height = face_h * ph / (photo.box[3] - photo.box[1])
            elif photo.label == "person":
                height = rng.uniform(3.0, 4.2)
            else:
                height = rng.uniform(2.0, 3.0)
            width = height * pw / ph
            if north + height > _OBJECTS_NORTH_M:
                break
            for _ in range(8):
                east = lane + rng.uniform(-0.7, 0.7)
                rect = (east - width / 2 - margin, north - margin, east + width / 2 + margin, north + height + margin)
                if not any(r[0] < rect[2] and rect[0] < r[2] and r[1] < rect[3] and rect[1] < r[3] for r in rects):
                    rects.append(rect)
                    placed.append((photo, east, north, height))
                    break
            north += height + rng.uniform(2.0, 4.0)
    return placed


@functools.lru_cache(maxsize=2)
def build_scene(seed: int, scene_path: str = "") -> Scene:
    """The scene for ``seed`` (cached: building it takes about half a second and 48 MB)."""
    t0 = time.monotonic()
    rng = np.random.default_rng([seed, 0x5CE7E])
    size = round(SCENE_EXTENT_M * SCENE_PX_PER_M)
    ground_rng = np.random.default_rng([seed, 0x6207D])
    image = _user_ground(scene_path, size) if scene_path else _ground_texture(size, ground_rng)
    faces, persons, clutter = _photos()
    ppm = SCENE_PX_PER_M
    boxes: list[tuple[float, float, float, float]] = []
    labels: list[str] = []
    for photo, east, north, height in _lay_out(rng, faces, persons, clutter):
        ph, pw = photo.image.shape[:2]
        # Integer pixel placement; the truth uses the exact scale of the resized photo.
        x0 = round((east - height * pw / ph / 2) * ppm)
        y0 = round((SCENE_EXTENT_M - north - height) * ppm)
        nw, nh = round(height * pw / ph * ppm), round(height * ppm)
        interp = cv2.INTER_AREA if nh < ph else cv2.INTER_CUBIC
        image[y0 : y0 + nh, x0 : x0 + nw] = cv2.resize(photo.image, (nw, nh), interpolation=interp)
        if not photo.label:
            continue
        sx, sy = nw / pw, nh / ph
        bx1, by1, bx2, by2 = photo.box
        # Scene pixel edges (continuous coordinates) -> ground metres; image rows grow southwards.
        boxes.append(
            (
                (x0 + bx1 * sx) / ppm,
                SCENE_EXTENT_M - (y0 + by2 * sy) / ppm,
                (x0 + bx2 * sx) / ppm,
                SCENE_EXTENT_M - (y0 + by1 * sy) / ppm,
            )
        )
        labels.append(photo.label)
    image.flags.writeable = False
    border = tuple(float(c) for c in cv2.mean(image)[:3])
    log.info(
        "replay: scene for seed %d built in %.2f s: %d faces, %d persons on %s",
        seed,
        time.monotonic() - t0,
        labels.count("face"),
        labels.count("person"),
        scene_path or "the built-in ground",
    )
    return Scene(
        image=image,
        px_per_m=ppm,
        extent_m=(SCENE_EXTENT_M, SCENE_EXTENT_M),
        boxes_m=np.asarray(boxes, np.float64).reshape(-1, 4),
        labels=tuple(labels),
        border=(border[0], border[1], border[2]),
    )


class FlightPath:
    """A closed, smooth (C2) lawnmower path over the lanes, walked at constant speed.

    A periodic uniform cubic B-spline through seeded, slightly jittered
    waypoints: lanes stay nearly straight, turns are rounded, and the path
    loops forever. ``position(distance)`` is exact on the spline; the
    arc-length table only picks the spline parameter.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        lanes = list(_LANES_X_M)
        if rng.random() < 0.5:  # start from the east or the west side
            lanes = [SCENE_EXTENT_M - x for x in reversed(lanes)]
        points: list[tuple[float, float]] = []
        lane_starts: list[int] = []
        step = 3.0
        along = np.arange(_LANE_SOUTH_M, _LANE_NORTH_M + 1e-9, step)
        for i, x in enumerate(lanes):
            ys = along if i % 2 == 0 else along[::-1]
            lane_starts.append(len(points))
            points.extend((x, float(y)) for y in ys)
        back = np.arange(lanes[-1], lanes[0], -step if lanes[-1] > lanes[0] else step)[1:]
        points.extend((float(x), _RETURN_NORTH_M) for x in back)
        ctrl = np.asarray(points, np.float64)
        ctrl += rng.uniform(-0.3, 0.3, ctrl.shape)  # a gentle weave, different for every seed
        self._ctrl = ctrl
        n = len(ctrl)
        u = np.linspace(0.0, n, n * 32 + 1)
        xy = self._eval(u)
        seg = np.hypot(*np.diff(xy, axis=0).T)
        self._u = u
        self._s = np.concatenate([[0.0], np.cumsum(seg)])
        self.length_m = float(self._s[-1])
        # Start where a lane begins, so even a short run flies over objects at once.
        start_u = lane_starts[int(rng.integers(len(lane_starts)))]
        self.start_m = float(np.interp(start_u, u, self._s))

    def _eval(self, u: np.ndarray) -> np.ndarray:
        n = len(self._ctrl)
        i = np.floor(u).astype(np.int64)
        t = (u - i)[:, None]
        p0, p1, p2, p3 = (self._ctrl[(i + k) % n] for k in (-1, 0, 1, 2))
        b0 = (1 - t) ** 3
        b1 = 3 * t**3 - 6 * t**2 + 4
        b2 = -3 * t**3 + 3 * t**2 + 3 * t + 1
        b3 = t**3
        return (b0 * p0 + b1 * p1 + b2 * p2 + b3 * p3) / 6.0

    def position(self, distance_m: float) -> tuple[float, float]:
        """East, north after flying ``distance_m`` from the seeded start."""
        s = (self.start_m + distance_m) % self.length_m
        u = float(np.interp(s, self._s, self._u))
        east, north = self._eval(np.array([u]))[0]
        return float(east), float(north)


def _rotation_world_to_camera(yaw_deg: float, pitch_deg: float, roll_deg: float) -> np.ndarray:
    """World (ENU) -> camera (x right, y down, z along the view) for the module's pose convention."""
    y, p, r = math.radians(yaw_deg), math.radians(pitch_deg), math.radians(roll_deg)
    cy, sy, cp, sp, cr, sr = math.cos(y), math.sin(y), math.cos(p), math.sin(p), math.cos(r), math.sin(r)
    body_to_ned = np.array(
        [
            [cy * cp, cy * sp * sr - sy * cr, cy * sp * cr + sy * sr],
            [sy * cp, sy * sp * sr + cy * cr, sy * sp * cr - cy * sr],
            [-sp, cp * sr, cp * cr],
        ]
    )
    camera_to_body = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    ned_to_enu = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, -1.0]])
    return (ned_to_enu @ body_to_ned @ camera_to_body).T


def ground_to_image(pose: Pose, width: int, height: int) -> np.ndarray:
    """3x3 homography from ground (east, north, 1) metres to image pixels (continuous, x1y1x2y2 convention).

    Pixel ``i`` covers ``[i, i + 1)``; the principal point is the frame centre and
    ``hfov_deg`` spans the full width.
    """
    f = (width / 2.0) / math.tan(math.radians(pose.hfov_deg) / 2.0)
    k = np.array([[f, 0.0, width / 2.0], [0.0, f, height / 2.0], [0.0, 0.0, 1.0]])
    rot = _rotation_world_to_camera(pose.yaw_deg, pose.pitch_deg, pose.roll_deg)
    centre = np.array([pose.east_m, pose.north_m, pose.up_m])
    extrinsic = np.column_stack([rot[:, 0], rot[:, 1], -rot @ centre])
    return k @ extrinsic


class ReplaySource(Source):
    """Renders the seeded flight into the caller's buffer; every frame carries its pose and truth."""

    KEY = "replay"
    synthetic_clock = True

    def __init__(self, replay: ReplayConfig | None = None, *, fps: float = 15.0, scene: str | None = None) -> None:
        """``fps`` is the nominal frame rate: it sets how far the camera moves per frame.

        ``scene`` (or ``replay.scene``) is a picture used as the ground instead of
        the built-in texture; the photos and their ground truth are laid on it too.
        """
        self.config = replay or ReplayConfig()
        self.scene_path = self.config.scene if scene is None else scene
        self.fps = fps if fps > 0 else 15.0
        self.width = self.config.width
        self.height = self.config.height
        self.name = f"replay:{self.config.seed}" + (f":{Path(self.scene_path).name}" if self.scene_path else "")
        rng = np.random.default_rng([self.config.seed, 0xF11E])
        self.path = FlightPath(rng)
        # Phases of the attitude wobble, so seeds differ in how the camera sways too.
        self._phases = rng.uniform(0.0, 2.0 * math.pi, 4)
        self._scene: Scene | None = None
        self._corners: np.ndarray | None = None
        self._labels = np.zeros((0,), dtype=object)
        self._index = 0

    @classmethod
    def from_config(cls, cfg: SourceConfig) -> ReplaySource:
        return cls(cfg.replay, fps=cfg.fps)

    def open(self) -> None:
        if self.scene_path and not Path(self.scene_path).is_file():
            raise SourceError(f"replay: scene image {self.scene_path!r} not found")
        self._scene = build_scene(self.config.seed, self.scene_path)
        self._corners = self._scene.corners.reshape(-1, 3).T.copy()  # (3, 4M) for one matmul per frame
        self._labels = np.asarray(self._scene.labels, dtype=object)
        self._index = 0

    @property
    def scene(self) -> Scene:
        if self._scene is None:
            raise SourceError("replay: read before open")
        return self._scene

    def pose_at(self, index: int) -> Pose:
        """The camera pose of frame ``index``: a pure function of the seed, config and index."""
        t = index / self.fps
        cfg = self.config
        east, north = self.path.position(cfg.path_offset_m + cfg.speed_mps * t)
        east += cfg.east_offset_m
        north += cfg.north_offset_m
        ph = self._phases
        two_pi = 2.0 * math.pi
        # Gentle attitude only: the camera keeps scene-north near image-up and stays
        # within ~8 degrees of nadir, so the photos look upright; BlazeFace (and most
        # face models) find upright faces only, so a tumbling camera would make recall
        # measure the flight, not the detector.
        return Pose(
            east_m=east,
            north_m=north,
            up_m=self.config.altitude_m * (1.0 + 0.03 * math.sin(two_pi * t / 17.0 + ph[0])),
            yaw_deg=3.5 * math.sin(two_pi * t / 11.0 + ph[1]),
            # Nose up tilts a belly camera forward: the view centre is a little north of nadir.
            pitch_deg=5.0 + 2.0 * math.sin(two_pi * t / 7.0 + ph[2]),
            roll_deg=2.5 * math.sin(two_pi * t / 5.3 + ph[3]),
            hfov_deg=self.config.hfov_deg,
            origin_lat=cfg.origin[0],
            origin_lon=cfg.origin[1],
            ground_alt_m=cfg.ground_alt_m,
        )

    def truth(self, pose: Pose, width: int, height: int) -> tuple[np.ndarray, tuple[str, ...]]:
        """Pixel boxes (clipped) and labels of the objects at least 80% inside the frame."""
        index, boxes = self.visible(pose, width, height)
        return boxes, tuple(self._labels[index].tolist())

    def visible(self, pose: Pose, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
        """Scene indices (into ``scene.boxes_m``) and clipped pixel boxes of the objects mostly in view."""
        scene = self.scene
        assert self._corners is not None
        m = len(scene.labels)
        if m == 0:
            return np.zeros((0,), np.int64), np.zeros((0, 4), np.float32)
        proj = ground_to_image(pose, width, height) @ self._corners  # (3, 4M)
        z = proj[2].reshape(m, 4)
        with np.errstate(divide="ignore", invalid="ignore"):
            x = (proj[0] / proj[2]).reshape(m, 4)
            y = (proj[1] / proj[2]).reshape(m, 4)
        boxes = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], axis=1)
        clipped = np.clip(boxes, 0.0, [width, height, width, height])
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        inside = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
        # All corners in front of the camera, then the visible share of the box.
        keep = np.all(z > 0.0, axis=1) & (area > 0.0)
        keep[keep] = inside[keep] >= MIN_VISIBLE_FRACTION * area[keep]
        return np.flatnonzero(keep), clipped[keep].astype(np.float32)

    def render(self, pose: Pose, image: np.ndarray) -> None:
        """Draw the view from ``pose`` into ``image`` (any (h, w, 3) uint8 buffer)."""
        scene = self.scene
        h, w = image.shape[:2]
        ppm = scene.px_per_m
        # Scene pixel centres (integers) -> ground metres; image continuous -> pixel centres.
        scene_to_ground = np.array(
            [[1.0 / ppm, 0.0, 0.5 / ppm], [0.0, -1.0 / ppm, scene.extent_m[1] - 0.5 / ppm], [0.0, 0.0, 1.0]]
        )
        to_centres = np.array([[1.0, 0.0, -0.5], [0.0, 1.0, -0.5], [0.0, 0.0, 1.0]])
        h_scene = to_centres @ ground_to_image(pose, w, h) @ scene_to_ground
        cv2.warpPerspective(
            scene.image,
            h_scene,
            (w, h),
            dst=image,
            flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_CONSTANT,
            borderValue=scene.border,
        )

    def read(self, image: np.ndarray, seq: int) -> FrameMeta | None:
        if self.config.frames and self._index >= self.config.frames:
            return None
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"replay: expected an (h, w, 3) uint8 buffer, got {image.shape} {image.dtype}")
        pose = self.pose_at(self._index)
        self._index += 1
        self.render(pose, image)
        h, w = image.shape[:2]
        boxes, labels = self.truth(pose, w, h)
        return FrameMeta(
            seq=seq,
            source=self.name,
            width=w,
            height=h,
            wall_time=time.time(),
            t_capture=time.monotonic(),
            pose=pose,
            truth_boxes=boxes,
            truth_labels=labels,
        )

    def skip(self, count: int) -> int:
        """Move the camera on without rendering: the flight is a function of the frame index."""
        if self.config.frames:
            count = max(0, min(count, self.config.frames - self._index))
        self._index += count
        return count

    def close(self) -> None:
        # The scene stays in build_scene's cache: reopening after a stall is instant.
        self._scene = None
        self._corners = None

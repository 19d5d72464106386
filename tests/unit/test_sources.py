"""Frame sources: the replay flight, image directories and OpenCV captures, all into the caller's buffer."""

from __future__ import annotations

import functools
import http.server
import math
import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.config import ReplayConfig, SourceConfig
from edgerun.errors import SourceError
from edgerun.sources import SOURCE_MODULES, make_source, source_class
from edgerun.sources.images import ImagesSource
from edgerun.sources.opencv import OpenCvSource
from edgerun.sources.replay import ReplaySource, ground_to_image
from edgerun.types import Pose

# The runtime's budget: no allocation of 64 KiB or more per captured frame.
FRAME_ALLOC_LIMIT = 64 * 1024
# Hand-checked on astronaut.png, independently of the replay's own constant: brow to chin, cheek to cheek.
ASTRONAUT_FACE = (176, 80, 274, 178)


def alloc_peak(fn: Callable[[], object], calls: int = 5) -> int:
    """Largest traced-memory peak over one call, across ``calls`` calls after a warm-up."""
    fn()
    tracemalloc.start()
    worst = 0
    try:
        for _ in range(calls):
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            fn()
            worst = max(worst, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return worst


# ---- registry --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(SOURCE_MODULES))
def test_registry_resolves_every_key_to_its_class(key):
    assert source_class(key).KEY == key


def test_unknown_kind_is_a_source_error_listing_the_known_ones():
    with pytest.raises(SourceError, match=r"unknown source kind 'webcam' \(known: images, opencv, replay\)"):
        source_class("webcam")


def test_make_source_builds_each_kind_from_config(tmp_path):
    replay = make_source(SourceConfig(kind="replay", fps=30.0, replay=ReplayConfig(seed=7, width=320, height=240)))
    assert isinstance(replay, ReplaySource)
    assert (replay.width, replay.height, replay.fps, replay.config.seed) == (320, 240, 30.0, 7)
    # fps 0 means "as fast as the pipeline takes frames"; the flight still needs a nominal rate.
    assert make_source(SourceConfig(kind="replay", fps=0)).fps == 15.0
    cam = make_source(SourceConfig(kind="opencv", uri="2", width=1280, height=720, loop=False))
    assert isinstance(cam, OpenCvSource) and cam.kind == "camera" and cam.requested == (1280, 720)
    images = make_source(SourceConfig(kind="images", path=str(tmp_path), preload=True, loop=False, fps=5.0))
    assert isinstance(images, ImagesSource) and images.preload and not images.loop and images.fps == 5.0


# ---- replay: the camera model ----------------------------------------------------------------


def project(pose: Pose, east: float, north: float, w: int = 640, h: int = 480) -> np.ndarray:
    p = ground_to_image(pose, w, h) @ np.array([east, north, 1.0])
    return p[:2] / p[2]


def test_pose_convention_level_flight_looks_straight_down_with_north_up():
    pose = Pose(east_m=20.0, north_m=20.0, up_m=10.0, hfov_deg=90.0)
    np.testing.assert_allclose(project(pose, 20.0, 20.0), [320.0, 240.0], atol=1e-9)
    # hfov 90 at 10 m: the frame's right edge is 10 m east; north is up.
    np.testing.assert_allclose(project(pose, 30.0, 20.0), [640.0, 240.0], atol=1e-9)
    np.testing.assert_allclose(project(pose, 20.0, 25.0), [320.0, 240.0 - 160.0], atol=1e-9)


def test_pose_convention_yaw_pitch_roll_are_aerospace_angles_of_a_down_looking_body():
    base = {"east_m": 0.0, "north_m": 0.0, "up_m": 10.0}
    # Yaw 90: the nose (image up) points east, so north appears on the left.
    x, y = project(Pose(**base, yaw_deg=90.0), 0.0, 5.0)
    assert x < 320.0 and y == pytest.approx(240.0)
    # Nose up (positive pitch) turns a belly camera forward: the point below it moves down the image.
    x, y = project(Pose(**base, pitch_deg=10.0), 0.0, 0.0)
    assert y > 240.0 and x == pytest.approx(320.0)
    # Right wing down (positive roll) looks left: the point below moves right in the image.
    x, y = project(Pose(**base, roll_deg=10.0), 0.0, 0.0)
    assert x > 320.0 and y == pytest.approx(240.0)
    f = 320.0 / math.tan(math.radians(30.0))
    assert x - 320.0 == pytest.approx(f * math.tan(math.radians(10.0)))


# ---- replay: frames and truth ----------------------------------------------------------------


@pytest.fixture(scope="module")
def flight() -> Iterator[ReplaySource]:
    src = ReplaySource(ReplayConfig(seed=1))
    src.open()
    yield src
    src.close()


def read_frames(src: ReplaySource, n: int) -> list[tuple[np.ndarray, object]]:
    out = []
    for i in range(n):
        image = np.zeros((src.height, src.width, 3), np.uint8)
        out.append((image, src.read(image, i)))
    return out


def test_replay_is_deterministic_for_a_seed_and_differs_between_seeds():
    runs = []
    for seed in (3, 3, 4):
        src = ReplaySource(ReplayConfig(seed=seed))
        src.open()
        runs.append(read_frames(src, 4))
    for (img_a, meta_a), (img_b, meta_b) in zip(runs[0], runs[1]):
        np.testing.assert_array_equal(img_a, img_b)
        assert meta_a.pose == meta_b.pose
        np.testing.assert_array_equal(meta_a.truth_boxes, meta_b.truth_boxes)
        assert meta_a.truth_labels == meta_b.truth_labels
    assert runs[0][0][1].pose != runs[2][0][1].pose
    assert np.mean(runs[0][0][0] != runs[2][0][0]) > 0.5


def test_replay_renders_into_the_callers_buffer_without_allocating(flight):
    image = np.zeros((480, 640, 3), np.uint8)
    address = image.ctypes.data
    meta = flight.read(image, 0)
    assert meta is not None and (meta.width, meta.height) == (640, 480)
    assert image.ctypes.data == address and image.std() > 10  # filled in place with a textured view
    assert alloc_peak(lambda: flight.read(image, 1)) < FRAME_ALLOC_LIMIT


def test_replay_renders_into_any_buffer_size_with_truth_in_its_pixels(flight):
    small = np.zeros((240, 320, 3), np.uint8)
    big = np.zeros((480, 640, 3), np.uint8)
    pose = flight.pose_at(40)
    flight.render(pose, small)
    flight.render(pose, big)
    boxes_small, _ = flight.truth(pose, 320, 240)
    boxes_big, _ = flight.truth(pose, 640, 480)
    np.testing.assert_allclose(boxes_small * 2.0, boxes_big, atol=1e-3)
    shrunk = cv2.resize(big, (320, 240), interpolation=cv2.INTER_AREA)
    assert np.abs(shrunk.astype(int) - small.astype(int)).mean() < 12


def face_template(astronaut_rgb: np.ndarray) -> np.ndarray:
    x1, y1, x2, y2 = ASTRONAUT_FACE
    face = cv2.cvtColor(astronaut_rgb[y1:y2, x1:x2], cv2.COLOR_RGB2GRAY)
    return cv2.resize(face, (48, 48), interpolation=cv2.INTER_AREA).astype(np.float32)


def normalised_correlation(a: np.ndarray, b: np.ndarray) -> float:
    a = (a - a.mean()) / (a.std() + 1e-6)
    b = (b - b.mean()) / (b.std() + 1e-6)
    return float((a * b).mean())


def test_truth_face_boxes_frame_the_rendered_faces(flight, astronaut_rgb):
    """Independent of the camera maths: the pixels inside a truth box look like the astronaut's face."""
    template = face_template(astronaut_rgb)
    mirrored = template[:, ::-1]
    image = np.zeros((480, 640, 3), np.uint8)
    scores, shifted = [], []
    for index in range(0, 2000, 10):
        pose = flight.pose_at(index)
        boxes, labels = flight.truth(pose, 640, 480)
        faces = [b for b, label in zip(boxes, labels) if label == "face"]
        if not faces:
            continue
        flight.render(pose, image)
        grey = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
        for x1, y1, x2, y2 in faces:
            # Only whole faces away from the edge: clipped boxes hold part of a face.
            if x1 < 1 or y1 < 1 or x2 > 639 or y2 > 479 or y2 - y1 < 100:
                continue
            x1, y1, x2, y2 = (int(round(v)) for v in (x1, y1, x2, y2))
            crop = cv2.resize(grey[y1:y2, x1:x2], (48, 48), interpolation=cv2.INTER_AREA).astype(np.float32)
            scores.append(max(normalised_correlation(crop, template), normalised_correlation(crop, mirrored)))
            # The same crop a quarter of the box off must match worse: the box is where the face is.
            dx = (x2 - x1) // 4
            off = grey[y1:y2, min(x1 + dx, 639) : min(x2 + dx, 640)]
            if off.shape[1] == x2 - x1:
                off48 = cv2.resize(off, (48, 48), interpolation=cv2.INTER_AREA).astype(np.float32)
                shifted.append(max(normalised_correlation(off48, template), normalised_correlation(off48, mirrored)))
    assert len(scores) >= 20
    # Measured: median 0.78, min 0.73; a truth box 10 px (10%) off in any direction gives <= 0.67.
    assert np.median(scores) > 0.72 and min(scores) > 0.6
    assert np.median(shifted) < np.median(scores) - 0.2


def test_truth_boxes_lie_in_the_frame_and_are_mostly_visible(flight):
    seen = {"face": 0, "person": 0}
    for index in range(0, 2300, 5):
        boxes, labels = flight.truth(flight.pose_at(index), 640, 480)
        assert boxes.dtype == np.float32 and boxes.shape == (len(labels), 4)
        if len(labels):
            assert np.all(boxes[:, [0, 1]] >= 0.0) and np.all(boxes[:, 2] <= 640.0) and np.all(boxes[:, 3] <= 480.0)
            assert np.all(boxes[:, 2] > boxes[:, 0]) and np.all(boxes[:, 3] > boxes[:, 1])
        for label in labels:
            seen[label] += 1
    # Over one loop of the path both kinds of object are seen, faces the most.
    assert seen["face"] > 80 and seen["person"] > 10 and seen["face"] > seen["person"]


def test_truth_boxes_move_with_the_camera(flight):
    """Over 10 frames a face's box shifts by the camera's ground motion times pixels per metre."""
    checked = 0
    for index in range(0, 2000, 7):
        a, b = flight.pose_at(index), flight.pose_at(index + 10)
        boxes_a, labels_a = flight.truth(a, 640, 480)
        boxes_b, labels_b = flight.truth(b, 640, 480)
        if labels_a.count("face") != 1 or labels_b.count("face") != 1:
            continue
        fa = boxes_a[labels_a.index("face")]
        fb = boxes_b[labels_b.index("face")]
        if fa[0] < 1 or fa[2] > 639 or fb[0] < 1 or fb[2] > 639 or fa[1] < 1 or fa[3] > 479 or fb[1] < 1 or fb[3] > 479:
            continue  # clipped boxes do not move with their object
        px_per_m = (320.0 / math.tan(math.radians(flight.config.hfov_deg / 2))) / a.up_m
        moved = ((fb[:2] + fb[2:]) - (fa[:2] + fa[2:])) / 2.0
        # Camera east -> objects move left; camera north -> objects move down. Attitude wobble adds a little.
        expected = np.array([-(b.east_m - a.east_m), b.north_m - a.north_m]) * px_per_m
        assert np.linalg.norm(moved - expected) < 0.25 * np.linalg.norm(expected) + 25.0
        checked += 1
    assert checked >= 10


def test_pose_changes_smoothly_and_attitude_stays_gentle(flight):
    poses = [flight.pose_at(i) for i in range(600)]
    pos = np.array([[p.east_m, p.north_m] for p in poses])
    att = np.array([[p.yaw_deg, p.pitch_deg, p.roll_deg] for p in poses])
    steps = np.hypot(*np.diff(pos, axis=0).T)
    per_frame = flight.config.speed_mps / flight.fps
    np.testing.assert_allclose(steps, per_frame, rtol=0.05)
    assert np.abs(np.diff(att, axis=0)).max() < 0.5
    assert np.abs(att[:, 0]).max() <= 3.5 and np.abs(att[:, 2]).max() <= 2.5
    assert att[:, 1].min() >= 3.0 and att[:, 1].max() <= 7.0
    ups = np.array([p.up_m for p in poses])
    assert np.all(np.abs(ups / flight.config.altitude_m - 1.0) <= 0.031)
    # The path is closed: one loop later the camera is back where it started.
    loop_frames = flight.path.length_m / per_frame
    end = flight.path.position(loop_frames * per_frame)
    np.testing.assert_allclose(end, flight.path.position(0.0), atol=1e-6)


def test_replay_frames_limit_ends_the_stream():
    src = ReplaySource(ReplayConfig(seed=1, frames=3, width=160, height=120))
    src.open()
    image = np.zeros((120, 160, 3), np.uint8)
    metas = [src.read(image, i) for i in range(5)]
    assert [m is not None for m in metas] == [True, True, True, False, False]
    assert [m.seq for m in metas[:3]] == [0, 1, 2] and metas[0].source == "replay:1"


def test_replay_scene_override_uses_the_users_ground(tmp_path):
    ground = np.zeros((600, 800, 3), np.uint8)
    ground[:] = (200, 40, 10)  # a deep blue ground nothing else in the scene has
    path = tmp_path / "field.png"
    cv2.imwrite(str(path), ground)
    src = ReplaySource(ReplayConfig(seed=1, width=320, height=240), scene=str(path))
    src.open()
    image = np.zeros((240, 320, 3), np.uint8)
    blue = []
    for index in range(0, 2300, 25):
        src.render(src.pose_at(index), image)
        blue.append(np.mean(np.all(np.abs(image.astype(int) - (200, 40, 10)) < 3, axis=2)))
    assert max(blue) > 0.99  # somewhere the view is all user ground
    assert min(blue) < 0.8  # and elsewhere the photos are laid on it
    assert src.name.endswith("field.png")
    missing = ReplaySource(ReplayConfig(seed=1), scene=str(tmp_path / "nope.png"))
    with pytest.raises(SourceError, match="nope.png"):
        missing.open()


def test_blazeface_finds_the_replay_faces(blazeface_bundle):
    """The demo's promise: BlazeFace short range recalls the replay's faces (>= 40 px, IoU >= 0.5)."""
    from edgerun.decoders import decoder_class
    from edgerun.engines.base import EngineOptions
    from edgerun.engines.tflite import TFLiteEngine
    from edgerun.preprocess import Preprocessor

    engine = TFLiteEngine(blazeface_bundle.variant_path("tflite"), EngineOptions(num_threads=2))
    spec = blazeface_bundle.manifest.decoder
    decoder = decoder_class(spec.kind)(dict(spec.params), engine.input_spec, engine.output_specs)
    src = ReplaySource(ReplayConfig(seed=2))
    src.open()
    pre = Preprocessor(blazeface_bundle.manifest.preprocess, engine.input_spec, src.width, src.height)
    image = np.zeros((src.height, src.width, 3), np.uint8)
    tensor = engine.allocate_input()
    truths = matched = 0
    ious = []
    for index in range(0, 2300, 6):
        pose = src.pose_at(index)
        boxes, labels = src.truth(pose, src.width, src.height)
        faces = boxes[[label == "face" for label in labels]] if labels else boxes
        faces = faces[faces[:, 3] - faces[:, 1] >= 40.0]
        if not len(faces):
            continue
        src.render(pose, image)
        pre(image, tensor)
        det = decoder.decode(engine.infer(tensor))
        found = pre.letterbox.boxes_to_source(det.boxes.copy())
        for face in faces:
            ix = np.clip(np.minimum(face[2], found[:, 2]) - np.maximum(face[0], found[:, 0]), 0, None)
            iy = np.clip(np.minimum(face[3], found[:, 3]) - np.maximum(face[1], found[:, 1]), 0, None)
            inter = ix * iy
            area_found = (found[:, 2] - found[:, 0]) * (found[:, 3] - found[:, 1])
            union = (face[2] - face[0]) * (face[3] - face[1]) + area_found
            best = float(np.max(inter / (union - inter), initial=0.0))
            matched += best >= 0.5
            ious.append(best)
            truths += 1
    engine.close()
    assert truths >= 60
    assert matched / truths >= 0.95
    # The truth box is the box BlazeFace draws, not merely one that overlaps it by half.
    assert np.median(ious) >= 0.85


# ---- images ----------------------------------------------------------------------------------


@pytest.fixture
def photo_dir(tmp_path, astronaut_rgb, camera_rgb) -> Path:
    """Two real photos of different sizes, a corrupt PNG and a file that is not an image."""
    from skimage import data

    d = tmp_path / "photos"
    d.mkdir()
    cv2.imwrite(str(d / "a_astronaut.png"), cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR))
    cv2.imwrite(str(d / "c_coffee.jpg"), cv2.cvtColor(data.coffee(), cv2.COLOR_RGB2BGR))
    cv2.imwrite(str(d / "d_camera.bmp"), cv2.cvtColor(camera_rgb, cv2.COLOR_RGB2BGR))
    (d / "b_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (d / "notes.txt").write_text("not an image")
    return d


PHOTO_FILES = ("a_astronaut.png", "c_coffee.jpg", "d_camera.bmp")  # the readable ones, in play order


def expected_frames(d: Path, w: int, h: int) -> list[np.ndarray]:
    """Each photo letterboxed into w x h: scaled to fit with its own proportions, centred, black bars."""
    out = []
    for name in PHOTO_FILES:
        img = cv2.imread(str(d / name))
        scale = min(w / img.shape[1], h / img.shape[0])
        new_w, new_h = round(img.shape[1] * scale), round(img.shape[0] * scale)
        interp = cv2.INTER_AREA if img.shape[0] > new_h or img.shape[1] > new_w else cv2.INTER_LINEAR
        frame = np.zeros((h, w, 3), np.uint8)
        x, y = (w - new_w) // 2, (h - new_h) // 2
        frame[y : y + new_h, x : x + new_w] = cv2.resize(img, (new_w, new_h), interpolation=interp)
        out.append(frame)
    return out


@pytest.mark.parametrize("preload", [True, False])
def test_images_directory_plays_sorted_readable_files_and_loops(photo_dir, preload, caplog):
    src = ImagesSource(photo_dir, preload=preload, loop=True)
    src.open()
    assert (src.width, src.height) == (512, 512)  # the first file's size
    want = expected_frames(photo_dir, 512, 512)
    image = np.zeros((512, 512, 3), np.uint8)
    address = image.ctypes.data
    for i in range(7):
        meta = src.read(image, i)
        assert meta is not None and meta.seq == i and meta.source == str(photo_dir / PHOTO_FILES[i % 3])
        np.testing.assert_array_equal(image, want[i % 3])
    assert image.ctypes.data == address
    assert src.skipped == 1 and src.frame_count == 3
    assert sum("b_broken.png" in r.getMessage() for r in caplog.records) == 1  # logged once, then counted


def test_images_preload_reads_without_allocating_and_ends_without_loop(photo_dir):
    src = ImagesSource(photo_dir, preload=True, loop=False, width=320, height=240)
    src.open()
    assert (src.width, src.height) == (320, 240)
    image = np.zeros((240, 320, 3), np.uint8)
    want = expected_frames(photo_dir, 320, 240)
    got = []
    while src.read(image, len(got)) is not None:
        got.append(image.copy())
    assert len(got) == 3
    np.testing.assert_array_equal(got[1], want[1])
    # The square photos keep their proportions in the 4:3 frame: black bars left and right.
    np.testing.assert_array_equal(got[0], want[0])
    assert not got[0][:, :40].any() and not got[0][:, -40:].any() and got[0][:, 40:280].any()
    src.open()
    assert alloc_peak(lambda: src.read(image, 0), calls=2) < FRAME_ALLOC_LIMIT


def test_images_preload_is_bounded(photo_dir):
    src = ImagesSource(photo_dir, preload=True, max_preload_bytes=1 << 20)
    # Counted before decoding: 4 candidate files (one is corrupt), 512x512 each.
    message = r"preloading 4 files of 512x512 .* needs 3.0 MiB, more than the 1.0 MiB limit"
    with pytest.raises(SourceError, match=message):
        src.open()


def test_images_errors_name_the_path(tmp_path):
    with pytest.raises(SourceError, match="not found"):
        ImagesSource(tmp_path / "missing").open()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match=r"no bmp/jpeg/jpg/png files in '.*empty'"):
        ImagesSource(empty).open()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jpg").write_bytes(b"nope")
    with pytest.raises(SourceError, match="none of the files"):
        ImagesSource(bad).open()


# ---- video files (opencv and images) ---------------------------------------------------------

FRAME_W, FRAME_H, FRAMES = 160, 120, 8


def clip_frame(i: int) -> np.ndarray:
    """Frame ``i``: a flat level that encodes the index, with a bar so JPEG has edges to keep."""
    i %= FRAMES
    frame = np.full((FRAME_H, FRAME_W, 3), 20 + 25 * i, np.uint8)
    frame[:, 10 + 15 * i : 20 + 15 * i] = (0, 0, 255)
    return frame


def write_clip(path: Path, frames: int = FRAMES) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (FRAME_W, FRAME_H))
    assert writer.isOpened()
    for i in range(frames):
        writer.write(clip_frame(i))
    writer.release()
    return path


def frame_index(image: np.ndarray) -> int:
    """Which clip frame ``image`` holds (by its flat level, robust to JPEG and resizing)."""
    level = float(np.median(image[..., 1]))
    return round((level - 20) / 25)


@pytest.fixture
def clip(tmp_path) -> Path:
    return write_clip(tmp_path / "clip.avi")


def test_opencv_reads_a_video_file_into_the_buffer_then_ends(clip):
    src = OpenCvSource(str(clip))
    src.open()
    assert (src.width, src.height, src.kind) == (FRAME_W, FRAME_H, "file") and src.fps == pytest.approx(10.0)
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    address = image.ctypes.data
    seen = []
    while (meta := src.read(image, len(seen))) is not None:
        assert image.ctypes.data == address and meta.width == FRAME_W
        assert np.abs(image.astype(int) - clip_frame(len(seen)).astype(int)).mean() < 4
        seen.append(frame_index(image))
    assert seen == list(range(FRAMES))
    assert src.read(image, 99) is None  # stays ended


def test_opencv_loop_rewinds_a_file(clip):
    src = OpenCvSource(str(clip), loop=True)
    src.open()
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    order = [frame_index(image) for i in range(2 * FRAMES + 3) if src.read(image, i)]
    assert order == list(range(FRAMES)) * 2 + [0, 1, 2]


def test_opencv_resizes_into_the_buffer_when_sizes_differ_without_allocating(clip):
    src = OpenCvSource(str(clip), width=80, height=60, loop=True)
    src.open()
    assert (src.width, src.height) == (80, 60)
    image = np.zeros((60, 80, 3), np.uint8)
    src.read(image, 0)
    want = cv2.resize(clip_frame(0), (80, 60), interpolation=cv2.INTER_AREA)
    assert np.abs(image.astype(int) - want.astype(int)).mean() < 4
    # After the first frame the scratch frame is reused: decode + resize allocate nothing large.
    upscaled = OpenCvSource(str(clip), width=640, height=480, loop=True)
    upscaled.open()
    frame = np.zeros((480, 640, 3), np.uint8)
    assert alloc_peak(lambda: upscaled.read(frame, 0)) < FRAME_ALLOC_LIMIT


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("99", r"camera '99' \(v4l2\) could not be opened"),
        ("/no/such/clip.mp4", r"video file '/no/such/clip.mp4' not found"),
    ],
)
def test_opencv_open_failures_are_one_line_naming_the_uri(uri, message):
    if uri == "99" and os.path.exists("/dev/video99"):
        pytest.skip("this machine has a /dev/video99")
    with pytest.raises(SourceError, match=message) as err:
        OpenCvSource(uri).open()
    assert "\n" not in str(err.value)


def test_opencv_names_what_the_uri_is_and_hides_credentials():
    stream = OpenCvSource("rtsp://admin:secret@10.0.0.5:554/stream1")
    assert stream.kind == "stream" and "secret" not in stream.description
    assert stream.description == "stream 'rtsp://admin:***@10.0.0.5:554/stream1' (ffmpeg)"
    assert OpenCvSource("/dev/video2").kind == "camera"
    pipe = OpenCvSource("v4l2src device=/dev/video0 ! videoconvert")
    assert pipe.kind == "pipeline" and pipe._target.endswith("appsink drop=true max-buffers=1 sync=false")
    assert OpenCvSource("v4l2src ! appsink")._target == "v4l2src ! appsink"
    assert OpenCvSource("clips/flight.mp4").kind == "file" and not OpenCvSource("clips/flight.mp4").live


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_live_stream_that_stops_raises_for_the_reopen_loop(clip):
    """A stream (here a clip served over HTTP on loopback) that ends has stopped: SourceError, not None."""
    handler = functools.partial(_QuietHandler, directory=str(clip.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        src = OpenCvSource(f"http://127.0.0.1:{server.server_address[1]}/{clip.name}", loop=True)
        src.open()
        assert src.live and (src.width, src.height) == (FRAME_W, FRAME_H)
        image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
        got = 0
        with pytest.raises(SourceError, match=r"stream 'http://127.0.0.1:\d+/clip.avi' \(ffmpeg\) stopped delivering"):
            for i in range(FRAMES + 1):
                src.read(image, i)
                got += 1
        assert got == FRAMES  # every frame, then the error (loop does not apply to live sources)
        src.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_file_deleted_while_open_finishes_then_reports_it_gone(clip):
    src = OpenCvSource(str(clip), loop=False)
    src.open()
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    src.read(image, 0)
    clip.unlink()
    # The open descriptor still reads the frames; then a clean end.
    rest = [frame_index(image) for i in range(FRAMES + 2) if src.read(image, i)]
    assert rest == list(range(1, FRAMES))
    with pytest.raises(SourceError, match="not found"):
        src.open()


def test_a_looping_file_deleted_while_open_raises_at_the_rewind(clip):
    src = OpenCvSource(str(clip), loop=True)
    src.open()
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    clip.unlink()
    for i in range(FRAMES):
        assert src.read(image, i) is not None
    with pytest.raises(SourceError, match="was removed while playing"):
        src.read(image, FRAMES)


def test_a_file_truncated_while_open_ends_cleanly_or_plays_what_is_left(tmp_path):
    long_clip = write_clip(tmp_path / "long.avi", frames=40)
    src = OpenCvSource(str(long_clip), loop=False)
    src.open()
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    src.read(image, 0)
    os.truncate(long_clip, os.path.getsize(long_clip) // 4)
    delivered = 0
    while src.read(image, delivered) is not None:  # never raises, never runs past the file
        delivered += 1
        assert delivered < 40

    looping = write_clip(tmp_path / "loop.avi", frames=40)
    src = OpenCvSource(str(looping), loop=True)
    src.open()
    os.truncate(looping, os.path.getsize(looping) // 4)
    for i in range(100):  # the rewind re-reads the shortened file and keeps playing it
        assert src.read(image, i) is not None
    os.truncate(looping, 0)
    with pytest.raises(SourceError, match="no readable frame after rewinding"):
        for i in range(100):
            src.read(image, i)


def test_images_source_plays_and_preloads_a_video_file(clip):
    streamed = ImagesSource(clip, loop=False)
    streamed.open()
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    order = [frame_index(image) for i in range(FRAMES + 2) if streamed.read(image, i)]
    assert order == list(range(FRAMES)) and streamed.fps == pytest.approx(10.0)

    preloaded = ImagesSource(clip, preload=True, loop=True, width=80, height=60)
    preloaded.open()
    assert preloaded.frame_count == FRAMES and (preloaded.width, preloaded.height) == (80, 60)
    small = np.zeros((60, 80, 3), np.uint8)
    order = [frame_index(small) for i in range(FRAMES + 2) if preloaded.read(small, i)]
    assert order == list(range(FRAMES)) + [0, 1]
    with pytest.raises(SourceError, match=r"preloading 2 frames of 160x120"):
        ImagesSource(clip, preload=True, max_preload_bytes=FRAME_W * FRAME_H * 3).open()


# ---- skipping stale frames of a paced replay ---------------------------------------------------


@pytest.mark.parametrize("loop", [False, True])
def test_opencv_skip_passes_over_frames_and_loops_or_ends(clip, loop):
    src = OpenCvSource(str(clip), loop=loop)
    src.open()
    image = np.zeros((FRAME_H, FRAME_W, 3), np.uint8)
    src.read(image, 0)
    assert src.skip(3) == 3
    src.read(image, 4)
    assert frame_index(image) == 4
    if loop:
        assert src.skip(FRAMES) == FRAMES  # wraps to the start: 5..7, then 0..4
        src.read(image, 0)
        assert frame_index(image) == 5
    else:
        assert src.skip(10) == FRAMES - 5  # only what is left
        assert src.read(image, 0) is None


@pytest.mark.parametrize("preload", [True, False])
def test_images_skip_moves_on_without_decoding_and_wraps(photo_dir, preload):
    src = ImagesSource(str(photo_dir), preload=preload, loop=True)
    src.open()
    frames = expected_frames(photo_dir, src.width, src.height)
    image = np.zeros((src.height, src.width, 3), np.uint8)
    for i in range(3):  # one pass: the unreadable files leave the cycle
        src.read(image, i)
    assert src.skip(4) == 4  # three readable frames: a full pass, then one more
    src.read(image, 0)
    np.testing.assert_array_equal(image, frames[1])
    once = ImagesSource(str(photo_dir), preload=preload, loop=False)
    once.open()
    if preload:  # without preload the unreadable files still count until they are read
        assert once.skip(5) == 3 and once.read(image, 0) is None


def test_replay_skip_renders_the_same_frames_as_reading_every_one():
    every = ReplaySource(ReplayConfig(seed=3, frames=6))
    every.open()
    frames = read_frames(every, 6)
    skipping = ReplaySource(ReplayConfig(seed=3, frames=6))
    skipping.open()
    image = np.zeros((skipping.height, skipping.width, 3), np.uint8)
    assert skipping.skip(4) == 4
    meta = skipping.read(image, 4)
    np.testing.assert_array_equal(image, frames[4][0])
    assert meta.pose == frames[4][1].pose
    assert skipping.skip(5) == 1 and skipping.read(image, 6) is None  # the flight's frame limit holds


def test_default_skip_reads_into_its_own_buffer(flight):
    """Sources without a cheaper way read the skipped frames (the base class's skip)."""
    from edgerun.sources.base import Source

    a = ReplaySource(ReplayConfig(seed=4))
    a.open()
    b = ReplaySource(ReplayConfig(seed=4))
    b.open()
    assert Source.skip(a, 2) == 2 and b.skip(2) == 2
    ia = np.zeros((a.height, a.width, 3), np.uint8)
    ib = ia.copy()
    a.read(ia, 2)
    b.read(ib, 2)
    np.testing.assert_array_equal(ia, ib)


def test_replay_drones_share_the_scene_and_fly_the_path_apart():
    """Two drones of one seed: the same scene; the second flies the same path 3 m behind and 0.8 m east."""
    lead = ReplaySource(ReplayConfig(seed=4))
    chase = ReplaySource(ReplayConfig(seed=4, path_offset_m=-3.0, east_offset_m=0.8))
    lead.open()
    chase.open()
    assert np.array_equal(lead.scene.boxes_m, chase.scene.boxes_m)
    behind = round(3.0 / (lead.config.speed_mps / lead.fps))  # frames the lead needs to fly 3 m
    for i in (behind, behind + 17, behind + 200):
        a, b = lead.pose_at(i - behind), chase.pose_at(i)
        assert (b.east_m - 0.8, b.north_m) == pytest.approx((a.east_m, a.north_m), abs=1e-6)
    index, boxes = chase.visible(chase.pose_at(behind), 640, 480)
    truth_boxes, labels = chase.truth(chase.pose_at(behind), 640, 480)
    assert np.array_equal(boxes, truth_boxes)
    assert labels == tuple(chase.scene.labels[i] for i in index.tolist())

"""The picture of each find: the crop taken from the frame, the JPEG bound, and which picture goes out when.

FindImages is sans-I/O (the clock is passed in), so its bounds are checked here on exact times; the
real node publishing to a real broker is tests/integration/test_find_images.py.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from edgerun import wire
from edgerun.config import SwarmImagesConfig
from edgerun.fleet.find_images import (
    SKIP_BYTES_RATE,
    SKIP_FRAME_CAP,
    SKIP_OBJECT_RATE,
    SKIP_TOO_LARGE,
    FindCrop,
    FindCropper,
    FindImages,
    encode_jpeg,
)
from edgerun.types import DetectionBatch, Detections, FrameMeta
from swarm.dedup import Dedup, Observation


def textured(height: int, width: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


def batch_of(boxes: list[list[float]], scores: list[float], labels: tuple[str, ...] = ("face",)) -> DetectionBatch:
    meta = FrameMeta(seq=7, source="test", width=640, height=480, wall_time=1700000000.25, t_capture=0.0)
    det = Detections(
        boxes=np.array(boxes, np.float32),
        scores=np.array(scores, np.float32),
        class_ids=np.zeros(len(scores), np.int32),
    )
    return DetectionBatch("n1", meta, det, labels, "m", 1, "tflite")


def crop_of(score: float, side: int = 64, seed: int = 1) -> FindCrop:
    return FindCrop(textured(side, side, seed), (10.0, 20.0, 30.0, 40.0), score, 1700000000.0)


def test_the_crop_is_the_frames_pixels_around_the_box_with_the_box_drawn():
    frame = textured(480, 640)
    cropper = FindCropper(SwarmImagesConfig(margin=0.5))
    crops = cropper.crop(frame, batch_of([[100, 100, 140, 180]], [0.9]))
    assert crops is not None and list(crops) == [0]
    crop = crops[0]
    # 40 x 80 box, half of each on every side: x 80..160, y 60..220, unscaled (under 320 px)
    assert crop.image is not None and crop.image.shape == (160, 80, 3)
    inside = crop.image[45:115, 25:55]  # well inside the drawn box
    assert np.array_equal(inside, frame[105:175, 105:135])
    assert tuple(crop.image[40, 30]) == (0, 220, 0)  # the box's top edge, drawn
    assert crop.box == (100.0, 100.0, 140.0, 180.0) and crop.score == pytest.approx(0.9)
    assert crop.ts == 1700000000.25
    frame[:] = 0  # the pooled frame is reused: the crop owns its pixels
    assert crop.image[45:115, 25:55].any()


def test_a_large_box_is_shrunk_to_the_longest_side_and_clipped_to_the_frame():
    frame = textured(480, 640)
    crops = FindCropper(SwarmImagesConfig(max_side_px=200)).crop(frame, batch_of([[-50, 0, 600, 470]], [0.8]))
    assert crops is not None
    image = crops[0].image
    assert image is not None and max(image.shape[:2]) == 200 and image.shape[1] == 200


def test_only_the_best_detections_of_a_frame_are_cropped_the_rest_counted():
    frame = textured(480, 640)
    cropper = FindCropper(SwarmImagesConfig(crops_per_frame=2), min_score=0.3)
    boxes = [[10, 10, 50, 50], [100, 10, 150, 50], [200, 10, 250, 50], [300, 10, 350, 50], [400, 10, 450, 50]]
    crops = cropper.crop(frame, batch_of(boxes, [0.5, 0.9, 0.2, 0.7, 0.4]))
    assert crops is not None and sorted(crops) == [1, 3]
    assert (cropper.cropped, cropper.skipped_frame_cap) == (2, 2)  # 0.2 is below min_score: not a find at all


def test_labels_outside_the_swarms_labels_are_not_cropped():
    cropper = FindCropper(SwarmImagesConfig(), labels=["person"])
    assert cropper.crop(textured(480, 640), batch_of([[10, 10, 50, 50]], [0.9], labels=("face",))) is None


def test_quality_is_lowered_until_the_jpeg_fits_and_a_picture_that_cannot_fit_is_none():
    noise = textured(320, 320)
    big = encode_jpeg(noise, 1 << 20)
    small = encode_jpeg(noise, 40_000)
    assert big is not None and small is not None and len(big) > 40_000 >= len(small)
    decoded = cv2.imdecode(np.frombuffer(small, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape == (320, 320, 3)
    assert encode_jpeg(noise, 1000) is None


def test_first_view_goes_out_then_only_a_better_one_after_the_objects_interval():
    images = FindImages(SwarmImagesConfig(better_by=0.05, min_interval_s=10.0), now=0.0)
    first = crop_of(0.60)
    images.offer(1, first)
    due = images.due({"a" * 16: [1]}, 1.0)
    assert due == [("a" * 16, first)]
    first.encode(65536)
    assert images.take("a" * 16, first, 1.0)
    assert images.due({"a" * 16: [1]}, 2.0) == []  # the same picture is not sent twice
    images.offer(1, crop_of(0.62))  # better, but not by 0.05
    assert images.due({"a" * 16: [1]}, 20.0) == []
    better = crop_of(0.70)
    images.offer(1, better)
    assert images.due({"a" * 16: [1]}, 5.0) == []  # within 10 s of the first: held, counted once
    assert images.due({"a" * 16: [1]}, 6.0) == []
    assert images.skipped[SKIP_OBJECT_RATE] == 1
    assert images.due({"a" * 16: [1]}, 11.5) == [("a" * 16, better)]
    better.encode(65536)
    assert images.take("a" * 16, better, 11.5) and images.published == 2


def test_the_total_byte_rate_holds_pictures_back_and_counts_them():
    cfg = SwarmImagesConfig(max_bytes=8192, max_bytes_per_s=1000)
    images = FindImages(cfg, now=0.0)
    crops = []
    for track in range(3):
        crop = crop_of(0.9, side=96, seed=track)
        crop.encode(cfg.max_bytes)
        assert crop.jpeg is not None and crop.image is None
        crops.append(crop)
        images.offer(track, crop)
    sizes = [len(c.jpeg or b"") for c in crops]
    owned = {f"{k:016x}": [k] for k in range(3)}
    sent = [oid for oid, crop in images.due(owned, 0.0) if images.take(oid, crop, 0.0)]
    assert sum(sizes[int(oid, 16)] for oid in sent) <= cfg.max_bytes  # the bucket holds one full picture
    held = [oid for oid in owned if oid not in sent]
    assert held and images.skipped[SKIP_BYTES_RATE] == len(held)
    later = 0.0 + cfg.max_bytes / cfg.max_bytes_per_s  # the bucket is full again
    sent_later = [oid for oid, crop in images.due(owned, later) if images.take(oid, crop, later)]
    assert set(sent_later) <= set(held) and sent_later
    assert images.bytes_published == sum(sizes[int(oid, 16)] for oid in sent + sent_later)


def test_a_picture_that_fits_no_quality_is_dropped_and_counted_once():
    images = FindImages(SwarmImagesConfig(), now=0.0)
    crop = crop_of(0.9, side=300)
    crop.encode(100)
    images.offer(1, crop)
    for now in (1.0, 2.0):
        for oid, c in images.due({"b" * 16: [1]}, now):
            assert not images.take(oid, c, now)
    assert images.skipped[SKIP_TOO_LARGE] == 1 and images.published == 0


def test_tracks_dedup_dropped_lose_their_crops():
    images = FindImages(SwarmImagesConfig(), now=0.0)
    images.offer(1, crop_of(0.9))
    images.forget_tracks({2})
    assert images.due({"c" * 16: [1]}, 1.0) == []


def test_dedup_says_which_track_each_fix_joined():
    dedup = Dedup("n1", now=0.0)
    fixes = [
        Observation("face", 52.0, 4.0, 0.0, 0.5, 0.9),
        Observation("face", float("nan"), 4.0, 0.0, 0.5, 0.9),
        Observation("face", 52.001, 4.0, 0.0, 0.5, 0.8),
    ]
    first = dedup.observe(fixes, 0.0, 100.0)
    assert first[1] is None and first[0] is not None and first[2] is not None and first[0] != first[2]
    again = dedup.observe([Observation("face", 52.001, 4.0, 0.0, 0.5, 0.7)], 0.1, 100.1)
    assert again == [first[2]]
    assert dedup.track_ids() == {first[0], first[2]}
    for obj in dedup.tick(0.2, 100.2):  # hold_s 0: reported at once, owned here
        dedup.published(obj.id)
    owned = dedup.owned_objects()
    assert sorted(t for tracks in owned.values() for t in tracks) == sorted([first[0], first[2]])


def test_image_meta_round_trips_through_user_properties_and_names_what_is_wrong():
    meta = wire.ObjectImageMeta(node="drone-1", score=0.875, box=(1.0, 2.5, 30.0, 44.0), ts=1700000000.125)
    assert wire.ObjectImageMeta.from_properties(meta.to_properties()) == meta
    props = dict(meta.to_properties())
    with pytest.raises(ValueError, match="user property 'box' missing"):
        wire.ObjectImageMeta.from_properties([(k, v) for k, v in props.items() if k != "box"])
    with pytest.raises(ValueError, match="box has 3 numbers, expected 4"):
        wire.ObjectImageMeta.from_properties(list({**props, "box": "1,2,3"}.items()))
    with pytest.raises(ValueError, match="score: Expected `float` <= 1.0"):
        wire.ObjectImageMeta.from_properties(list({**props, "score": "7"}.items()))
    assert wire.object_image_topic("0123456789abcdef") == "edgerun/fleet/objects/0123456789abcdef/image"


def test_frame_cap_reason_is_one_of_the_counted_reasons():
    assert SKIP_FRAME_CAP in FindImages(SwarmImagesConfig(), now=0.0).skipped


def test_the_benchmark_runs_in_a_short_form_and_stays_within_the_bounds():
    from edgerun.bench.find_images import run

    result = run(frames=30)
    assert result["finds"] > 0
    assert 0 < result["bytes_max"] <= result["max_bytes"]
    assert 0 < result["side_px_max"] <= wire.OBJECT_IMAGE_MAX_SIDE_PX

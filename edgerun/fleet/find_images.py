"""The picture of each find: a small JPEG of the owner's best view of a fleet object, bounded and counted.

Three parts, on three threads:

* ``FindCropper`` runs in the pipeline's decode thread, while the frame's pooled slot is still held: it copies
  a crop around each of the frame's best detections (a margin around the box, the box drawn, shrunk so its
  longest side is at most ``max_side_px``) into a small array of its own. Nothing keeps the pooled frame.
* ``FindImages`` (sans-I/O, on the loop, the clock passed in) keeps the best crop of each of this node's
  tracks and decides, for the objects this node owns, which picture goes out now: the first, and then only a
  view better by ``better_by`` in score, at most one per object every ``min_interval_s`` and within
  ``max_bytes_per_s`` for all objects together (a token bucket). A crop a bound holds back is counted.
* ``encode_jpeg`` runs in an executor thread: quality is lowered until the JPEG fits ``max_bytes``.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np

from edgerun import wire
from edgerun.config import SwarmImagesConfig

BOX_COLOUR = (0, 220, 0)  # BGR, as the node's /snapshot.jpg
JPEG_QUALITIES = (85, 70, 55, 40, 25, 10)  # tried in turn until the picture fits
# Best crops kept, one per track, and published pictures remembered: a crop is at most 320 x 320 x 3 bytes until
# it is encoded (then only its JPEG, at most max_bytes, is kept), so 64 of them stay within ~20 MB on a Pi.
MAX_CROPS = 64
MAX_PUBLISHED = 1024

# Why a crop did not go out (the reasons counted in FindImages.skipped and edgerun_find_images_skipped).
SKIP_FRAME_CAP = "frame_cap"  # more detections in a frame than crops_per_frame
SKIP_OBJECT_RATE = "object_rate"  # a better view within min_interval_s of the object's last picture
SKIP_BYTES_RATE = "bytes_rate"  # over max_bytes_per_s for all pictures together
SKIP_TOO_LARGE = "too_large"  # no quality made it fit max_bytes
SKIP_REASONS = (SKIP_FRAME_CAP, SKIP_OBJECT_RATE, SKIP_BYTES_RATE, SKIP_TOO_LARGE)


@dataclass(eq=False)
class FindCrop:
    """One detection's picture, copied out of its frame: owns its pixels (BGR, at most max_side_px a side)."""

    image: np.ndarray | None  # None once encoded: only the JPEG is kept
    box: tuple[float, float, float, float]  # the detection, x0, y0, x1, y1 in source-frame pixels
    score: float
    ts: float  # the frame's capture time, Unix seconds
    jpeg: bytes | None = None  # encoded once, when it is first due (see encode)
    held: set[str] = field(default_factory=set)  # the bounds already counted against it (each counted once)

    def encode(self, max_bytes: int) -> None:
        """Encode the picture (an executor thread: it takes a millisecond or so) and let the pixels go."""
        if self.image is not None:
            self.jpeg = encode_jpeg(self.image, max_bytes)
            self.image = None


class FindCropper:
    """Crops the best detections of a frame (the decode thread; several workers may call it at once)."""

    def __init__(self, cfg: SwarmImagesConfig, *, min_score: float = 0.0, labels: list[str] | None = None) -> None:
        self.cfg = cfg
        self.min_score = min_score
        self.labels = set(labels or ())
        self._lock = threading.Lock()
        self.cropped = 0
        self.skipped_frame_cap = 0

    def crop(self, image: np.ndarray, batch: Any) -> dict[int, FindCrop] | None:
        """Crops of ``batch``'s best detections in ``image`` (its frame), keyed by detection index."""
        det = batch.detections
        if not len(det):
            return None
        keep = det.scores >= self.min_score
        if self.labels:
            keep &= np.array([batch.label_of(c) in self.labels for c in det.class_ids.tolist()], bool)
        idx = np.flatnonzero(keep)
        if not len(idx):
            return None
        cap = self.cfg.crops_per_frame
        over = len(idx) - cap
        if over > 0:
            idx = idx[np.argsort(-det.scores[idx], kind="stable")[:cap]]
        crops = {int(i): self._crop_one(image, det.boxes[i], float(det.scores[i]), batch.meta.wall_time) for i in idx}
        with self._lock:
            self.cropped += len(crops)
            self.skipped_frame_cap += max(0, over)
        return crops

    def _crop_one(self, image: np.ndarray, box: np.ndarray, score: float, ts: float) -> FindCrop:
        height, width = image.shape[:2]
        x0, y0, x1, y1 = (float(v) for v in box)
        bw, bh = max(x1 - x0, 1.0), max(y1 - y0, 1.0)
        margin = self.cfg.margin
        left = int(np.clip(x0 - margin * bw, 0, width - 1))
        top = int(np.clip(y0 - margin * bh, 0, height - 1))
        right = int(np.clip(x1 + margin * bw, left + 1, width))
        bottom = int(np.clip(y1 + margin * bh, top + 1, height))
        region = image[top:bottom, left:right]
        scale = min(1.0, self.cfg.max_side_px / max(region.shape[0], region.shape[1]))
        if scale < 1.0:
            size = (max(1, round(region.shape[1] * scale)), max(1, round(region.shape[0] * scale)))
            out = cv2.resize(region, size, interpolation=cv2.INTER_AREA)  # a new array: the frame is not kept
        else:
            out = region.copy()
        p0 = (round((x0 - left) * scale), round((y0 - top) * scale))
        p1 = (round((x1 - left) * scale) - 1, round((y1 - top) * scale) - 1)
        cv2.rectangle(out, p0, p1, BOX_COLOUR, 1)
        return FindCrop(out, (x0, y0, x1, y1), score, ts)


def encode_jpeg(image: np.ndarray, max_bytes: int) -> bytes | None:
    """The picture as a JPEG of at most ``max_bytes``, quality lowered until it fits; None if none does."""
    for quality in JPEG_QUALITIES:
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
        if ok and buf.size <= max_bytes:
            return bytes(buf.tobytes())
    return None


@dataclass
class _Published:
    crop: weakref.ref[FindCrop]  # the picture that went out (not kept alive for this)
    score: float
    at: float  # monotonic


class FindImages:
    """Which picture of which owned object goes out now (see the module docstring). Sans-I/O."""

    def __init__(self, cfg: SwarmImagesConfig, *, now: float) -> None:
        self.cfg = cfg
        self._best: OrderedDict[int, FindCrop] = OrderedDict()  # track id -> its best crop, least recent first
        self._published: OrderedDict[str, _Published] = OrderedDict()  # object id -> its last picture
        self._tokens = float(self._burst)
        self._refilled = now
        self.published = 0
        self.bytes_published = 0
        self.skipped: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)

    @property
    def _burst(self) -> int:
        # One full-size picture must always fit the bucket, or a large one would never go out.
        return max(self.cfg.max_bytes, self.cfg.max_bytes_per_s)

    def offer(self, track: int, crop: FindCrop) -> None:
        """A crop of one of this node's tracks; kept if it is the track's best so far."""
        best = self._best.get(track)
        if best is None or crop.score > best.score:
            self._best[track] = crop
        self._best.move_to_end(track)
        while len(self._best) > MAX_CROPS:
            self._best.popitem(last=False)

    def forget_tracks(self, live: set[int]) -> None:
        """Drop the crops of tracks dedup no longer holds."""
        for track in [t for t in self._best if t not in live]:
            del self._best[track]

    def due(self, owned: dict[str, list[int]], now: float) -> list[tuple[str, FindCrop]]:
        """The pictures to encode now: per owned object (id -> its tracks here), its best crop if it beats the
        published one by ``better_by`` and the object's interval is over (else it waits, counted once)."""
        out = []
        for object_id, tracks in owned.items():
            crops = [self._best[t] for t in tracks if t in self._best]
            if not crops:
                continue
            crop = max(crops, key=lambda c: c.score)
            last = self._published.get(object_id)
            if last is not None and (crop is last.crop() or crop.score < last.score + self.cfg.better_by):
                continue
            if SKIP_TOO_LARGE in crop.held:
                continue
            if last is not None and now - last.at < self.cfg.min_interval_s:
                self._hold(crop, SKIP_OBJECT_RATE)
                continue
            out.append((object_id, crop))
        return out

    def take(self, object_id: str, crop: FindCrop, now: float) -> bool:
        """After encoding (``crop.jpeg``): whether it goes out now; if so it is the object's published picture."""
        if crop.jpeg is None:
            self._hold(crop, SKIP_TOO_LARGE)
            return False
        self._refill(now)
        size = len(crop.jpeg)
        if size > self._tokens:
            self._hold(crop, SKIP_BYTES_RATE)
            return False
        self._tokens -= size
        self._published[object_id] = _Published(weakref.ref(crop), crop.score, now)
        self._published.move_to_end(object_id)
        while len(self._published) > MAX_PUBLISHED:
            self._published.popitem(last=False)
        self.published += 1
        self.bytes_published += size
        return True

    def _refill(self, now: float) -> None:
        self._tokens = min(float(self._burst), self._tokens + (now - self._refilled) * self.cfg.max_bytes_per_s)
        self._refilled = now

    def _hold(self, crop: FindCrop, reason: str) -> None:
        if reason not in crop.held:
            crop.held.add(reason)
            self.skipped[reason] += 1

    def meta(self, node: str, crop: FindCrop) -> wire.ObjectImageMeta:
        score = min(max(crop.score, 0.0), 1.0)
        return wire.ObjectImageMeta(node=node, score=round(score, 3), box=crop.box, ts=crop.ts)

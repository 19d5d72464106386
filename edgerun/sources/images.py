"""A directory of images or a video file, optionally decoded once into memory.

This is the source of benchmarks and recorded-clip replays: with ``preload``
every frame is decoded once at open, resized to one common size, and ``read``
is a single ``np.copyto`` into the pooled buffer, so what is measured is the
pipeline, not JPEG decoding or disk. Preloading is bounded (1 GiB by default)
and refused with a clear message above that. Without ``preload`` a directory
is decoded file by file and a video plays through ``OpenCvSource``.

Frames share one size (the pipeline's pooled buffers): the first image's, or
``width``/``height``. A directory's images of another shape are letterboxed into
it (scaled to fit, centred, black bars), never stretched, so a detector sees
every photo with its own proportions; each frame names its file in
``FrameMeta.source``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import cv2
import numpy as np

from edgerun.config import SourceConfig
from edgerun.errors import SourceError
from edgerun.sources.base import Source
from edgerun.sources.opencv import OpenCvSource, fit_into, quiet_opencv
from edgerun.types import FrameMeta

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp"})
MAX_PRELOAD_BYTES = 1 << 30


def letterbox_into(frame: np.ndarray, image: np.ndarray) -> None:
    """Copy ``frame`` into ``image`` keeping its aspect ratio: scaled to fit, centred, black bars."""
    if frame.ndim == 2 or frame.shape[2] == 1:
        frame = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
    elif frame.shape[2] == 4:
        frame = cv2.cvtColor(frame, cv2.COLOR_BGRA2BGR)
    h, w = image.shape[:2]
    fh, fw = frame.shape[:2]
    scale = min(w / fw, h / fh)
    new_w, new_h = max(1, min(w, round(fw * scale))), max(1, min(h, round(fh * scale)))
    if (new_w, new_h) == (w, h):
        fit_into(frame, image)
        return
    x, y = (w - new_w) // 2, (h - new_h) // 2
    image[...] = 0
    fit_into(frame, image[y : y + new_h, x : x + new_w])


def _size_text(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


class ImagesSource(Source):
    """Frames from sorted image files or a video file, paced by the capture stage at ``fps``."""

    KEY = "images"
    synthetic_clock = True

    def __init__(
        self,
        path: str | Path,
        *,
        preload: bool = False,
        loop: bool = False,
        width: int = 0,
        height: int = 0,
        fps: float = 0.0,
        max_preload_bytes: int = MAX_PRELOAD_BYTES,
    ) -> None:
        """``width``/``height``: the size frames are resized to (0 for both: the first frame's size)."""
        self.path = Path(path)
        self.preload = preload
        self.loop = loop
        self.requested = (width, height)
        self.fps = fps
        self.max_preload_bytes = max_preload_bytes
        self.skipped = 0  # unreadable image files, each counted once
        self._files: list[Path] = []
        self._frames: list[np.ndarray] = []
        self._video: OpenCvSource | None = None
        self._index = 0
        self._warned = False

    @classmethod
    def from_config(cls, cfg: SourceConfig) -> ImagesSource:
        return cls(cfg.path, preload=cfg.preload, loop=cfg.loop, width=cfg.width, height=cfg.height, fps=cfg.fps)

    # -- open --------------------------------------------------------------------

    def open(self) -> None:
        self.close()
        self._index = 0
        if self.path.is_dir():
            self._files = sorted(p for p in self.path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not self._files:
                kinds = "/".join(sorted(s.lstrip(".") for s in IMAGE_SUFFIXES))
                raise SourceError(f"images: no {kinds} files in {str(self.path)!r}")
            first = self._first_readable()
            self.width, self.height = self._target_size(first.shape[1], first.shape[0])
            if self.preload:
                self._preload_files(first)
        elif self.path.is_file():
            if self.preload:
                self._preload_video()
            else:
                w, h = self.requested
                self._video = OpenCvSource(str(self.path), width=w, height=h, loop=self.loop)
                self._video.open()
                self.width, self.height = self._video.width, self._video.height
                self.fps = self.fps or self._video.fps
        else:
            raise SourceError(f"images: {str(self.path)!r} not found")

    def _target_size(self, native_w: int, native_h: int) -> tuple[int, int]:
        want_w, want_h = self.requested
        if want_w and want_h:
            return want_w, want_h
        if want_w:
            return want_w, max(1, round(native_h * want_w / native_w))
        if want_h:
            return max(1, round(native_w * want_h / native_h)), want_h
        return native_w, native_h

    def _imread(self, path: Path) -> np.ndarray | None:
        with quiet_opencv():
            image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            self.skipped += 1
            if not self._warned:
                self._warned = True
                log.warning("images: skipping unreadable file %s (further ones are counted, not logged)", path)
        return image

    def _first_readable(self) -> np.ndarray:
        """Decode files until one works; unreadable ones are dropped from the list."""
        while self._files:
            image = self._imread(self._files[0])
            if image is not None:
                return image
            self._files.pop(0)
        raise SourceError(f"images: none of the files in {str(self.path)!r} could be read")

    def _check_budget(self, count: int, what: str) -> None:
        need = count * self.width * self.height * 3
        if need > self.max_preload_bytes:
            raise SourceError(
                f"images: preloading {count} {what} of {self.width}x{self.height} from {str(self.path)!r} "
                f"needs {_size_text(need)}, more than the {_size_text(self.max_preload_bytes)} limit; "
                "use preload = false or a smaller width/height"
            )

    def _preload_files(self, first: np.ndarray) -> None:
        self._check_budget(len(self._files), "files")
        block = np.empty((len(self._files), self.height, self.width, 3), np.uint8)
        letterbox_into(first, block[0])
        count = 1
        readable = [self._files[0]]
        for path in self._files[1:]:
            image = self._imread(path)
            if image is None:
                continue
            letterbox_into(image, block[count])
            readable.append(path)
            count += 1
        self._files = readable
        # Views into one block: one allocation, and read() hands out rows by index.
        self._frames = list(block[:count])
        self._log_preloaded()

    def _preload_video(self) -> None:
        with quiet_opencv():
            cap = cv2.VideoCapture(str(self.path))
        try:
            if not cap.isOpened():
                raise SourceError(f"images: video file {str(self.path)!r} could not be opened")
            frames: list[np.ndarray] = []
            while True:
                ok, frame = cap.read()
                if not ok:
                    break
                if not frames:
                    self.width, self.height = self._target_size(frame.shape[1], frame.shape[0])
                self._check_budget(len(frames) + 1, "frames")
                if frame.shape[:2] != (self.height, self.width):
                    resized = np.empty((self.height, self.width, 3), np.uint8)
                    fit_into(frame, resized)
                    frame = resized
                frames.append(frame)
            fps = cap.get(cv2.CAP_PROP_FPS)
        finally:
            cap.release()
        if not frames:
            raise SourceError(f"images: video file {str(self.path)!r} has no readable frame")
        self._frames = frames
        self.fps = self.fps or (float(fps) if 0.0 < fps < 1000.0 else 0.0)
        self._log_preloaded()

    def _log_preloaded(self) -> None:
        nbytes = len(self._frames) * self.width * self.height * 3
        extra = f", skipped {self.skipped} unreadable" if self.skipped else ""
        log.info(
            "images: preloaded %d frames of %dx%d (%s) from %s%s",
            len(self._frames),
            self.width,
            self.height,
            _size_text(nbytes),
            self.path,
            extra,
        )

    def close(self) -> None:
        if self._video is not None:
            self._video.close()
            self._video = None
        self._frames = []

    @property
    def frame_count(self) -> int:
        """Frames per pass: preloaded frames, or image files still believed readable."""
        return len(self._frames) if self._frames else len(self._files)

    # -- frames ------------------------------------------------------------------

    def _meta(self, seq: int, image: np.ndarray, source: Path) -> FrameMeta:
        h, w = image.shape[:2]
        return FrameMeta(
            seq=seq, source=str(source), width=w, height=h, wall_time=time.time(), t_capture=time.monotonic()
        )

    def read(self, image: np.ndarray, seq: int) -> FrameMeta | None:
        if self._video is not None:
            meta = self._video.read(image, seq)
            if meta is not None:
                meta.source = str(self.path)
            return meta
        if self._frames:
            if self._index >= len(self._frames):
                if not self.loop:
                    return None
                self._index = 0
            fit_into(self._frames[self._index], image)
            # Preloaded files are named by file; a preloaded video by its path.
            source = self._files[self._index] if self._files else self.path
            self._index += 1
            return self._meta(seq, image, source)
        return self._read_file(image, seq)

    def skip(self, count: int) -> int:
        if self._video is not None:
            return self._video.skip(count)
        total = self.frame_count
        done = 0
        while done < count and total:
            if self._index >= total:
                if not self.loop:
                    break
                self._index = 0
            step = min(count - done, total - self._index)
            self._index += step
            done += step
        return done

    def _read_file(self, image: np.ndarray, seq: int) -> FrameMeta | None:
        """Decode the next readable file; a file that fails is dropped from the cycle."""
        while self._files:
            if self._index >= len(self._files):
                if not self.loop:
                    return None
                self._index = 0
            decoded = self._imread(self._files[self._index])
            if decoded is None:
                self._files.pop(self._index)
                continue
            path = self._files[self._index]
            self._index += 1
            letterbox_into(decoded, image)
            return self._meta(seq, image, path)
        raise SourceError(f"images: none of the files in {str(self.path)!r} can be read any more")

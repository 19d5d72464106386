"""Cameras, streams and video files through ``cv2.VideoCapture``, read into the caller's buffer.

One ``uri`` says what to open:

* ``"0"`` or ``"/dev/video0"``: a V4L2 camera (on Linux; the default back end elsewhere);
* ``rtsp://``, ``rtsps://``, ``rtmp://``, ``http(s)://``, ``udp://``, ``tcp://``, ``srt://``:
  a network stream through FFmpeg, with short open/read timeouts so a dead
  camera fails in seconds instead of blocking the capture thread;
* anything containing ``!``: a GStreamer pipeline (``appsink`` is appended if missing);
* anything else: a video file.

A live source that stops delivering raises ``SourceError`` so the capture stage
reopens it with backoff; a file ends with ``None`` or, with ``loop``, rewinds.
Frames go straight into the pooled buffer with ``cap.read(image)``; when the
device delivers another size than the buffer, it reads into one scratch frame
and resizes into the buffer, so steady state allocates nothing either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Iterator

import cv2
import numpy as np

from edgerun.config import SourceConfig
from edgerun.errors import SourceError
from edgerun.sources.base import Source
from edgerun.types import FrameMeta

log = logging.getLogger(__name__)

STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "udp", "tcp", "srt")
# Bounds how long a dead network camera can hold the capture thread in open() or read().
STREAM_TIMEOUT_MS = 5000
_DEVICE_PATH = re.compile(r"^/dev/video\d+$")
_URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://")
_USERINFO = re.compile(r"(?<=://)[^/@]*@")


def redact(uri: str) -> str:
    """The uri with any ``user:password@`` removed, for messages and logs."""
    return _USERINFO.sub("***@", uri)


@contextlib.contextmanager
def quiet_opencv() -> Iterator[None]:
    """Silence OpenCV's own WARN lines around open: our SourceError already says it, in one line.

    The level is process-wide, so it is lowered only for the duration of the call.
    """
    try:
        previous = cv2.utils.logging.getLogLevel()
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    except (AttributeError, cv2.error):  # pragma: no cover - builds without the logging module
        yield
        return
    try:
        yield
    finally:
        cv2.utils.logging.setLogLevel(previous)


def fit_into(frame: np.ndarray, image: np.ndarray) -> None:
    """Copy ``frame`` into ``image``, resizing (and converting grey to BGR) when they differ."""
    if frame.shape == image.shape:
        np.copyto(image, frame)
        return
    if frame.ndim == 2 or frame.shape[2] == 1:
        frame = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
    elif frame.shape[2] == 4:
        frame = cv2.cvtColor(frame, cv2.COLOR_BGRA2BGR)
    h, w = image.shape[:2]
    if frame.shape[:2] == (h, w):
        np.copyto(image, frame)
        return
    # Shrinking: INTER_AREA averages (no aliasing); enlarging: bilinear.
    interp = cv2.INTER_AREA if frame.shape[0] > h or frame.shape[1] > w else cv2.INTER_LINEAR
    cv2.resize(frame, (w, h), dst=image, interpolation=interp)


class OpenCvSource(Source):
    """A V4L2 camera, network stream, GStreamer pipeline or video file."""

    KEY = "opencv"

    def __init__(self, uri: str, *, width: int = 0, height: int = 0, loop: bool = False) -> None:
        """``width``/``height``: the size asked of a camera and the size of the frames handed out (0: native)."""
        self.uri = uri
        self.requested = (width, height)
        self.loop = loop
        self.kind, self._target, self._api = self._classify(uri)
        # A recorded file decodes faster than real time: let the capture stage pace it at source.fps.
        self.synthetic_clock = self.kind == "file"
        self.description = self._describe()
        self._cap: cv2.VideoCapture | None = None
        self._frame_shape: tuple[int, ...] = ()
        self._scratch: np.ndarray | None = None
        self._pending: np.ndarray | None = None
        self._file_stamp: tuple[int, int] | None = None  # (size, mtime) of a file when opened

    @classmethod
    def from_config(cls, cfg: SourceConfig) -> OpenCvSource:
        return cls(cfg.uri, width=cfg.width, height=cfg.height, loop=cfg.loop)

    # -- what the uri names ------------------------------------------------------

    @staticmethod
    def _classify(uri: str) -> tuple[str, str | int, int]:
        """(kind, what to pass to VideoCapture, back end) for a uri."""
        linux = sys.platform.startswith("linux")
        v4l2 = cv2.CAP_V4L2 if linux else cv2.CAP_ANY
        text = uri.strip()
        if text.isdigit():
            return "camera", int(text), v4l2
        if _DEVICE_PATH.match(text):
            return "camera", text, v4l2
        if "!" in text:
            if "appsink" not in text:
                # Newest frame only: a slow consumer must not build up latency inside GStreamer.
                text += " ! videoconvert ! video/x-raw,format=BGR ! appsink drop=true max-buffers=1 sync=false"
            return "pipeline", text, cv2.CAP_GSTREAMER
        m = _URL.match(text)
        if m and m.group("scheme").lower() in STREAM_SCHEMES:
            return "stream", text, cv2.CAP_FFMPEG
        return "file", text, cv2.CAP_ANY

    def _describe(self) -> str:
        shown = redact(self.uri)
        if self.kind == "camera":
            backend = "v4l2" if self._api == cv2.CAP_V4L2 else "default back end"
            return f"camera {shown!r} ({backend})"
        if self.kind == "stream":
            return f"stream {shown!r} (ffmpeg)"
        if self.kind == "pipeline":
            return f"pipeline {shown!r} (gstreamer)"
        return f"video file {shown!r}"

    @property
    def live(self) -> bool:
        """True for devices and streams: there a failed read means the source is gone, not finished."""
        return self.kind != "file"

    # -- open/close --------------------------------------------------------------

    def _capture(self) -> cv2.VideoCapture:
        params: list[int] = []
        if self.kind == "stream":
            for name in ("CAP_PROP_OPEN_TIMEOUT_MSEC", "CAP_PROP_READ_TIMEOUT_MSEC"):
                prop = getattr(cv2, name, None)
                if prop is not None:
                    params += [prop, STREAM_TIMEOUT_MS]
        with quiet_opencv():
            try:
                return cv2.VideoCapture(self._target, self._api, params)
            except cv2.error as err:
                raise SourceError(f"{self.description} could not be opened ({err.err or err})") from None

    def open(self) -> None:
        self.close()
        if self.kind == "file":
            self._file_stamp = self._stamp()
            if self._file_stamp is None:
                raise SourceError(f"{self.description} not found")
        if self.kind == "pipeline" and not cv2.videoio_registry.hasBackend(cv2.CAP_GSTREAMER):
            raise SourceError(f"{self.description} could not be opened: this OpenCV is built without GStreamer")
        cap = self._capture()
        if not cap.isOpened():
            cap.release()
            raise SourceError(f"{self.description} could not be opened")
        want_w, want_h = self.requested
        if self.kind == "camera":
            # Newest frame first: a deep driver queue would add latency, never information.
            cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
            if want_w and want_h:
                cap.set(cv2.CAP_PROP_FRAME_WIDTH, want_w)
                cap.set(cv2.CAP_PROP_FRAME_HEIGHT, want_h)
        native_w = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
        native_h = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if native_w <= 0 or native_h <= 0:
            # Some streams only know their size after the first frame; keep that frame for read().
            ok, first = cap.read()
            if not ok:
                cap.release()
                raise SourceError(f"{self.description} opened but delivered no frame")
            self._pending = first
            native_h, native_w = first.shape[:2]
        self._cap = cap
        self._frame_shape = (native_h, native_w, 3)
        if want_w and want_h:
            self.width, self.height = want_w, want_h
        elif want_w:
            self.width, self.height = want_w, max(1, round(native_h * want_w / native_w))
        elif want_h:
            self.width, self.height = max(1, round(native_w * want_h / native_h)), want_h
        else:
            self.width, self.height = native_w, native_h
        fps = cap.get(cv2.CAP_PROP_FPS)
        self.fps = float(fps) if 0.0 < fps < 1000.0 else 0.0
        log.info(
            "opened %s (%s): %dx%d delivered as %dx%d, %.1f fps",
            self.description,
            cap.getBackendName(),
            native_w,
            native_h,
            self.width,
            self.height,
            self.fps,
        )

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None
        self._pending = None
        self._scratch = None

    # -- frames ------------------------------------------------------------------

    def skip(self, count: int) -> int:
        """``grab()`` without ``retrieve()``: a file still decodes (later frames depend on earlier
        ones) but skips the colour conversion and copy."""
        if self._cap is None:
            raise SourceError(f"{self.description} is not open")
        done = 0
        if self._pending is not None and count:
            self._pending = None
            done = 1
        rewound = False
        while done < count:
            if self._cap.grab():
                done += 1
                rewound = False
                continue
            if self.live or not self.loop or rewound or not self._rewind():
                break
            rewound = True  # a rewound file that still has no frame ends the skip
        return done

    def _read_into(self, image: np.ndarray) -> bool:
        """One frame into ``image``; False when the capture has none."""
        assert self._cap is not None
        if self._pending is not None:
            frame, self._pending = self._pending, None
            fit_into(frame, image)
            return True
        target = image if self._frame_shape == image.shape else self._scratch
        ok, frame = self._cap.read(target)
        if not ok or frame is None:
            return False
        if frame is not image:
            # Another size than the buffer (or it changed): keep this array as the scratch
            # frame, so the next read decodes into it instead of allocating again.
            self._frame_shape = frame.shape
            self._scratch = frame if frame.shape != image.shape else None
            fit_into(frame, image)
        return True

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(str(self._target))
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None

    def _rewind(self) -> bool:
        """Back to the first frame of a file, re-reading it from disk if it changed while playing.

        A removed file is an error (the capture stage then reopens it with backoff
        and reports it missing); a replaced or truncated one plays from its new
        content, not from what the demuxer still has buffered.
        """
        assert self._cap is not None
        stamp = self._stamp()
        if stamp is None:
            raise SourceError(f"{self.description} was removed while playing")
        if stamp == self._file_stamp and self._cap.set(cv2.CAP_PROP_POS_FRAMES, 0):
            return True
        self._cap.release()
        self._file_stamp = stamp
        self._frame_shape = ()  # unknown until the first frame of the new content
        self._cap = self._capture()
        return self._cap.isOpened()

    def read(self, image: np.ndarray, seq: int) -> FrameMeta | None:
        if self._cap is None:
            raise SourceError(f"{self.description} is not open")
        if not self._read_into(image):
            if self.live:
                raise SourceError(f"{self.description} stopped delivering frames")
            if not self.loop:
                return None
            if not (self._rewind() and self._read_into(image)):
                raise SourceError(f"{self.description} has no readable frame after rewinding")
        h, w = image.shape[:2]
        return FrameMeta(
            seq=seq,
            source=redact(self.uri),
            width=w,
            height=h,
            wall_time=time.time(),
            t_capture=time.monotonic(),
        )

"""Cameras, streams and video files through ``cv2.VideoCapture``, read into the caller's buffer.

One ``uri`` says what to open:

* ``"0"`` or ``"/dev/video0"``: a V4L2 camera (on Linux; the default back end elsewhere);
* ``rtsp://``, ``rtsps://``, ``rtmp://``, ``http(s)://``, ``udp://``, ``tcp://``, ``srt://``:
  a network stream through FFmpeg, with short open/read timeouts so a dead
  camera fails in seconds instead of blocking the capture thread, and RTSP over
  the configured transport (``OPENCV_FFMPEG_CAPTURE_OPTIONS``, set for each open);
* anything containing ``!`` (or ``source.pipeline``): a GStreamer pipeline
  (``appsink`` is appended if missing);
* anything else: a video file.

Credentials in a URL (``rtsp://user:password@host/...``) never reach a log
line, a health reason or a payload: everything shown goes through ``redact``.
FFmpeg's own log lines (``[tcp @ 0x...] Connection ... failed``) are kept out of
the journal; a failed open says why in one line instead, from a short TCP
connect of its own.

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
import urllib.parse
from collections.abc import Iterator

import cv2
import numpy as np

from edgerun.config import SourceConfig
from edgerun.errors import SourceError
from edgerun.reachability import tcp_problem
from edgerun.sources.base import Source
from edgerun.types import FrameMeta

log = logging.getLogger(__name__)

# FFmpeg's log level is read once, when OpenCV first loads FFmpeg: quiet by default (a failed open would
# print "[tcp @ 0x...] Connection to tcp://... failed" to stderr). Set OPENCV_FFMPEG_LOGLEVEL to see them.
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # AV_LOG_QUIET
CAPTURE_OPTIONS_ENV = "OPENCV_FFMPEG_CAPTURE_OPTIONS"

STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "udp", "tcp", "srt")
_DEVICE_PATH = re.compile(r"^/dev/video\d+$")
_URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://")
# Up to the last "@" before the path: a password with a raw "@" in it is hidden whole.
_USERINFO = re.compile(r"(?<=://)(?P<user>[^/@:]*)(?P<secret>:[^/]*)?@")


def redact(uri: str) -> str:
    """The uri with the password of ``user:password@`` hidden (``user:***@``), for messages, logs and payloads;
    a lone ``token@`` is hidden whole (it is the secret)."""
    return _USERINFO.sub(lambda m: f"{m['user']}:***@" if m["secret"] is not None else "***@", uri)


def capture_options(transport: str, inherited: str | None) -> str:
    """The ``OPENCV_FFMPEG_CAPTURE_OPTIONS`` value for an open: ``key;value`` pairs joined by ``|``.

    OpenCV asks FFmpeg for RTSP over TCP only when the variable is unset, so it is always set here: with
    ``rtsp_transport`` from ``source.transport`` (none for "auto": FFmpeg then tries UDP, then TCP), followed by
    whatever the operator set in the environment (later pairs win, so theirs override ours).
    """
    pairs = [] if transport == "auto" else [f"rtsp_transport;{transport}"]
    if inherited:
        pairs.append(inherited)
    return "|".join(pairs)


# Where a URL without a port connects (FFmpeg's defaults); srt, udp and tcp URLs always name one.
DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322, "rtmp": 1935, "http": 80, "https": 443}


def stream_endpoint(uri: str) -> tuple[str, int] | None:
    """(host, port) a network stream's URL connects to, or None when it names none (or no known port)."""
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower())
    except ValueError:
        return None
    if not parts.hostname or not port:
        return None
    return parts.hostname, port


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

    def __init__(
        self,
        uri: str,
        *,
        width: int = 0,
        height: int = 0,
        loop: bool = False,
        pipeline: bool = False,
        transport: str = "tcp",
        open_timeout_s: float = 5.0,
        read_timeout_s: float = 5.0,
    ) -> None:
        """``width``/``height``: the size asked of a camera and the size of the frames handed out (0: native);
        ``pipeline``: ``uri`` is a GStreamer pipeline even without a ``!``; ``transport`` and the timeouts apply
        to network streams."""
        self.uri = uri
        self.requested = (width, height)
        self.loop = loop
        self.transport = transport
        self.open_timeout_s = open_timeout_s
        self.read_timeout_s = read_timeout_s
        self.kind, self._target, self._api = self._classify(uri, pipeline)
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
        return cls(
            cfg.pipeline or cfg.uri,
            width=cfg.width,
            height=cfg.height,
            loop=cfg.loop,
            pipeline=bool(cfg.pipeline),
            transport=cfg.transport,
            open_timeout_s=cfg.open_timeout_s,
            read_timeout_s=cfg.read_timeout_s,
        )

    # -- what the uri names ------------------------------------------------------

    @staticmethod
    def _classify(uri: str, pipeline: bool = False) -> tuple[str, str | int, int]:
        """(kind, what to pass to VideoCapture, back end) for a uri."""
        linux = sys.platform.startswith("linux")
        v4l2 = cv2.CAP_V4L2 if linux else cv2.CAP_ANY
        text = uri.strip()
        if not pipeline and text.isdigit():
            return "camera", int(text), v4l2
        if not pipeline and _DEVICE_PATH.match(text):
            return "camera", text, v4l2
        if pipeline or "!" in text:
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
            for name, seconds in (
                ("CAP_PROP_OPEN_TIMEOUT_MSEC", self.open_timeout_s),
                ("CAP_PROP_READ_TIMEOUT_MSEC", self.read_timeout_s),
            ):
                prop = getattr(cv2, name, None)
                if prop is not None:
                    params += [prop, max(1, round(seconds * 1000))]
        with self._stream_options(), quiet_opencv():
            try:
                return cv2.VideoCapture(self._target, self._api, params)
            except cv2.error as err:
                raise SourceError(f"{self.description} could not be opened ({redact(str(err.err or err))})") from None

    @contextlib.contextmanager
    def _stream_options(self) -> Iterator[None]:
        """``OPENCV_FFMPEG_CAPTURE_OPTIONS`` for this stream while it opens (OpenCV reads it at each open; only
        the capture thread opens, so setting it for the call is safe), then as it was."""
        if self.kind != "stream":
            yield
            return
        inherited = os.environ.get(CAPTURE_OPTIONS_ENV)
        os.environ[CAPTURE_OPTIONS_ENV] = capture_options(self.transport, inherited)
        try:
            yield
        finally:
            if inherited is None:
                os.environ.pop(CAPTURE_OPTIONS_ENV, None)
            else:
                os.environ[CAPTURE_OPTIONS_ENV] = inherited

    def why_not_open(self) -> str:
        """A short reason a stream did not open, found with a TCP connect of our own (FFmpeg's is not logged)."""
        endpoint = stream_endpoint(str(self._target)) if self.kind == "stream" else None
        if endpoint is None:
            return ""
        problem = tcp_problem(*endpoint, timeout_s=min(self.open_timeout_s, 2.0))
        where = f"{endpoint[0]}:{endpoint[1]}"
        return problem or f"{where} answers, but the stream did not open (check its path and credentials)"

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
            why = self.why_not_open()
            raise SourceError(f"{self.description} could not be opened" + (f": {why}" if why else ""))
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

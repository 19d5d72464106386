"""Start, kill and restart the real RTSP camera (tests/integration/rtsp_server.py) from a test."""

from __future__ import annotations

import selectors
import signal
import subprocess
import time
from pathlib import Path

import pytest

SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-gi; the venv cannot import gi
SERVER_SCRIPT = Path(__file__).with_name("rtsp_server.py")


def require_rtsp_server() -> None:
    """Skip, saying what to install, where GStreamer's RTSP server is not on this machine."""
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import gi; gi.require_version('GstRtspServer', '1.0')"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip("GStreamer's RTSP server is missing: run .ci/install-system-deps (gir1.2-gst-rtsp-server-1.0)")


class RtspCamera:
    """One still image served as H.264 over RTSP on 127.0.0.1:``port``, behind basic authentication."""

    def __init__(self, port: int, image: Path, user: str, password: str, fps: int = 15) -> None:
        self.port, self.image, self.user, self.password, self.fps = port, image, user, password, fps
        self.proc: subprocess.Popen[str] | None = None

    def url(self, password: str | None = None) -> str:
        return f"rtsp://{self.user}:{self.password if password is None else password}@127.0.0.1:{self.port}/cam"

    def start(self, timeout: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, str(SERVER_SCRIPT), "--port", str(self.port), "--image", str(self.image)]
            + ["--user", self.user, "--password", self.password, "--fps", str(self.fps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if sel.select(timeout=0.2):
                    line = self.proc.stdout.readline()
                    if line.strip() == "READY":
                        return
                    if not line:
                        break
        raise AssertionError(f"RTSP server did not start (exit {self.proc.poll()})")

    def kill(self) -> None:
        """SIGKILL: the camera vanishes mid-stream without a TEARDOWN, like a power cut."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    stop = kill

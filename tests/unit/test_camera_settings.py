"""Network camera settings of ``[source]``: transport, timeouts, GStreamer pipelines, credentials kept out of sight.

The stream opens here go to a real closed or silent port on loopback; the node against a real RTSP server is
tests/integration/test_rtsp_camera.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import cv2
import pytest

from edgerun.config import parse_config
from edgerun.errors import ConfigError, SourceError
from edgerun.preflight import check_inputs
from edgerun.sources import make_source
from edgerun.sources.opencv import OpenCvSource, capture_options, redact, stream_endpoint
from edgerun.testing.ports import LOOPBACK, free_port


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("rtsp://admin:s3cret@10.0.0.5:554/stream1", "rtsp://admin:***@10.0.0.5:554/stream1"),
        ("rtsp://token123@cam.local/live", "rtsp://***@cam.local/live"),
        ("rtsp://admin:@cam/live", "rtsp://admin:***@cam/live"),
        ("rtsp://admin:p@ss:w@rd@cam:554/live", "rtsp://admin:***@cam:554/live"),
        ("rtsp://cam.local:8554/live", "rtsp://cam.local:8554/live"),
        ("http://u:p@a/x http://v:q@b/y", "http://u:***@a/x http://v:***@b/y"),
        ("/dev/video0", "/dev/video0"),
    ],
)
def test_redact_hides_the_password_and_keeps_the_user(uri, shown):
    assert redact(uri) == shown


def test_capture_options_set_the_transport_and_keep_the_operators_own():
    assert capture_options("tcp", None) == "rtsp_transport;tcp"
    assert capture_options("udp", None) == "rtsp_transport;udp"
    # auto: set, but without a transport (unset, OpenCV would force TCP itself).
    assert capture_options("auto", None) == ""
    assert capture_options("tcp", "stimeout;2000000|buffer_size;1024000") == (
        "rtsp_transport;tcp|stimeout;2000000|buffer_size;1024000"
    )


def test_stream_endpoint_defaults_the_port_by_scheme():
    assert stream_endpoint("rtsp://u:p@10.0.0.5/x") == ("10.0.0.5", 554)
    assert stream_endpoint("rtsp://cam:8554/x") == ("cam", 8554)
    assert stream_endpoint("srt://cam/x") is None  # no port we could guess
    assert stream_endpoint("rtsp://cam:99999/x") is None


def test_source_settings_reach_the_opencv_source():
    cfg = parse_config(
        {
            "source": {
                "kind": "opencv",
                "uri": "rtsp://cam/live",
                "transport": "udp",
                "open_timeout_s": 2.5,
                "read_timeout_s": 1.5,
            }
        }
    )
    src = make_source(cfg.source)
    assert isinstance(src, OpenCvSource)
    assert (src.kind, src.transport, src.open_timeout_s, src.read_timeout_s) == ("stream", "udp", 2.5, 1.5)
    piped = make_source(parse_config({"source": {"kind": "opencv", "pipeline": "videotestsrc"}}).source)
    assert isinstance(piped, OpenCvSource) and piped.kind == "pipeline"
    assert str(piped._target).startswith("videotestsrc ! videoconvert")


@pytest.mark.parametrize("key", ["pipeline", "uri"])
def test_a_gstreamer_pipeline_without_gstreamer_stops_the_start_in_one_line(key):
    cfg = parse_config({"source": {"kind": "opencv", key: "videotestsrc ! appsink"}})
    if cv2.videoio_registry.hasBackend(cv2.CAP_GSTREAMER):
        check_inputs(cfg)  # this OpenCV has GStreamer: nothing to say
        return
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg)
    message = str(err.value)
    assert message.startswith(f"source.{key}: a GStreamer pipeline needs an OpenCV built with GStreamer")
    assert "\n" not in message


def test_a_refused_stream_says_so_in_one_line_without_the_password():
    port = free_port()  # nothing listens there
    src = OpenCvSource(f"rtsp://admin:s3cret@{LOOPBACK}:{port}/live", open_timeout_s=2.0)
    with pytest.raises(SourceError) as err:
        src.open()
    assert str(err.value) == (
        f"stream 'rtsp://admin:***@{LOOPBACK}:{port}/live' (ffmpeg) could not be opened: connection refused"
    )


def test_a_silent_server_times_out_at_the_open_timeout():
    """A port that accepts but never answers RTSP: the open gives up (the open timeout), the reason says so."""
    with socket.socket() as server:
        port = free_port()
        server.bind((LOOPBACK, port))
        server.listen(4)
        src = OpenCvSource(f"rtsp://{LOOPBACK}:{port}/live", open_timeout_s=1.0)
        with pytest.raises(SourceError, match=r"opened: 127.0.0.1:\d+ answers, but the stream did not open \(check"):
            src.open()


def test_ffmpegs_own_lines_stay_out_of_stderr_on_a_failed_open():
    """FFmpeg prints "[tcp @ 0x...] Connection to tcp://... failed" on stderr by default; the node must not."""
    port = free_port()
    script = textwrap.dedent(
        f"""
        from edgerun.errors import SourceError
        from edgerun.sources.opencv import OpenCvSource
        try:
            OpenCvSource("rtsp://admin:s3cret@{LOOPBACK}:{port}/live").open()
        except SourceError as err:
            print(err)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "connection refused" in done.stdout
    assert "[tcp @" not in done.stderr and "s3cret" not in done.stderr + done.stdout, done.stderr
    assert "WARN" not in done.stderr, done.stderr


@pytest.mark.parametrize("operators", [None, "buffer_size;1024000"])
def test_the_capture_options_are_set_for_the_open_only(monkeypatch, operators):
    """The variable is the process's: after an open (failed here) it is as the operator left it."""
    if operators is None:
        monkeypatch.delenv("OPENCV_FFMPEG_CAPTURE_OPTIONS", raising=False)
    else:
        monkeypatch.setenv("OPENCV_FFMPEG_CAPTURE_OPTIONS", operators)
    with pytest.raises(SourceError, match="connection refused"):
        OpenCvSource(f"rtsp://{LOOPBACK}:{free_port()}/live", transport="udp").open()
    assert os.environ.get("OPENCV_FFMPEG_CAPTURE_OPTIONS") == operators

"""``edgerun doctor`` says which video back ends the OpenCV in use has (GStreamer for Jetson CSI cameras)."""

from __future__ import annotations

import json
import subprocess
import sys

import cv2

from edgerun import doctor

# Build information of JetPack 6's system OpenCV 4.8 (the Video I/O block; other blocks cut).
JETPACK_OPENCV = """
  Video I/O:
    DC1394:                      YES (2.2.6)
    FFMPEG:                      YES
      avcodec:                   YES (58.134.100)
    GStreamer:                   YES (1.20.3)
    v4l/v4l2:                    YES (linux/videodev2.h)
"""
NO_VIDEO = """
  Video I/O:
    GStreamer:                   NO
    v4l/v4l2:                    NO
"""


def test_build_information_is_read_per_back_end():
    assert doctor.opencv_video_io(JETPACK_OPENCV) == {"gstreamer": True, "v4l2": True, "ffmpeg": True}
    assert doctor.opencv_video_io(NO_VIDEO) == {"gstreamer": False, "v4l2": False, "ffmpeg": False}


def test_doctor_reports_the_opencv_in_use():
    video = doctor.doctor_report()["opencv_video_io"]
    assert video["version"] == cv2.__version__
    # The real build here: each answer must match what this OpenCV says about itself.
    info = cv2.getBuildInformation()
    assert video["gstreamer"] == ("GStreamer:                   YES" in info)
    assert video["v4l2"] == ("v4l/v4l2:                    YES" in info)


def test_a_jetson_without_gstreamer_gets_the_system_opencv_hint(monkeypatch, tmp_path):
    release = tmp_path / "nv_tegra_release"
    release.write_text("# R36 (release), REVISION: 4.3\n")
    monkeypatch.setattr(doctor, "JETSON_RELEASE_FILE", release)
    monkeypatch.setattr(cv2, "getBuildInformation", lambda: NO_VIDEO)
    assert "--system-site-packages" in doctor.probe_opencv()["hint"]
    monkeypatch.setattr(cv2, "getBuildInformation", lambda: JETPACK_OPENCV)
    assert "hint" not in doctor.probe_opencv()


def test_doctor_command_prints_the_video_back_ends():
    proc = subprocess.run([sys.executable, "-m", "edgerun", "doctor"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "video I/O:" in line)
    assert "gstreamer " in line and "v4l2 " in line
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert set(json.loads(proc.stdout)["opencv_video_io"]) >= {"gstreamer", "v4l2", "ffmpeg", "version"}

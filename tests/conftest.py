"""Shared fixtures: the real demo models (fetched once, sha256-checked), real photos, free ports."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# Subprocess nodes started by tests find the same cached bundles.
os.environ.setdefault("EDGERUN_CACHE", str(REPO / ".cache"))


@pytest.fixture(scope="session")
def blazeface_bundle():
    from edgerun.models.demo import ensure_demo_bundle

    return ensure_demo_bundle("blazeface_short")


@pytest.fixture(scope="session")
def pose_bundle():
    from edgerun.models.demo import ensure_demo_bundle

    return ensure_demo_bundle("pose_detector")


@pytest.fixture(scope="session")
def blazeface_tflite(blazeface_bundle) -> Path:
    return blazeface_bundle.variant_path("tflite")


@pytest.fixture(scope="session")
def pose_tflite(pose_bundle) -> Path:
    return pose_bundle.variant_path("tflite")


@pytest.fixture(scope="session")
def astronaut_rgb() -> np.ndarray:
    from skimage import data

    return data.astronaut()


@pytest.fixture(scope="session")
def camera_rgb() -> np.ndarray:
    from skimage import data

    gray = data.camera()
    return np.repeat(gray[:, :, None], 3, axis=2)


@pytest.fixture
def no_thread_left_behind():
    """Fails the test if it leaves a thread running (given a moment to wind down)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()

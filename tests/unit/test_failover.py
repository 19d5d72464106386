"""Failover: real failures at open, injected faults mid-stream, switch-back, breadcrumbs, the watched worker.

The accelerator in the mid-stream tests is the real BlazeFace TFLite engine
wrapped in ``FaultInjectingEngine`` (a documented test tool) under the key
"accel"; the fallback is the real CPU TFLite engine. Waits are generous and
nothing asserts on speed: this runs on a small shared machine.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.config import EngineConfig, parse_config
from edgerun.engines.base import EngineOptions
from edgerun.engines.breadcrumb import RECORD, Breadcrumbs, read_inflight
from edgerun.engines.factory import build_runtime, open_failover
from edgerun.engines.failover import ABSENT, BROKEN, FAILED, READY, Failover, FailoverSettings
from edgerun.engines.runtime import FrameLost
from edgerun.engines.tflite import TFLiteEngine
from edgerun.engines.worker import EngineHang, EngineWorker
from edgerun.errors import ConfigError
from edgerun.models.bundle import load_bundle
from edgerun.pipeline.runner import Pipeline, PipelineSettings
from edgerun.pipeline.serving import ServingController
from edgerun.pipeline.stats import PipelineStats
from edgerun.service.health import Health
from edgerun.sources.images import ImagesSource
from edgerun.testing.faults import FaultInjectingEngine, FaultPlan, InjectedFault
from edgerun.types import DetectionBatch

WAIT_S = 30.0  # generous: the test machine is small and shared


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[float, DetectionBatch]] = []
        self.events: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def on_batch(self, batch: DetectionBatch) -> None:
        with self.lock:
            self.batches.append((time.monotonic(), batch))

    def on_event(self, kind: str, data: dict) -> None:
        with self.lock:
            self.events.append((kind, data))

    def engines_since(self, t: float) -> list[str]:
        with self.lock:
            return [b.engine for ts, b in self.batches if ts >= t]

    def wait_for_engine(self, key: str, since: float, count: int = 3) -> None:
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            if self.engines_since(since).count(key) >= count:
                return
            time.sleep(0.02)
        raise AssertionError(f"no batches from {key} since t={since}: {self.engines_since(since)[-10:]}")

    def event_names(self) -> list[str]:
        with self.lock:
            return [d["event"] for kind, d in self.events if kind == "engine"]


@pytest.fixture
def photo(astronaut_rgb) -> np.ndarray:
    return cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR)


@pytest.fixture
def photo_dir(tmp_path, photo) -> Path:
    """The astronaut photo (one real face) as a directory the real images source replays."""
    folder = tmp_path / "photo"
    folder.mkdir()
    cv2.imwrite(str(folder / "astronaut.png"), photo)
    return folder


def accel_failover(bundle, plan: FaultPlan, frame_size, settings, health=None, on_event=None, crumbs=None):
    """Candidates "accel" (TFLite behind the fault injector) then the CPU "tflite" last resort."""

    def open_runtime(key: str):
        engine = TFLiteEngine(bundle.variant_path("tflite"), EngineOptions(num_threads=1))
        if key != "tflite":
            engine = FaultInjectingEngine(engine, plan, key=key)
        return build_runtime(bundle, engine, frame_size)

    return Failover(["accel"], open_runtime, settings, health=health, on_event=on_event, breadcrumbs=crumbs)


class Running:
    """A pipeline served by a failover, started and stopped around a test."""

    def __init__(self, bundle, photo_dir: Path, settings: FailoverSettings, crumbs=None) -> None:
        self.plan = FaultPlan()
        self.health = Health()
        self.rec = Recorder()
        self.stats = PipelineStats()
        source = ImagesSource(photo_dir, preload=True, loop=True)
        source.open()
        self.failover = accel_failover(
            bundle, self.plan, (source.width, source.height), settings, self.health, self.rec.on_event, crumbs
        )
        runtime = self.failover.start()
        self.serving = ServingController()
        self.pipeline = Pipeline(
            node_id="t",
            source=source,
            runtime=runtime,
            on_batch=self.rec.on_batch,
            settings=PipelineSettings(queue_depth=1, policy="drop_oldest", pace_fps=60.0),
            health=self.health,
            stats=self.stats,
            infer_guard=self.serving,
        )
        self.serving.serve(self.pipeline, self.failover)
        self.pipeline.start()

    def lost(self) -> int:
        return sum(n for (stage, reason), n in self.stats.dropped.items() if stage == "infer")

    def stop(self) -> None:
        self.plan.clear()  # release a hung call so its thread can end
        self.pipeline.stop()
        self.pipeline.join(10.0)
        self.failover.close()


@pytest.fixture
def running(blazeface_bundle, photo_dir):
    started: list[Running] = []

    def start(settings: FailoverSettings, crumbs=None) -> Running:
        r = Running(blazeface_bundle, photo_dir, settings, crumbs)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


# -- mid-stream faults ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_fault_mid_stream_fails_over_and_switches_back(running, mode):
    settings = FailoverSettings(hang_deadline_s=0.3, reprobe_min_s=0.3, reprobe_max_s=2.0)
    r = running(settings)
    r.rec.wait_for_engine("accel", since=0.0)
    assert r.health.state == "running" or "engine" not in r.health.reasons
    depth_in_flight = 1 + 2  # queue_depth + the frame in preprocess + the one in infer

    t_fault = time.monotonic()
    r.plan.arm(mode, after=2)
    r.rec.wait_for_engine("tflite", since=t_fault)
    # Detections keep coming from the fallback: the astronaut's face is still found.
    with r.rec.lock:
        fallback = [(ts, b) for ts, b in r.rec.batches if ts >= t_fault and b.engine == "tflite"]
    assert any(len(b.detections) for _, b in fallback)
    t_first_fallback = fallback[0][0]
    assert r.failover.active_key == "tflite"
    assert r.failover.failovers == 1
    reason = r.health.reasons.get("engine", "")
    assert r.health.state == "degraded" and "serving on tflite" in reason
    assert ("injected fault" if mode == "raise" else "deadline") in reason
    assert "failover" in r.rec.event_names()
    lost_reason = "engine_error" if mode == "raise" else "engine_hang"
    assert r.stats.dropped[("infer", lost_reason)] == 1
    assert 1 <= r.lost() <= depth_in_flight

    # Re-probes fail while the fault lasts (the plan is shared by fresh engines too): each re-probe's warm-up
    # meets the fault on a fresh engine. Two of them fail when the engine raises; a hung warm-up holds its
    # re-probe until the warm-up deadline, so there the one in flight is seen.
    accel = r.failover.candidates[0]
    faults, probes = r.plan.faults, 2 if mode == "raise" else 1
    failures = 3 if mode == "raise" else 0  # the mid-stream fault and two failed re-probes
    end = time.monotonic() + WAIT_S
    # The fault is counted when the engine raises, the failure a moment later when the re-probe has handled it:
    # wait for both (a loaded machine widens that moment).
    while (r.plan.faults < faults + probes or accel.failures < failures) and time.monotonic() < end:
        time.sleep(0.02)
    assert r.plan.faults >= faults + probes, f"no {probes} re-probes met the fault"
    assert accel.failures >= failures
    assert r.failover.active_key == "tflite"
    assert accel.state == FAILED
    # ...and once it clears, a warm-up passes and the pipeline switches back between two frames.
    t_clear = time.monotonic()
    r.plan.clear()
    r.rec.wait_for_engine("accel", since=t_clear)
    end = time.monotonic() + WAIT_S
    while "engine" in r.health.reasons and time.monotonic() < end:
        time.sleep(0.02)
    assert "engine" not in r.health.reasons
    assert r.failover.switch_backs == 1
    assert "switch_back" in r.rec.event_names()
    assert r.failover.fallback_seconds() >= t_clear - t_first_fallback  # counted from failover to switch back
    assert 1 <= r.lost() <= depth_in_flight  # the switch back itself loses nothing


def test_hang_is_detected_by_the_deadline_and_the_late_result_is_discarded(running):
    r = running(FailoverSettings(hang_deadline_s=0.3, reprobe_min_s=30.0, reprobe_max_s=60.0))
    r.rec.wait_for_engine("accel", since=0.0)
    t_fault = time.monotonic()
    r.plan.arm("hang")
    r.rec.wait_for_engine("tflite", since=t_fault, count=1)
    with r.rec.lock:
        first = next(ts for ts, b in r.rec.batches if ts >= t_fault and b.engine == "tflite")
    assert first - r.plan.t_fault >= 0.3  # not before the deadline
    published = len(r.rec.batches)
    r.plan.clear()  # the wedged call returns late: its result must go nowhere
    time.sleep(0.3)
    with r.rec.lock:
        late = [b.engine for _, b in r.rec.batches[published:]]
    assert "accel" not in late


def test_auto_deadline_follows_the_p99_with_a_floor(blazeface_bundle, photo):
    plan = FaultPlan()
    failover = accel_failover(blazeface_bundle, plan, (512, 512), FailoverSettings())
    try:
        failover.start()
        accel = failover.candidates[0]
        assert accel.state == READY
        assert accel.deadline_s == pytest.approx(0.25)  # BlazeFace on a CPU: the floor wins
        for _ in range(64):
            accel.record(0.1)
        assert accel.deadline_s == pytest.approx(1.0)  # 10 x p99
    finally:
        failover.close()


# -- real failures at open -----------------------------------------------------------------


def _bundle_copy(tmp_path: Path, bundle, extra_variants: dict[str, str]) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(bundle.root, root)
    text = (root / "model.toml").read_text()
    lines = "".join(f'{k} = "{v}"\n' for k, v in extra_variants.items())
    (root / "model.toml").write_text(text.replace("[variants]\n", "[variants]\n" + lines))
    return root


def _config(tmp_path: Path, order: list[str]) -> object:
    return parse_config(
        {"engine": {"order": order, "num_threads": 1, "state_dir": str(tmp_path / "state"), "reprobe_min_s": 30.0}}
    )


def test_edgetpu_without_libedgetpu_falls_back_at_open(tmp_path, blazeface_bundle):
    import ctypes

    try:
        ctypes.CDLL("libedgetpu.so.1")
        pytest.skip("libedgetpu is installed here: this test needs a machine without it")
    except OSError:
        pass
    root = _bundle_copy(tmp_path, blazeface_bundle, {"edgetpu": "model_edgetpu.tflite"})
    shutil.copy(root / "model.tflite", root / "model_edgetpu.tflite")
    health, events = Health(), []
    failover = open_failover(
        _config(tmp_path, ["edgetpu"]),
        load_bundle(root),
        (640, 480),
        health=health,
        on_event=lambda k, d: events.append((k, d)),
    )
    try:
        runtime = failover.start()
        assert runtime.engine.KEY == "tflite"
        edgetpu = failover.candidates[0]
        assert edgetpu.state == FAILED  # a library or device can appear later: re-probed
        assert "libedgetpu.so.1" in edgetpu.reason
        assert health.state == "degraded"
        assert "serving on tflite: edgetpu Edge TPU delegate libedgetpu.so.1" in health.reasons["engine"]
    finally:
        failover.close()


def test_corrupt_onnx_falls_back_at_open_with_the_error_named(tmp_path, blazeface_bundle):
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install edgerun[onnx])")
    root = _bundle_copy(tmp_path, blazeface_bundle, {"onnx": "model.onnx"})
    (root / "model.onnx").write_bytes(b"\x08\x07not really a protobuf" * 20)
    health = Health()
    failover = open_failover(_config(tmp_path, ["onnx"]), load_bundle(root), (640, 480), health=health)
    try:
        assert failover.start().engine.KEY == "tflite"
        onnx = failover.candidates[0]
        assert onnx.state == BROKEN  # a corrupt file does not heal: not re-probed
        assert "model.onnx: not a loadable ONNX model" in onnx.reason
        assert "protobuf" in onnx.reason.lower()
        assert "not a loadable ONNX model" in health.reasons["engine"]
    finally:
        failover.close()


def test_variants_missing_from_the_bundle_are_not_a_problem(tmp_path, blazeface_bundle):
    health = Health()
    failover = open_failover(_config(tmp_path, ["tensorrt", "onnx"]), blazeface_bundle, (640, 480), health=health)
    try:
        assert failover.start().engine.KEY == "tflite"
        assert [c.state for c in failover.candidates] == [ABSENT, ABSENT, READY]
        assert failover.keys == ["tflite"]
        assert "engine" not in health.reasons
        assert not (tmp_path / "state").exists()  # no accelerator, no breadcrumbs
    finally:
        failover.close()


# -- breadcrumbs ---------------------------------------------------------------------------


DIE_INSIDE_A_CALL = """
import os, signal, sys
from edgerun.engines.breadcrumb import Breadcrumbs
Breadcrumbs(sys.argv[1]).inflight(sys.argv[2]).__enter__()  # a call into the driver...
os.kill(os.getpid(), signal.SIGKILL)  # ...that takes the process with it
"""


def die_inside_a_call(state_dir: Path, key: str) -> None:
    """A real process that is killed while a call into ``key`` is in flight."""
    proc = subprocess.run([sys.executable, "-c", DIE_INSIDE_A_CALL, str(state_dir), key], timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_breadcrumb_blames_an_engine_the_process_died_inside(tmp_path):
    crumbs = Breadcrumbs(tmp_path)
    with crumbs.inflight("edgetpu"):
        assert read_inflight(tmp_path / "inflight-edgetpu")[0] == 1  # a store into the mapping, visible at once
        assert Breadcrumbs(tmp_path).recover() == {}  # this live process's own counter is no crash
    crumbs.close()

    die_inside_a_call(tmp_path, "tensorrt")
    assert read_inflight(tmp_path / "inflight-tensorrt")[0] == 1  # it outlived the process
    assert Breadcrumbs(tmp_path).recover() == {"tensorrt": 1}  # the next process blames it
    assert not (tmp_path / "inflight-tensorrt").exists()
    assert Breadcrumbs(tmp_path).recover() == {}  # blamed once, not again
    die_inside_a_call(tmp_path, "tensorrt")
    assert Breadcrumbs(tmp_path).recover() == {"tensorrt": 2}  # the count is persisted and grows
    state = Breadcrumbs(tmp_path)
    state.recover()
    state.forgive("tensorrt")
    assert Breadcrumbs(tmp_path).crashes == {} and '"crashes": {}' in (tmp_path / "engine-state.json").read_text()


def test_breadcrumb_ignores_finished_calls_clean_shutdowns_and_earlier_boots(tmp_path):
    crumbs = Breadcrumbs(tmp_path)
    with crumbs.inflight("edgetpu"):
        pass
    assert Breadcrumbs(tmp_path).recover() == {}  # the call returned before the "crash"

    crumbs = Breadcrumbs(tmp_path)
    crumbs.inflight("edgetpu").__enter__()
    crumbs.close()  # clean shutdown (a hung call does not make it a crash)
    assert Breadcrumbs(tmp_path).recover() == {}

    (tmp_path / "inflight-edgetpu").write_bytes(
        RECORD.pack(b"EDGRCRB1", 1, b"00000000-0000-0000-0000-000000000000", 1)  # left by an earlier boot
    )
    assert Breadcrumbs(tmp_path).recover() == {}  # a power cut, not the engine's fault
    (tmp_path / "inflight-edgetpu").write_bytes(b"garbage")
    assert Breadcrumbs(tmp_path).recover() == {}


def test_a_crashed_engine_is_skipped_at_start_and_reprobed_later(tmp_path, blazeface_bundle, photo):
    die_inside_a_call(tmp_path, "accel")  # the previous process died inside an "accel" call
    plan, health = FaultPlan(), Health()
    settings = FailoverSettings(reprobe_min_s=0.2, reprobe_max_s=5.0)
    failover = accel_failover(blazeface_bundle, plan, (512, 512), settings, health, crumbs=Breadcrumbs(tmp_path))
    try:
        assert failover.start().engine.KEY == "tflite"
        accel = failover.candidates[0]
        assert accel.state == FAILED and "crashed the process" in accel.reason
        assert plan.calls == 0  # not even opened: that could kill the process again
        assert accel.next_probe - time.monotonic() == pytest.approx(0.4, abs=0.2)  # min x 2^crashes
        assert "crashed the process" in health.reasons["engine"]
    finally:
        failover.close()


def test_a_second_failover_takes_over_the_pipeline_as_an_ota_swap_does(tmp_path, running, photo, blazeface_bundle):
    first = running(FailoverSettings(reprobe_min_s=30.0), crumbs=Breadcrumbs.shared(tmp_path))
    first.rec.wait_for_engine("accel", since=0.0)
    # A new model's failover opens beside the running one (same state directory)...
    second = accel_failover(
        blazeface_bundle,
        FaultPlan(),
        (photo.shape[1], photo.shape[0]),
        FailoverSettings(),
        crumbs=Breadcrumbs.shared(tmp_path),
    )
    runtime = second.start()
    assert second.active_key == "accel"  # the first one's live counter was not taken for a crash
    # ...and takes over through the serving controller: runtime and owner change between two frames.
    old = first.serving.swap(runtime, second)
    assert old.owner is first.failover and old.runtime is not runtime
    assert first.serving.owner is second
    t_swap = time.monotonic()
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end and not any(b.engine == "accel" and ts > t_swap for ts, b in first.rec.batches[-5:]):
        time.sleep(0.02)
    # The old failover no longer touches the pipeline, whatever it decides: the controller refuses it.
    fallback = first.failover.candidates[1]
    assert not first.serving.activate(first.failover, fallback.runtime)
    first.failover._activate(fallback, reason="test")
    assert first.pipeline.runtime is runtime
    first.failover.close()
    assert (tmp_path / "inflight-accel").exists()  # still counting for the second
    first.failover = second  # the fixture closes it
    second_crumbs = Breadcrumbs.shared(tmp_path)
    first.stop()
    assert not (tmp_path / "inflight-accel").exists() and second_crumbs._users == 0


# -- the watched worker ----------------------------------------------------------------------


class _Sleepy:
    KEY = "sleepy"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.mode = "ok"

    def infer(self, tensor, outputs):
        if self.mode == "raise":
            raise RuntimeError("driver says no")
        if self.mode == "hang":
            self.release.wait()
        outputs[0][...] = tensor
        return outputs


def test_engine_worker_returns_raises_and_abandons_a_hung_call():
    engine = _Sleepy()
    worker = EngineWorker(engine, "sleepy")  # type: ignore[arg-type]  # a stand-in with infer() only
    out = [np.zeros(3)]
    worker.call(np.arange(3.0), out, 5.0)
    assert out[0].tolist() == [0.0, 1.0, 2.0]
    engine.mode = "raise"
    with pytest.raises(RuntimeError, match="driver says no"):
        worker.call(np.arange(3.0), out, 5.0)
    engine.mode = "hang"
    t0 = time.monotonic()
    with pytest.raises(EngineHang, match="deadline"):
        worker.call(np.arange(3.0), out, 0.1)
    assert time.monotonic() - t0 < 5.0
    assert worker.abandoned
    late = [np.full(3, -1.0)]
    engine.release.set()  # the wedged call returns late; the worker's thread ends
    worker._thread.join(5.0)
    assert not worker._thread.is_alive()
    assert late[0].tolist() == [-1.0, -1.0, -1.0]


def test_fault_plan_counts_down_then_fails_until_cleared():
    plan = FaultPlan()
    plan.arm("raise", after=2)
    plan.before_call()
    plan.before_call()
    with pytest.raises(InjectedFault):
        plan.before_call()
    with pytest.raises(InjectedFault):
        plan.before_call()
    plan.clear()
    plan.before_call()
    assert plan.faults == 2 and plan.calls == 5


def test_backoff_doubles_up_to_the_cap():
    settings = FailoverSettings(reprobe_min_s=1.0, reprobe_max_s=10.0)
    assert [settings.backoff(n) for n in (1, 2, 3, 4, 5, 9)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_engine_config_keys():
    cfg = parse_config({"engine": {"order": ["tensorrt", "edgetpu", "onnx"], "hang_deadline_ms": 150}})
    assert cfg.engine.hang_deadline_ms == 150
    assert EngineConfig().reprobe_min_s == 1.0 and EngineConfig().state_dir == ""
    with pytest.raises(ConfigError, match="engine.reprobe_max_s: expected >= engine.reprobe_min_s"):
        parse_config({"engine": {"reprobe_min_s": 5.0, "reprobe_max_s": 1.0}})
    with pytest.raises(ConfigError, match=r"engine.order\[0\]: expected one of"):
        parse_config({"engine": {"order": ["cuda"]}})


def test_close_closes_a_failed_lane_still_waiting_to_be_retired(blazeface_bundle, photo):
    """A lane that failed just before shutdown (queued for the supervisor to retire) is closed by close()."""
    plan = FaultPlan()
    failover = accel_failover(blazeface_bundle, plan, (photo.shape[1], photo.shape[0]), FailoverSettings())
    runtime = failover.start()  # not attached: no supervisor thread retires anything behind our back
    accel = runtime.engine
    assert isinstance(accel, FaultInjectingEngine) and failover.active_key == "accel"
    plan.arm("raise")
    with pytest.raises(FrameLost, match="engine_error"):
        failover.infer(runtime, accel.allocate_input(), accel.allocate_outputs())
    assert failover.active_key == "tflite" and not accel.closed
    failover.close()
    assert accel.closed

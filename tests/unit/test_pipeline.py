"""The pipeline on real parts: the images source over real photos, the real BlazeFace model."""

from __future__ import annotations

import itertools
import threading
import time

import cv2
import numpy as np
import pytest

from edgerun.config import SourceConfig
from edgerun.engines.base import EngineOptions, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.pipeline.runner import InOrder, Pipeline, PipelineSettings
from edgerun.sources import make_source


class SlowEngine:
    """Fault injection: the real engine made slower, standing in for an accelerator slower than the camera."""

    def __init__(self, engine, delay_s: float) -> None:
        self._engine = engine
        self.delay_s = delay_s
        self.KEY = engine.KEY
        self.input_spec = engine.input_spec
        self.output_specs = engine.output_specs
        self.cpu_threads = engine.cpu_threads

    def allocate_input(self):
        return self._engine.allocate_input()

    def allocate_outputs(self):
        return self._engine.allocate_outputs()

    def infer(self, tensor, outputs=None):
        time.sleep(self.delay_s)
        return self._engine.infer(tensor, outputs)

    def close(self):
        self._engine.close()


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory, astronaut_rgb, camera_rgb):
    folder = tmp_path_factory.mktemp("photos")
    for i in range(12):
        photo = astronaut_rgb if i % 2 == 0 else camera_rgb
        cv2.imwrite(str(folder / f"{i:03d}.png"), cv2.cvtColor(np.ascontiguousarray(photo), cv2.COLOR_RGB2BGR))
    return folder


def run(pipeline: Pipeline, seconds: float | None = None) -> list:
    got: list = []
    pipeline.on_batch = got.append
    pipeline.start()
    if seconds is None:
        assert pipeline.end_of_stream.wait(30)
    else:
        time.sleep(seconds)
    pipeline.stop()
    assert pipeline.join(10)
    return got


def make(
    bundle, photo_dir, *, loop=False, delay=0.0, fps=0.0, replicas=1, wrap=None, camera=False, **settings
) -> Pipeline:
    source = make_source(SourceConfig(kind="images", path=str(photo_dir), preload=True, loop=loop, fps=fps))
    source.open()
    if camera:
        source.synthetic_clock = False  # frames come on the device's clock, as fast as it delivers them
    engine = engine_class("tflite")(bundle.variant_path("tflite"), EngineOptions(num_threads=1, replicas=replicas))
    if delay:
        engine = SlowEngine(engine, delay)
    if wrap:
        engine = wrap(engine)
    runtime = build_runtime(bundle, engine, (source.width, source.height))
    return Pipeline(
        node_id="t",
        source=source,
        runtime=runtime,
        on_batch=lambda b: None,
        settings=PipelineSettings(pace_fps=fps, **settings),
    )


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_block_delivers_every_frame_in_order(blazeface_bundle, photo_dir, layout, workers):
    p = make(blazeface_bundle, photo_dir, policy="block", stage_threads=layout, replicas=workers)
    assert p.fused is (layout == "fused")
    assert p.workers == workers  # one worker per interpreter replica
    # Nothing is dropped under block, so fused workers read frames themselves: no capture thread.
    assert p.inline_capture is (layout == "fused")
    got = run(p)
    names = {t.name for t in p._threads}
    assert ("edgerun-capture" in names) is (layout == "separate")
    assert [b.meta.seq for b in got] == list(range(12))
    assert p.stats.dropped_total == 0
    faces = [len(b.detections) for b in got]
    assert faces[0::2] == [1] * 6  # the astronaut's face, every time
    box = got[0].detections.boxes[0]
    # In source pixels: the astronaut photo is 512x512 and her face is near the top middle.
    assert 150 < box[0] < 250 and 40 < box[1] < 120 and 250 < box[2] < 350 and 140 < box[3] < 220
    assert p.pool.free == len(p.pool.slots)  # every slot went back to the pool


class JitterEngine(SlowEngine):
    """Fault injection: every other call is slow, so frames worked on side by side finish out of order."""

    def __init__(self, engine) -> None:
        super().__init__(engine, 0.03)
        self.concurrent_calls = engine.concurrent_calls
        self._calls = itertools.count()
        self.finish_order: list[int] = []

    def infer(self, tensor, outputs=None):
        call = next(self._calls)
        if call % 2 == 0:
            time.sleep(self.delay_s)
        result = self._engine.infer(tensor, outputs)
        self.finish_order.append(call)
        return result


@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_workers_finishing_out_of_order_still_publish_in_frame_order(blazeface_bundle, photo_dir, layout):
    p = make(blazeface_bundle, photo_dir, policy="block", stage_threads=layout, replicas=2, wrap=JitterEngine)
    assert p.workers == 2
    got = run(p)
    engine = p.runtime.engine
    assert engine.finish_order != sorted(engine.finish_order)  # the workers really did overtake each other
    assert [b.meta.seq for b in got] == list(range(12))


def test_in_order_holds_early_finishers_and_skips_lost_frames():
    emitted: list = []
    order = InOrder(emitted.append)
    tickets = [order.ticket() for _ in range(5)]
    assert tickets == [0, 1, 2, 3, 4]
    order.finish(2, "b2")
    order.finish(1, None)  # lost at infer: never published, but must not hold the others back
    assert emitted == []  # 0 is still being worked on
    order.finish(0, "b0")
    assert emitted == ["b0", "b2"]
    order.finish(4, "b4")
    assert emitted == ["b0", "b2"]
    order.finish(3, "b3")
    assert emitted == ["b0", "b2", "b3", "b4"]


def test_fused_and_separate_agree(blazeface_bundle, photo_dir):
    a = run(make(blazeface_bundle, photo_dir, policy="block", stage_threads="fused"))
    b = run(make(blazeface_bundle, photo_dir, policy="block", stage_threads="separate"))
    assert len(a) == len(b) > 0  # block loses nothing: both layouts publish every frame
    assert [x.meta.seq for x in a] == [y.meta.seq for y in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x.detections.boxes, y.detections.boxes, atol=1e-3)


@pytest.mark.parametrize("clock", ["camera", "replay"])
@pytest.mark.parametrize("layout", ["separate", "fused"])
@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_slow_model_drops_frames_and_counts_every_one(blazeface_bundle, photo_dir, policy, layout, clock):
    # The source (a camera delivering as fast as it can, or a replay paced at 200 fps) outruns the
    # model (~25 fps): frames must be dropped, not queued.
    p = make(
        blazeface_bundle,
        photo_dir,
        loop=True,
        delay=0.04,
        fps=200.0,
        policy=policy,
        stage_threads=layout,
        camera=clock == "camera",
    )
    # A camera keeps its capture thread, which drains the device and drops stale frames; fused
    # workers take a paced replay's frames themselves and skip the stale ones undecoded.
    skips = p.inline_capture
    assert skips is (layout == "fused" and clock == "replay")
    got = run(p, seconds=1.5)
    stats = p.stats
    assert stats.dropped[("capture", policy)] > 0
    assert stats.captured == len(got) + stats.dropped_total  # nothing vanishes uncounted
    reads = stats.stages["capture"].frames
    if skips:  # only the frames that were worked on were read
        assert reads == len(got) < stats.captured / 2
    else:
        assert reads == stats.captured
    seqs = [b.meta.seq for b in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    if policy == "drop_oldest":
        # Freshest frame wins: consecutive published frames skip the ones that were dropped.
        assert max(np.diff(seqs)) > 1


def test_swap_runtime_between_frames(blazeface_bundle, pose_bundle, photo_dir):
    p = make(blazeface_bundle, photo_dir, loop=True, fps=100.0, policy="block")
    got: list = []
    p.on_batch = got.append
    p.start()
    time.sleep(0.5)
    engine = engine_class("tflite")(pose_bundle.variant_path("tflite"), EngineOptions(num_threads=1))
    new = build_runtime(pose_bundle, engine, (p.source.width, p.source.height))
    old = p.swap_runtime(new)
    assert p.retire(old, timeout=5)
    old.engine.close()
    time.sleep(0.5)
    p.stop()
    assert p.join(10)
    names = [b.model_name for b in got]
    switch = names.index("pose_detector")
    assert set(names[:switch]) == {"blazeface_short"} and set(names[switch:]) == {"pose_detector"}
    assert p.stats.dropped_total == 0
    seqs = [b.meta.seq for b in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no frame lost across the swap
    people = [b for b in got[switch:] if b.meta.seq % 12 % 2 == 1]
    assert people and all(b.labels == ("person",) for b in people)
    assert all(len(b.detections) >= 1 for b in people)


def test_stop_drains_frames_in_flight(blazeface_bundle, photo_dir):
    p = make(blazeface_bundle, photo_dir, loop=True, delay=0.02, policy="block")
    got: list = []
    p.on_batch = got.append
    before = set(threading.enumerate())  # threads other tests left behind are not this pipeline's
    p.start()
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("edgerun")]
    time.sleep(0.5)
    p.stop()
    assert p.join(10)
    assert p.stats.captured == len(got)  # block: every captured frame came out
    assert started and not [t.name for t in started if t.is_alive()]


class AcceleratorStandIn(SlowEngine):
    """Fault injection: the real CPU engine reporting no CPU threads, as an accelerator back end does."""

    def __init__(self, engine) -> None:
        super().__init__(engine, 0.0)
        self.cpu_threads = 0


@pytest.mark.parametrize("stage_threads", ["auto", "separate"])
def test_separate_layout_takes_whole_frames_on_the_infer_threads_once_a_cpu_engine_serves(
    blazeface_bundle, photo_dir, stage_threads
):
    p = make(
        blazeface_bundle, photo_dir, loop=True, policy="block", stage_threads=stage_threads, wrap=AcceleratorStandIn
    )
    assert not p.fused
    cpu = engine_class("tflite")(blazeface_bundle.variant_path("tflite"), EngineOptions(num_threads=1, replicas=2))
    cpu_runtime = build_runtime(blazeface_bundle, cpu, (p.source.width, p.source.height))
    got: list = []
    p.on_batch = got.append
    p.start()
    deadline = time.monotonic() + 20
    while len(got) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.whole_frames == 0  # the accelerator serves: a thread per stage
    p.swap_runtime(cpu_runtime)  # as a failover to the CPU fallback does
    before = len(got)
    while len(got) < before + 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.stop()
    assert p.join(10)
    seqs = [b.meta.seq for b in got]
    assert seqs == list(range(len(seqs)))  # in order, nothing lost across the change of layout
    after = got[before:]
    assert len(after) >= 40
    # The astronaut (every even photo) still has her face found on the frames done end to end.
    astronaut = [len(b.detections) for b in after if b.meta.seq % 2 == 0]
    assert astronaut == [1] * len(astronaut)
    if stage_threads == "auto":
        assert p.whole_frames >= 30
    else:
        assert p.whole_frames == 0  # an explicit layout is kept


class SerialAccelerator(SlowEngine):
    """Fault injection: the real engine made 10 ms slower, one call at a time and no CPU threads, as an
    accelerator (TensorRT context, Edge TPU) is."""

    def __init__(self, engine) -> None:
        super().__init__(engine, 0.01)
        self.cpu_threads = 0
        self.concurrent_calls = 1
        self.inside = 0
        self.most_inside = 0
        self._count = threading.Lock()

    def infer(self, tensor, outputs=None):
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            return super().infer(tensor, outputs)
        finally:
            with self._count:
                self.inside -= 1


class WaitCountingLock:
    """The runtime's serial lock, counting the workers that wait on it holding a frame."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self.waiting = 0
        self.most_waiting = 0

    def __enter__(self):
        if self._lock.acquire(blocking=False):
            return self
        with self._count:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        self._lock.acquire()
        with self._count:
            self.waiting -= 1
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_workers_behind_a_serial_engine_take_a_frame_only_with_a_call_slot(blazeface_bundle, photo_dir):
    # A camera faster than the engine, four workers, an engine that takes one call at a time.
    p = make(
        blazeface_bundle, photo_dir, loop=True, camera=True, policy="drop_oldest", workers=4, wrap=SerialAccelerator
    )
    assert not p.fused and p.workers == 4
    waits = WaitCountingLock()
    p.runtime.serial = waits
    # The CPU fallback takes two calls at once: a failover to it must open a second slot.
    cpu = engine_class("tflite")(blazeface_bundle.variant_path("tflite"), EngineOptions(num_threads=1, replicas=2))
    cpu = SerialAccelerator(cpu)
    cpu.concurrent_calls = 2
    cpu_runtime = build_runtime(blazeface_bundle, cpu, (p.source.width, p.source.height))
    got: list = []
    p.on_batch = got.append
    p.start()
    deadline = time.monotonic() + 30
    while len(got) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) >= 40
    # No worker ever held a frame waiting for the engine: frames wait in flow control, where the
    # freshest wins, not behind the engine's lock, where they age by one call per worker ahead.
    assert waits.most_waiting == 0
    assert p.runtime.engine.most_inside == 1
    p.swap_runtime(cpu_runtime)
    before = len(got)
    while len(got) < before + 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.stop()
    assert p.join(10)
    assert len(got) >= before + 60
    assert cpu.most_inside == 2  # both replicas were kept busy after the switch
    seqs = [b.meta.seq for b in got]
    assert seqs == sorted(seqs)


def test_in_order_gives_up_on_a_frame_whose_call_never_returns():
    now = [0.0]
    emitted: list = []
    overdue: list[int] = []
    order = InOrder(emitted.append, max_wait_s=5.0, on_overdue=overdue.append, clock=lambda: now[0])
    tickets = [order.ticket() for _ in range(4)]
    assert tickets == [0, 1, 2, 3]
    now[0] = 1.0
    order.finish(1, "b1")
    now[0] = 4.9
    order.finish(2, "b2")
    assert emitted == [] and overdue == []  # 0 has been out for 4.9 s: still waited for
    now[0] = 5.1
    order.finish(3, "b3")
    assert overdue == [0] and order.overdue == 1  # out for over 5 s: the batches behind it go on
    assert emitted == ["b1", "b2", "b3"]
    order.finish(0, "b0")  # the call returned after all: too late, its batch goes nowhere
    assert emitted == ["b1", "b2", "b3"] and order.discarded == 1
    t4, t5 = order.ticket(), order.ticket()
    order.finish(t5, "b5")
    assert emitted == ["b1", "b2", "b3"]  # a fresh frame is waited for as usual
    order.finish(t4, "b4")
    assert emitted == ["b1", "b2", "b3", "b4", "b5"]


def test_in_order_give_up_hands_on_what_is_held():
    emitted: list = []
    order = InOrder(emitted.append)
    for _ in range(3):
        order.ticket()
    order.finish(2, "b2")
    order.give_up()  # a shutdown that could not drain: 0 and 1 are still out
    assert emitted == ["b2"] and order.overdue == 2


class OneCallHangs(SlowEngine):
    """Fault injection: the real CPU engine (two replicas) whose 10th call blocks until released, as a
    wedged CPU last resort would (it has no hang deadline)."""

    def __init__(self, engine) -> None:
        super().__init__(engine, 0.0)
        self.concurrent_calls = engine.concurrent_calls
        self.release = threading.Event()
        self.hung = threading.Event()
        self._calls = itertools.count()

    def infer(self, tensor, outputs=None):
        if next(self._calls) == 10:
            self.hung.set()
            self.release.wait()
        return self._engine.infer(tensor, outputs)


def test_a_call_that_never_returns_does_not_hold_later_batches_forever(blazeface_bundle, photo_dir):
    p = make(
        blazeface_bundle,
        photo_dir,
        loop=True,
        policy="block",
        stage_threads="fused",
        replicas=2,
        wrap=OneCallHangs,
        order_wait_s=0.3,
    )
    engine = p.runtime.engine
    got: list = []
    p.on_batch = got.append
    p.start()
    try:
        assert engine.hung.wait(30)
        at_hang = len(got)
        deadline = time.monotonic() + 30
        while len(got) < at_hang + 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The other worker's batches go on once the hung frame is overdue, still in frame order.
        assert len(got) >= at_hang + 20
        assert p.stats.dropped[("infer", "overdue")] == 1
    finally:
        engine.release.set()
        p.stop()
        assert p.join(10)
    seqs = [b.meta.seq for b in got]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
    assert p.stats.captured == len(got) + p.stats.dropped_total  # the late result was discarded, counted once


@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_find_crops_are_copied_from_the_frame_the_detection_came_from(blazeface_bundle, photo_dir, layout):
    """Frames alternate two photos through a small pool of reused slots: a crop taken after its slot went back
    to the pool (or from another frame) would hold the cameraman's pixels, not the astronaut's face."""
    from edgerun.config import SwarmImagesConfig
    from edgerun.fleet.find_images import FindCropper

    p = make(blazeface_bundle, photo_dir, policy="block", stage_threads=layout, replicas=2)
    p.find_cropper = FindCropper(SwarmImagesConfig(margin=0.0))
    got = run(p)
    cropped = [b for b in got if b.crops]
    assert {b.meta.seq for b in cropped} >= set(range(0, 12, 2))  # the astronaut's face, in every one of hers
    for batch in cropped:
        frame = cv2.imread(str(photo_dir / f"{batch.meta.seq:03d}.png"))  # BGR, as the source hands frames on
        for index, crop in batch.crops.items():
            assert crop.box == tuple(float(v) for v in batch.detections.boxes[index])
            left, top = max(0, int(crop.box[0])), max(0, int(crop.box[1]))
            inner = crop.image[2:-2, 2:-2]  # inside the box drawn on the crop's edge
            h, w = inner.shape[:2]
            assert np.array_equal(inner, frame[top + 2 : top + 2 + h, left + 2 : left + 2 + w]), batch.meta.seq
    assert p.pool.free == len(p.pool.slots)

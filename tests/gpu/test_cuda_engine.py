"""GPU tests (marker ``gpu``): pycuda pinned and mapped buffers, and the TensorRT engine.

Run with ``make test-gpu`` on a CUDA machine (tests/gpu/README.md lists the
wheels to bring to one without network). Everywhere else each test is skipped
with the reason.

A small CUDA kernel (``y = 2x + 1``, PTX that the driver JIT-compiles, so no
nvcc is needed) stands in for a TensorRT engine: it runs behind the real
``TensorRTEngine.infer`` buffer logic, once with pinned buffers and async
copies (discrete GPU path) and once with mapped buffers the kernel reads and
writes in place (the Jetson zero-copy path).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgerun.engines.base import EngineOptions, TensorSpec

pytestmark = pytest.mark.gpu

AFFINE_PTX = r"""
.version 6.0
.target sm_50
.address_size 64

.visible .entry affine(
    .param .u64 affine_src,
    .param .u64 affine_dst,
    .param .u32 affine_n
)
{
    .reg .pred %p<2>;
    .reg .f32 %f<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [affine_src];
    ld.param.u64 %rd2, [affine_dst];
    ld.param.u32 %r2, [affine_n];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r1, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r1, %r2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    mul.wide.u32 %rd4, %r1, 4;
    add.s64 %rd5, %rd3, %rd4;
    ld.global.f32 %f1, [%rd5];
    fma.rn.f32 %f2, %f1, 0f40000000, 0f3F800000;
    cvta.to.global.u64 %rd6, %rd2;
    add.s64 %rd7, %rd6, %rd4;
    st.global.f32 [%rd7], %f2;
DONE:
    ret;
}
"""

SHAPE = (1, 3, 64, 64)
BLOCK = 256


@pytest.fixture(scope="module")
def cuda():
    try:
        import pycuda.driver as cuda
    except ImportError as err:
        pytest.skip(f"no CUDA: pycuda not importable ({err})")
    try:
        cuda.init()
        count = cuda.Device.count()
    except Exception as err:
        pytest.skip(f"no CUDA: driver unavailable ({err})")
    if count == 0:
        pytest.skip("no CUDA: no device found")
    return cuda


class KernelContext:
    """Stands in for a TensorRT execution context: the same two calls, a real kernel behind them."""

    def __init__(self, cuda, engine) -> None:
        self.module = cuda.module_from_buffer(AFFINE_PTX.encode())
        self.func = self.module.get_function("affine")
        self.engine = engine
        self.addresses: dict[str, int] = {}

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = int(address)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        n = int(np.prod(SHAPE))
        self.func(
            np.uintp(self.addresses["x"]),
            np.uintp(self.addresses["y"]),
            np.uint32(n),
            block=(BLOCK, 1, 1),
            grid=((n + BLOCK - 1) // BLOCK, 1),
            stream=self.engine._stream,
        )
        return True


def standin_engine(cuda, zero_copy: bool):
    """A TensorRTEngine whose model is the affine kernel (built without TensorRT); ``close`` releases it."""
    from edgerun.engines.tensorrt import CudaContext, TensorRTEngine

    ctx = CudaContext(cuda, 0)
    engine = TensorRTEngine.__new__(TensorRTEngine)
    engine.model_path, engine.options = Path("affine.ptx"), EngineOptions()
    engine._cuda, engine._ctx = cuda, ctx
    engine.zero_copy, engine.cpu_threads = zero_copy, 0
    engine._pinned, engine._keep, engine._bound = {}, [], ()
    engine.input_spec = TensorSpec("x", SHAPE, np.dtype(np.float32), "NCHW")
    engine.output_specs = [TensorSpec("y", SHAPE, np.dtype(np.float32), "")]
    with ctx:
        engine._stream = cuda.Stream()
        engine._device_in = cuda.mem_alloc(int(np.prod(SHAPE)) * 4)
        engine._device_out = [cuda.mem_alloc(int(np.prod(SHAPE)) * 4)]
        engine._context = KernelContext(cuda, engine)
    return engine


@pytest.mark.parametrize("zero_copy", [False, True], ids=["pinned-copies", "mapped-zero-copy"])
def test_buffers_round_trip_through_a_kernel(cuda, zero_copy):
    if zero_copy and not cuda.Device(0).get_attribute(cuda.device_attribute.CAN_MAP_HOST_MEMORY):
        pytest.skip("this GPU cannot map host memory")
    engine = standin_engine(cuda, zero_copy)
    rng = np.random.default_rng(0)
    tensor = engine.allocate_input()
    outputs = engine.allocate_outputs()
    assert isinstance(tensor.base, cuda.PagelockedHostAllocation)  # page-locked: DMA-able
    device_ptr = engine._pinned[tensor.ctypes.data]
    assert bool(device_ptr) == zero_copy  # mapped buffers carry their device address
    for _ in range(3):  # the same slot buffers, new contents each frame
        tensor[...] = rng.standard_normal(SHAPE, dtype=np.float32)
        assert engine.infer(tensor, outputs) is outputs
        np.testing.assert_allclose(outputs[0], 2.0 * tensor + 1.0, rtol=1e-6)
    if zero_copy:
        # The kernel read the frame where it lies: the device buffers were never bound.
        assert engine._context.addresses["x"] == device_ptr
    plain = rng.standard_normal(SHAPE, dtype=np.float32)  # a buffer the engine did not allocate
    plain_out = [np.zeros(SHAPE, np.float32)]
    engine.infer(plain, plain_out)
    np.testing.assert_allclose(plain_out[0], 2.0 * plain + 1.0, rtol=1e-6)
    engine.close()


def test_context_is_usable_from_another_thread(cuda):
    import threading

    engine = standin_engine(cuda, zero_copy=False)
    tensor = engine.allocate_input()
    outputs = engine.allocate_outputs()
    tensor[...] = 3.0
    errors: list[BaseException] = []

    def run() -> None:
        try:
            engine.infer(tensor, outputs)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)  # failover infers on the engine's worker thread
    thread.start()
    thread.join(30)
    assert not errors and np.all(outputs[0] == 7.0)
    engine.close()


def _free_bytes(cuda) -> int:
    """Free device memory, read through a context of its own (each engine context costs device memory)."""
    probe = cuda.Device(0).make_context()
    try:
        return cuda.mem_get_info()[0]
    finally:
        probe.pop()
        probe.detach()


def _close_on_another_thread(engine) -> None:
    import threading

    errors: list[BaseException] = []

    def close() -> None:
        try:
            engine.close()
        except BaseException as err:
            errors.append(err)

    closer = threading.Thread(target=close)  # failover retires and OTA swaps close off the opening thread
    closer.start()
    closer.join(60)
    assert not closer.is_alive() and not errors, errors


def test_an_engine_closed_from_another_thread_gives_its_context_back(cuda):
    """pycuda's detach does nothing off the opening thread unless the context is current: that leaked a
    context (and its device memory) per failover retire, OTA swap and stop."""
    before = _free_bytes(cuda)
    engines = [standin_engine(cuda, zero_copy=False) for _ in range(4)]
    during = _free_bytes(cuda)
    assert during < before  # four contexts hold device memory
    for engine in engines:
        _close_on_another_thread(engine)
    after = _free_bytes(cuda)
    # Back to where it was, give or take the driver's own bookkeeping (far less than one context).
    per_context = (before - during) / len(engines)
    assert before - after < per_context / 2, (before, during, after)


# -- TensorRT itself --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trt_bundle(cuda, tmp_path_factory, request):
    pytest.importorskip("tensorrt", reason="no TensorRT: pip install tensorrt (see tests/gpu/README.md)")
    pytest.importorskip("tflite2onnx", reason="tflite2onnx not installed (pip install edgerun[onnx])")
    # Asked for only now: a CUDA machine without TensorRT (and often without network) skips above
    # instead of failing to fetch the demo model it would not use.
    blazeface_bundle = request.getfixturevalue("blazeface_bundle")
    from edgerun.models.build_trt import build_trt_command
    from edgerun.models.bundle import load_bundle

    root = tmp_path_factory.mktemp("trt") / "bundle"
    shutil.copytree(blazeface_bundle.root, root)
    result = build_trt_command(str(root), None, fp16=False, calibration=None, workspace_mb=512, device="")
    assert Path(result["engine"]).is_file() and result["bundle"] == str(root)
    return load_bundle(root)


def test_tensorrt_engine_runs_and_agrees_with_tflite(trt_bundle, astronaut_rgb):
    from edgerun.engines.base import engine_class
    from edgerun.engines.factory import build_runtime

    photo = cv2.cvtColor(astronaut_rgb, cv2.COLOR_RGB2BGR)
    size = (photo.shape[1], photo.shape[0])
    found = {}
    for key in ("tflite", "tensorrt"):
        engine = engine_class(key)(trt_bundle.variant_path(key), EngineOptions(num_threads=1))
        runtime = build_runtime(trt_bundle, engine, size)
        tensor, outputs = engine.allocate_input(), engine.allocate_outputs()
        runtime.preprocessor(photo, tensor)
        for _ in range(3):
            engine.infer(tensor, outputs)
        detections = runtime.decoder.decode(outputs)
        runtime.preprocessor.letterbox.boxes_to_source(detections.boxes)
        found[key] = detections
        engine.close()
    assert len(found["tflite"]) >= 1 and len(found["tensorrt"]) == len(found["tflite"])
    # TF32 convolutions on recent GPUs: agree within a couple of pixels.
    np.testing.assert_allclose(found["tensorrt"].boxes, found["tflite"].boxes, atol=2.0)
    np.testing.assert_allclose(found["tensorrt"].scores, found["tflite"].scores, atol=0.02)


def test_tensorrt_serves_and_fails_over_to_the_cpu(trt_bundle, tmp_path):
    """The node's failover over a real TensorRT engine: it serves, and an injected fault moves to TFLite."""
    import time

    from edgerun.config import parse_config
    from edgerun.engines.factory import open_failover
    from edgerun.service.health import Health

    cfg = parse_config({"engine": {"order": ["tensorrt"], "state_dir": str(tmp_path / "state")}})
    health = Health()
    failover = open_failover(cfg, trt_bundle, (512, 512), health=health)
    try:
        runtime = failover.start()
        assert runtime.engine.KEY == "tensorrt" and "engine" not in health.reasons
        lane = failover._lanes[runtime]
        failover.fault(lane, "injected by the GPU test")
        assert failover.active_key == "tflite" and health.state == "degraded"
        # The faulted lane is retired and its engine closed, on a thread other than the one that opened it.
        deadline = time.monotonic() + 60
        while runtime.engine._ctx is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runtime.engine._ctx is None, "the faulted TensorRT lane was never closed"
    finally:
        failover.close()
    assert not list((tmp_path / "state").glob("inflight-*"))


def test_doctor_sees_the_gpu(cuda):
    from edgerun.doctor import doctor_report

    tensorrt = doctor_report()["backends"]["tensorrt"]
    if "tensorrt" in tensorrt.get("why", "").lower() and "not importable" in tensorrt.get("why", ""):
        pytest.skip(f"no TensorRT: {tensorrt['why']}")
    assert tensorrt["ok"], tensorrt
    assert any(d.startswith("cuda:0") for d in tensorrt["devices"])

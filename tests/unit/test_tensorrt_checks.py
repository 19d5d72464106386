"""What the TensorRT engine refuses at open, and how build-trt feeds calibration and writes engines.

TensorRT, pycuda and a GPU cannot exist on this machine, so these tests use test doubles for
them: ``FakeTrt`` has the enum members of the TensorRT 10 Python API that the checks compare
against, ``FakeEngine``/``FakeExecutionContext`` answer the ICudaEngine/IExecutionContext
queries from a table, and ``FakePycuda`` models pycuda's context rules as its source states
them (``context::detach`` in src/cpp/cuda.hpp: a context is destroyed only when it is current
on the calling thread or when detach runs on the thread that made it). The same code runs
against the real libraries in tests/gpu/ on a CUDA machine.
"""

from __future__ import annotations

import enum
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgerun.errors import ModelError


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorFormat(enum.Enum):
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW32 = 7


class TensorLocation(enum.Enum):
    DEVICE = 0
    HOST = 1


FakeTrt = SimpleNamespace(
    DataType=DataType, TensorIOMode=TensorIOMode, TensorFormat=TensorFormat, TensorLocation=TensorLocation
)


class FakeEngine:
    """Answers ICudaEngine's I/O queries from ``tensors``: name -> dict of mode, shape, dtype, format, location."""

    def __init__(self, tensors: dict[str, dict]) -> None:
        self.tensors = tensors
        self.num_io_tensors = len(tensors)

    def get_tensor_name(self, i: int) -> str:
        return list(self.tensors)[i]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self.tensors[name]["mode"]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name]["shape"]

    def get_tensor_dtype(self, name: str) -> DataType:
        return self.tensors[name].get("dtype", DataType.FLOAT)

    def get_tensor_format(self, name: str) -> TensorFormat:
        return self.tensors[name].get("format", TensorFormat.LINEAR)

    def get_tensor_location(self, name: str) -> TensorLocation:
        return self.tensors[name].get("location", TensorLocation.DEVICE)

    def get_tensor_profile_shape(self, name: str, profile: int) -> tuple:
        opt = self.tensors[name]["profile"]
        return opt, opt, opt


class FakeExecutionContext:
    """Output shapes once the input shape is known: -1 stays -1 for data-dependent ones."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.input_shapes: dict[str, tuple[int, ...]] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.input_shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.engine.tensors[name].get("resolved", self.engine.tensors[name]["shape"])


def good_tensors() -> dict[str, dict]:
    return {
        "input": {"mode": TensorIOMode.INPUT, "shape": (1, 3, 128, 128)},
        "boxes": {"mode": TensorIOMode.OUTPUT, "shape": (1, 896, 16)},
        "scores": {"mode": TensorIOMode.OUTPUT, "shape": (1, 896, 1), "dtype": DataType.HALF},
    }


def specs(tensors: dict[str, dict]):
    from edgerun.engines.tensorrt import io_specs

    engine = FakeEngine(tensors)
    return io_specs(FakeTrt, engine, FakeExecutionContext(engine), Path("model.engine"))


def test_an_engine_the_node_can_feed_gives_its_specs():
    input_spec, outputs = specs(good_tensors())
    assert (input_spec.name, input_spec.shape, input_spec.dtype, input_spec.layout) == (
        "input",
        (1, 3, 128, 128),
        np.float32,
        "NCHW",
    )
    assert [(o.name, o.shape, o.dtype) for o in outputs] == [
        ("boxes", (1, 896, 16), np.float32),
        ("scores", (1, 896, 1), np.float16),
    ]


def test_a_dynamic_batch_is_set_to_one_at_the_profile_size():
    from edgerun.engines.tensorrt import io_specs

    tensors = good_tensors()
    tensors["input"].update(shape=(-1, 3, 128, 128), profile=(4, 3, 128, 128))
    engine = FakeEngine(tensors)
    context = FakeExecutionContext(engine)
    input_spec, _ = io_specs(FakeTrt, engine, context, Path("model.engine"))
    assert input_spec.shape == (1, 3, 128, 128) and context.input_shapes == {"input": (1, 3, 128, 128)}


@pytest.mark.parametrize(
    ("tensor", "change", "message"),
    [
        ("boxes", {"shape": (1, -1, 16), "resolved": (1, -1, 16)}, "output 'boxes' has a data-dependent shape"),
        ("scores", {"dtype": DataType.BF16}, "output 'scores' has data type BF16, which numpy cannot hold"),
        ("input", {"dtype": DataType.FP8}, "input 'input' has data type FP8, which numpy cannot hold"),
        ("boxes", {"dtype": DataType.INT4}, "has data type INT4"),
        ("input", {"format": TensorFormat.CHW32}, "tensor 'input' has the vectorised format CHW32"),
        ("scores", {"format": TensorFormat.HWC8}, "tensor 'scores' has the vectorised format HWC8"),
        ("boxes", {"location": TensorLocation.HOST}, "tensor 'boxes' lives on the host"),
    ],
)
def test_engines_the_node_cannot_feed_are_model_errors(tensor, change, message):
    tensors = good_tensors()
    tensors[tensor].update(change)
    with pytest.raises(ModelError) as info:
        specs(tensors)
    assert str(info.value).startswith("model.engine: ") and message in str(info.value)


def test_two_inputs_are_a_model_error():
    tensors = good_tensors()
    tensors["second"] = {"mode": TensorIOMode.INPUT, "shape": (1, 4)}
    with pytest.raises(ModelError, match="expected 1 input tensor, found 2"):
        specs(tensors)


# -- the CUDA context: closed from another thread than the one that opened it ---------------------------


class FakePycuda:
    """pycuda's context rules (src/cpp/cuda.hpp), per thread: a stack of pushed contexts."""

    class Error(Exception):
        pass

    device_attribute = SimpleNamespace(INTEGRATED=0, CAN_MAP_HOST_MEMORY=1)
    ctx_flags = SimpleNamespace(SCHED_BLOCKING_SYNC=4, MAP_HOST=8)

    def __init__(self) -> None:
        self.local = threading.local()
        self.contexts: list[FakePycuda.FakeContext] = []
        pycuda = self

        class Device:
            @staticmethod
            def count() -> int:
                return 1

            def __init__(self, index: int) -> None:
                self.index = index

            def get_attribute(self, attribute: int) -> int:
                return 0

            def make_context(self, flags: int) -> FakePycuda.FakeContext:
                ctx = FakePycuda.FakeContext(pycuda)
                pycuda.contexts.append(ctx)
                pycuda.stack().append(ctx)  # made current on this thread
                return ctx

        class Context:
            @staticmethod
            def pop() -> None:
                pycuda.stack().pop()

        self.Device = Device
        self.Context = Context

    def init(self) -> None:
        pass

    def stack(self) -> list:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    class FakeContext:
        def __init__(self, pycuda: FakePycuda) -> None:
            self.pycuda = pycuda
            self.thread = threading.get_ident()
            self.destroyed = False

        def push(self) -> None:
            self.pycuda.stack().append(self)

        def pop(self) -> None:
            self.pycuda.stack().pop()

        def detach(self) -> None:
            stack = self.pycuda.stack()
            current = bool(stack) and stack[-1] is self
            if current or self.thread == threading.get_ident():
                self.destroyed = True
                while self in stack:
                    stack.remove(self)
            # else: pycuda does nothing (the context leaks)


def test_a_context_closed_from_another_thread_is_destroyed():
    from edgerun.engines.tensorrt import CudaContext

    pycuda = FakePycuda()
    ctx = CudaContext(pycuda, 0)  # opened here (failover's supervisor thread)
    with ctx:
        pass  # used: pushed and popped
    closer = threading.Thread(target=ctx.close)  # closed elsewhere (a retire thread, an OTA swap)
    closer.start()
    closer.join(30)
    assert pycuda.contexts[0].destroyed
    assert pycuda.stack() == []


def test_the_fake_reproduces_the_leak_a_bare_detach_had():
    """The double is faithful to the bug: detaching without a push, off the opening thread, destroys nothing."""
    from edgerun.engines.tensorrt import CudaContext

    pycuda = FakePycuda()
    ctx = CudaContext(pycuda, 0)
    detacher = threading.Thread(target=ctx.context.detach)
    detacher.start()
    detacher.join(30)
    assert not pycuda.contexts[0].destroyed


# -- build-trt: calibration in the input's own dtype, atomic engine files ------------------------------


def test_calibration_tensors_come_in_the_input_dtype(tmp_path):
    from edgerun.engines.base import TensorSpec
    from edgerun.models.build_trt import calibration_tensors

    spec = TensorSpec("input", (1, 3, 8, 8), np.dtype(np.float16), "NCHW")
    data = tmp_path / "calib.npy"
    np.save(data, np.random.default_rng(0).standard_normal((5, 1, 3, 8, 8)))  # float64, with a batch of 1
    tensors = calibration_tensors(data, spec, None)
    assert tensors.shape == (5, 3, 8, 8) and tensors.dtype == np.float16
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ModelError, match="not a readable .npy array"):
        calibration_tensors(bad, spec, None)


def test_the_calibrator_feeds_the_input_dtype_to_the_device(tmp_path):
    from edgerun.engines.base import TensorSpec
    from edgerun.models.build_trt import entropy_calibrator

    copies: list[np.ndarray] = []

    class Calibrator:  # stands in for trt.IInt8EntropyCalibrator2
        def __init__(self) -> None:
            pass

    class Allocation(int):
        pass

    fake_cuda = SimpleNamespace(
        mem_alloc=lambda nbytes: Allocation(nbytes), memcpy_htod=lambda dest, src: copies.append(src.copy())
    )
    trt = SimpleNamespace(IInt8EntropyCalibrator2=Calibrator)
    spec = TensorSpec("input", (1, 3, 4, 4), np.dtype(np.uint8), "NCHW")
    tensors = np.arange(2 * 48).reshape(2, 3, 4, 4)  # int64 from numpy
    calibrator = entropy_calibrator(trt, fake_cuda, tensors, spec, tmp_path / "model.calib")
    assert calibrator.get_batch(["input"]) == [48]  # one uint8 tensor's bytes on the device
    assert calibrator.get_batch(["input"]) is not None and calibrator.get_batch(["input"]) is None
    assert [c.dtype for c in copies] == [np.uint8, np.uint8]
    calibrator.write_calibration_cache(b"cache")
    assert calibrator.read_calibration_cache() == b"cache"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.calib"]


def test_an_engine_file_is_whole_or_untouched(tmp_path, monkeypatch):
    from edgerun.models import build_trt

    engine = tmp_path / "model.engine"
    engine.write_bytes(b"old engine")
    build_trt.write_atomically(engine, b"new engine")
    assert engine.read_bytes() == b"new engine"

    def power_cut(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build_trt.os, "fsync", power_cut)  # fault injection: the write fails midway
    with pytest.raises(OSError):
        build_trt.write_atomically(engine, b"half")
    assert engine.read_bytes() == b"new engine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.engine"]


def test_the_input_spec_comes_from_the_parsed_network():
    from edgerun.models.build_trt import network_input_spec

    def network(shape, dtype=DataType.FLOAT, inputs=1):
        tensor = SimpleNamespace(name="input", shape=shape, dtype=dtype)
        return SimpleNamespace(num_inputs=inputs, get_input=lambda i: tensor)

    spec = network_input_spec(FakeTrt, network((-1, 128, 128, 3), DataType.UINT8), Path("m.onnx"))
    assert (spec.shape, spec.dtype, spec.layout) == ((1, 128, 128, 3), np.uint8, "NHWC")
    with pytest.raises(ModelError, match="dynamic dimensions"):
        network_input_spec(FakeTrt, network((1, 3, -1, -1)), Path("m.onnx"))
    with pytest.raises(ModelError, match="data type BF16"):
        network_input_spec(FakeTrt, network((1, 3, 8, 8), DataType.BF16), Path("m.onnx"))
    with pytest.raises(ModelError, match="expected 1 input tensor, found 2"):
        network_input_spec(FakeTrt, network((1, 3, 8, 8), inputs=2), Path("m.onnx"))

"""``edgerun model check-mcu``: int8 models built at test time with tflite-micro's model editor, run in TFLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgerun.errors import ModelError
from edgerun.mcu.check import check_mcu_model, parse_size

me = pytest.importorskip("tflite_micro.tensorflow.lite.micro.compression.model_editor")
schema = pytest.importorskip("tflite_micro.tensorflow.lite.micro.python.schema_py_generated")


def build_int8_classifier(path: Path, features: int = 64, classes: int = 8, custom_op: str = "") -> Path:
    """input int8 [1, features] -> FULLY_CONNECTED -> SOFTMAX (or a custom op TFLM does not have)."""
    q, t = me.Quantization, schema.TensorType
    rng = np.random.default_rng(1)
    inp = me.Tensor(shape=(1, features), dtype=t.INT8, quantization=q(0.05, -1), name="input")
    weights = me.Tensor(
        shape=(classes, features),
        dtype=t.INT8,
        quantization=q(0.01, 0),
        name="weights",
        data=rng.integers(-127, 127, (classes, features), dtype=np.int8),
    )
    bias = me.Tensor(
        shape=(classes,), dtype=t.INT32, quantization=q(0.0005, 0), name="bias", data=np.zeros(classes, np.int32)
    )
    logits = me.Tensor(shape=(1, classes), dtype=t.INT8, quantization=q(0.1, 0), name="logits")
    probs = me.Tensor(shape=(1, classes), dtype=t.INT8, quantization=q(1 / 256, -128), name="probs")
    fc = me.Operator(opcode=schema.BuiltinOperator.FULLY_CONNECTED, inputs=[inp, weights, bias], outputs=[logits])
    fc._fb.builtinOptionsType = schema.BuiltinOptions.FullyConnectedOptions
    fc._fb.builtinOptions = schema.FullyConnectedOptionsT()
    if custom_op:
        last = me.Operator(
            opcode=schema.BuiltinOperator.CUSTOM, custom_code=custom_op, inputs=[logits], outputs=[probs]
        )
    else:
        last = me.Operator(opcode=schema.BuiltinOperator.SOFTMAX, inputs=[logits], outputs=[probs])
        last._fb.builtinOptionsType = schema.BuiltinOptions.SoftmaxOptions
        options = schema.SoftmaxOptionsT()
        options.beta = 1.0
        last._fb.builtinOptions = options
    graph = me.Subgraph(
        tensors=[inp, weights, bias, logits, probs], operators=[fc, last], inputs=[inp], outputs=[probs]
    )
    path.write_bytes(bytes(me.Model(subgraphs=[graph]).build()))
    return path


def test_supported_model_reports_ops_arena_and_time(tmp_path: Path) -> None:
    model = build_int8_classifier(tmp_path / "small.tflite")
    result = check_mcu_model(model, 64 * 1024)
    assert result.ok
    assert result.ops == {"FULLY_CONNECTED": 1, "SOFTMAX": 1}
    assert result.unsupported == []
    assert result.arena_needed is not None and 256 < result.arena_needed <= 64 * 1024
    assert result.invoke_ms_median is not None and result.invoke_ms_median >= 0.0
    assert result.inputs == [{"shape": [1, 64], "dtype": "int8"}]


def test_arena_grows_with_the_activations(tmp_path: Path) -> None:
    small = check_mcu_model(build_int8_classifier(tmp_path / "a.tflite", features=64), 1 << 20)
    large = check_mcu_model(build_int8_classifier(tmp_path / "b.tflite", features=4096), 1 << 20)
    assert large.arena_needed > small.arena_needed + 3000  # a 4 KiB int8 input lives in the arena


def test_measured_arena_is_the_smallest_that_works(tmp_path: Path) -> None:
    from tflite_micro.python.tflite_micro import runtime

    model = build_int8_classifier(tmp_path / "m.tflite")
    needed = check_mcu_model(model, 64 * 1024).arena_needed
    data = model.read_bytes()

    def runs(arena: int) -> bool:
        try:
            interp = runtime.Interpreter.from_bytes(data, arena_size=arena)
            interp.set_input(np.zeros((1, 64), np.int8), 0)
            interp.invoke()
        except RuntimeError:
            return False
        return True

    assert runs(needed)
    assert not runs(needed - 64 - 16)


def test_too_small_an_arena_is_not_ok(tmp_path: Path) -> None:
    result = check_mcu_model(build_int8_classifier(tmp_path / "m.tflite"), 512)
    assert not result.fits and not result.ok
    assert "does NOT fit in 512 bytes" in result.format()


def test_an_op_tflm_lacks_is_named(tmp_path: Path) -> None:
    result = check_mcu_model(build_int8_classifier(tmp_path / "c.tflite", custom_op="EdgerunMystery"), 64 * 1024)
    assert result.unsupported == ["CUSTOM:EdgerunMystery"]
    assert not result.ok and result.arena_needed is None


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    model = build_int8_classifier(tmp_path / "m.tflite")
    ok = subprocess.run(
        [sys.executable, "-m", "edgerun", "model", "check-mcu", str(model), "--arena", "64k", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    small = subprocess.run(
        [sys.executable, "-m", "edgerun", "model", "check-mcu", str(model), "--arena", "512"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert small.returncode == 1 and "result     NOT OK" in small.stdout
    bad = tmp_path / "not.tflite"
    bad.write_bytes(b"hello world, not a model")
    refused = subprocess.run(
        [sys.executable, "-m", "edgerun", "model", "check-mcu", str(bad)], capture_output=True, text=True, check=False
    )
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].endswith("not a TFLite flatbuffer (no TFL3 identifier)")


def test_parse_size() -> None:
    assert parse_size("64k") == 65536 and parse_size("1M") == 1 << 20 and parse_size("300") == 300
    assert parse_size("64KiB") == 65536
    with pytest.raises(ModelError, match="--arena: expected a size like 64k"):
        parse_size("lots")


def test_a_kernel_that_refuses_its_input_is_quoted(tmp_path: Path) -> None:
    """float16 weights behind DEQUANTIZE (how BlazeFace ships) run in TFLite but not in TFLM."""
    t = schema.TensorType
    inp = me.Tensor(shape=(1, 4), dtype=t.FLOAT32, name="input")
    half = me.Tensor(shape=(1, 4), dtype=t.FLOAT16, name="half", data=np.ones((1, 4), np.float16))
    full = me.Tensor(shape=(1, 4), dtype=t.FLOAT32, name="full")
    out = me.Tensor(shape=(1, 4), dtype=t.FLOAT32, name="out")
    deq = me.Operator(opcode=schema.BuiltinOperator.DEQUANTIZE, inputs=[half], outputs=[full])
    add = me.Operator(opcode=schema.BuiltinOperator.ADD, inputs=[inp, full], outputs=[out])
    add._fb.builtinOptionsType = schema.BuiltinOptions.AddOptions
    add._fb.builtinOptions = schema.AddOptionsT()
    graph = me.Subgraph(tensors=[inp, half, full, out], operators=[deq, add], inputs=[inp], outputs=[out])
    model = tmp_path / "f16.tflite"
    model.write_bytes(bytes(me.Model(subgraphs=[graph]).build()))
    result = check_mcu_model(model, 64 * 1024)
    assert result.unsupported == [] and result.arena_needed is None and not result.ok
    assert "Node DEQUANTIZE (number 0) failed to prepare" in result.error
    assert "arena      not measured" in result.format()

"""``edgerun model check-mcu``: will this .tflite model run on an MCU, in how much arena, how fast.

The model is run in the reference TFLite Micro interpreter (Google's ``tflite-micro`` wheel, the
same kernels an MCU build links). It reports every op and whether TFLM resolves it, the smallest
tensor arena it allocates and invokes in (a binary search over real interpreter instances), and
the invoke time on this host. The arena is measured with this host's pointer size: a 32-bit MCU
needs the same or a little less.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.errors import ModelError

MAX_ARENA = 16 * 1024 * 1024
ARENA_STEP = 64  # the search stops when the bounds are this close
_UNSUPPORTED = (
    re.compile(r"Didn't find op for builtin opcode '([A-Z0-9_]+)'"),
    re.compile(r"Failed to get registration from op code ([A-Z0-9_]+)"),
)


@dataclass
class McuCheck:
    model: str
    size_bytes: int
    ops: dict[str, int]
    unsupported: list[str]
    arena_limit: int
    arena_needed: int | None  # None: did not run in MAX_ARENA
    fits: bool
    invoke_ms_median: float | None
    invoke_ms_max: float | None
    error: str = ""
    inputs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unsupported and self.fits and not self.error

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}

    def format(self) -> str:
        lines = [f"model      {self.model} ({self.size_bytes} bytes)"]
        ops = ", ".join(f"{name} x{count}" for name, count in sorted(self.ops.items()))
        lines.append(f"ops        {ops}")
        lines.append(f"supported  {'all' if not self.unsupported else 'NO: ' + ', '.join(self.unsupported)}")
        if self.arena_needed is None:
            lines.append("arena      not measured: the model does not run in TFLite Micro")
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"arena      {self.arena_needed} bytes needed; {verdict} in {self.arena_limit} bytes")
        if self.invoke_ms_median is not None:
            timing = f"{self.invoke_ms_median:.3f} ms median, {self.invoke_ms_max:.3f} ms max"
            lines.append(f"invoke     {timing} (this host)")
        if self.error:
            lines.append(f"error      {self.error}")
        lines.append(f"result     {'OK' if self.ok else 'NOT OK'}")
        return "\n".join(lines)


def parse_size(text: str) -> int:
    """``64k``, ``1M``, ``65536`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)[iI]?[bB]?\s*", text)
    if not m:
        raise ModelError(f"--arena: expected a size like 64k, 512k or 1M, got {text!r}")
    scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    return int(m.group(1)) * scale


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """TFLM prints its reasons with MicroPrintf to fd 2: catch them to name unsupported ops."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.extend(tmp.read().decode("utf-8", "replace").splitlines())


def _read_model(data: bytes) -> tuple[dict[str, int], int]:
    """Op name -> count over every subgraph, and the main subgraph's number of inputs."""
    from tflite_micro.tensorflow.lite.micro.python import schema_py_generated as schema

    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(data), 0))
    counts: collections.Counter[str] = collections.Counter()
    for sub in model.subgraphs or []:
        for op in sub.operators or []:
            code = model.operatorCodes[op.opcodeIndex]
            builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
            name = names.get(builtin, str(builtin))
            if name == "CUSTOM" and code.customCode:
                name = f"CUSTOM:{code.customCode.decode() if isinstance(code.customCode, bytes) else code.customCode}"
            counts[name] += 1
    main = (model.subgraphs or [None])[0]
    inputs = 0 if main is None or main.inputs is None else len(main.inputs)
    return dict(counts), inputs


class _Runner:
    def __init__(self, data: bytes, inputs: int, seed: int = 0) -> None:
        self.data = data
        self.inputs = inputs
        self.rng = np.random.default_rng(seed)
        self.last_error = ""
        self.log: list[str] = []

    def make(self, arena: int) -> Any:
        from tflite_micro.python.tflite_micro import runtime

        with _captured_stderr() as log:
            try:
                interp = runtime.Interpreter.from_bytes(self.data, arena_size=arena)
                self.fill(interp)
                interp.invoke()
            except (RuntimeError, ValueError) as err:
                interp = None
                self.last_error = str(err).splitlines()[0] if str(err) else type(err).__name__
        self.log.extend(log)
        return interp

    def fill(self, interp: Any) -> None:
        for index in range(self.inputs):
            details = interp.get_input_details(index)
            dtype = np.dtype(details["dtype"])
            shape = tuple(int(s) for s in details["shape"])
            if np.issubdtype(dtype, np.integer):
                info = np.iinfo(dtype)
                value = self.rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
            else:
                value = self.rng.standard_normal(shape).astype(dtype)
            interp.set_input(value, index)


NO_TFLITE_MICRO = (
    "check-mcu needs the tflite-micro wheel: pip install 'edgerun[mcu-check]' "
    "(x86_64 Linux only: there is no aarch64 wheel, so run the check on a workstation)"
)


def check_mcu_model(path: str | Path, arena_limit: int, runs: int = 20) -> McuCheck:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelError(f"{path}: cannot read ({err.strerror})") from None
    if len(data) < 8 or data[4:8] != b"TFL3":
        raise ModelError(f"{path}: not a TFLite flatbuffer (no TFL3 identifier)")
    try:
        import tflite_micro  # noqa: F401
    except ImportError:  # else the flatbuffer reader's import fails below and reads as a damaged model
        raise ModelError(NO_TFLITE_MICRO) from None
    try:
        ops, n_inputs = _read_model(data)
    except Exception as err:  # the generated flatbuffer reader raises anything on a damaged file
        raise ModelError(f"{path}: cannot parse the TFLite model ({type(err).__name__})") from None
    runner = _Runner(data, n_inputs)
    interp = runner.make(MAX_ARENA)
    unsupported = sorted({m.group(1) for line in runner.log for rx in _UNSUPPORTED for m in rx.finditer(line)})
    unsupported = [name for name in ops if name.split(":")[0] in unsupported] or unsupported
    if interp is None:
        # TFLM's own words say which kernel refused what (e.g. DEQUANTIZE of float16 weights).
        why = [
            line.split("/kernels/")[-1].rstrip(".")
            for line in runner.log
            if "was not true" in line or "failed to prepare" in line
        ]
        error = "" if unsupported else "; ".join([runner.last_error, *why[:2]])
        return McuCheck(str(path), len(data), ops, unsupported, arena_limit, None, False, None, None, error=error)
    # Smallest arena that allocates and invokes: an interpreter per probe, binary search.
    lo, hi = 0, MAX_ARENA
    while hi - lo > ARENA_STEP:
        mid = (lo + hi) // 2
        if runner.make(mid) is not None:
            hi = mid
        else:
            lo = mid
    needed = hi
    interp = runner.make(max(arena_limit, needed))
    times = []
    for _ in range(runs):
        runner.fill(interp)
        t0 = time.perf_counter()
        interp.invoke()
        times.append((time.perf_counter() - t0) * 1000.0)
    inputs = []
    for i in range(n_inputs):
        d = interp.get_input_details(i)
        inputs.append({"shape": [int(s) for s in d["shape"]], "dtype": np.dtype(d["dtype"]).name})
    return McuCheck(
        str(path),
        len(data),
        ops,
        [],
        arena_limit,
        needed,
        needed <= arena_limit,
        round(statistics.median(times), 4),
        round(max(times), 4),
        inputs=inputs,
    )

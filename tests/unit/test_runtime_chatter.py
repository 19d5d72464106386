"""LiteRT's "INFO: Created TensorFlow Lite XNNPACK delegate for CPU." stays out of the user's terminal.

Real ``edgerun model inspect`` processes load the demo model through the TFLite engine; the C++ runtime
writes its line to file descriptor 2 (not Python's sys.stderr), so only a separate process shows whether it
reaches the terminal. With -vv it is logged at debug, so nothing the runtime says is thrown away.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHATTER = "Created TensorFlow Lite XNNPACK delegate for CPU."

pytestmark = pytest.mark.timeout(120)


def inspect(bundle: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgerun", "model", "inspect", str(bundle), *extra],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_a_model_load_prints_nothing_of_the_runtime_on_stderr(blazeface_bundle) -> None:
    done = inspect(blazeface_bundle.root)
    assert done.returncode == 0, done.stderr
    assert "input" in done.stdout  # the model was loaded and described
    assert CHATTER not in done.stderr
    assert done.stderr == ""


def test_the_runtime_line_is_a_debug_log_line_with_vv(blazeface_bundle) -> None:
    done = inspect(blazeface_bundle.root, "-vv")
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stderr.splitlines() if CHATTER in line]
    assert " DEBUG edgerun.engines.runtime: model.tflite (tflite): INFO: " + CHATTER in line

"""The C firmware library in CI: its cmocka tests under ASan/UBSan, the host sim, and the C-written vectors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRMWARE = REPO / "firmware_mcu"

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("cc") is None, reason="needs make and a C compiler"
)


def _make(*targets: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-C", str(FIRMWARE), *targets], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(600)
def test_c_unit_tests_pass_under_sanitizers() -> None:
    proc = _make("test")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Both suites ran to the end: cmocka prints one PASSED line per group (on stderr).
    output = proc.stdout + proc.stderr
    assert output.count("[  PASSED  ]") == 2, output[-2000:]
    assert "FAILED" not in output


@pytest.mark.timeout(300)
def test_sim_builds_and_its_vectors_match_the_committed_file() -> None:
    proc = _make("sim")
    assert proc.returncode == 0, proc.stderr[-4000:]
    sim = FIRMWARE / "build" / "edgelink-sim"
    out = subprocess.run([str(sim), "--vectors"], capture_output=True, text=True, timeout=30, check=True).stdout
    committed = (FIRMWARE / "tests" / "vectors" / "c_frames.json").read_text()
    assert out == committed, "C encoder changed: run `make -C firmware_mcu vectors` and review the diff"

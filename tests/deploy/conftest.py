"""deploy/install.sh run into a temporary DESTDIR once per session, for the systemd and sandbox tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


@dataclass
class Installed:
    root: Path  # the DESTDIR
    wheel: Path
    root_key: Path
    swarm_key: Path
    log: str


def run_install(root: Path, wheel: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """deploy/install.sh into ``root``, offline: the node from ``wheel``, its dependencies from this venv."""
    env = {
        **os.environ,
        "DESTDIR": str(root),
        "PYTHON": os.path.realpath(sys.executable),  # the base interpreter, as python3 would be on a board
        "EDGERUN_PIP_ARGS": "--no-deps --no-index",
    }
    return subprocess.run(
        ["bash", str(DEPLOY / "install.sh"), "--source", str(wheel), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def link_test_dependencies(root: Path) -> None:
    """The node's dependencies come from this test venv (no download in CI): a .pth file, after the node itself."""
    site = next((root / "opt/edgerun/.venv/lib").glob("python3*/site-packages"))
    deps = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    (site / "zz-edgerun-test-deps.pth").write_text(f"{deps}\n")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The node's wheel, built from a copy of the sources (the checkout stays clean), without network."""
    src = tmp_path_factory.mktemp("src")
    for name in ("edgerun", "swarm", "setup.cfg", "pyproject.toml", "README.md"):  # what a board runs
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("edgerun-*.whl"))


@pytest.fixture(scope="session")
def installed(wheel, blazeface_bundle) -> Installed:
    """A board-shaped tree (Raspberry Pi drop-in) with the demo model, an OTA root key and a swarm key."""
    from edgerun.ota.minisign import SecretKey

    # World-traversable (not pytest's 0700 tmp): the sandboxed node runs as the edgerun account.
    root = Path(tempfile.mkdtemp(prefix="edgerun-destdir-", dir="/tmp"))
    root.chmod(0o755)
    keys = Path(tempfile.mkdtemp(prefix="edgerun-keys-"))
    root_key = keys / "root0.pub"
    root_key.write_text(SecretKey.generate().public_key.to_text())
    swarm_key = keys / "swarm.key"
    swarm_key.write_text("c2VjcmV0LXN3YXJtLWtleS0zMi1ieXRlcy1sb25nISE=\n")
    proc = run_install(
        root,
        wheel,
        "--board",
        "pi",
        "--model",
        str(blazeface_bundle.root),
        "--root-key",
        str(root_key),
        "--swarm-key",
        str(swarm_key),
    )
    assert proc.returncode == 0, proc.stderr
    link_test_dependencies(root)
    yield Installed(root, wheel, root_key, swarm_key, proc.stdout + proc.stderr)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(keys, ignore_errors=True)


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> bytes:
    """GET ``url`` until it answers 200 (or the process exits, or time runs out)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.read()
        except (OSError, urllib.error.HTTPError) as err:
            last = err
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s: {last}")

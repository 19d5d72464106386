"""MCU releases: signed like the node's own OTA releases, checked by the node before any byte is relayed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from edgerun.mcu.release import (
    IMAGE_FILE,
    MANIFEST_FILE,
    SIGNATURE_FILE,
    McuManifest,
    build_mcu_release,
    verify_mcu_release,
)
from edgerun.ota.errors import Rejected
from edgerun.ota.minisign import SecretKey

IMAGE = bytes(range(256)) * 40


@pytest.fixture()
def key() -> SecretKey:
    return SecretKey.generate()


def test_release_round_trips_and_pins_the_image(tmp_path: Path, key: SecretKey) -> None:
    out = build_mcu_release(IMAGE, "person-int8", 3, tmp_path / "rel", key)
    release = verify_mcu_release(out, [key.public_key])
    assert release.manifest == McuManifest("person-int8", 3, len(IMAGE), hashlib.sha256(IMAGE).digest())
    assert release.image == IMAGE
    assert release.key_id == key.key_id
    raw = (out / MANIFEST_FILE).read_bytes()
    assert len(raw) == 64 and raw[:4] == b"EMM1"
    assert McuManifest.parse(raw).encode() == raw


@pytest.mark.skipif(shutil.which("minisign") is None, reason="needs the minisign binary")
def test_minisign_itself_verifies_the_manifest_signature(tmp_path: Path, key: SecretKey) -> None:
    out = build_mcu_release(IMAGE, "kws", 1, tmp_path / "rel", key)
    pub = tmp_path / "key.pub"
    pub.write_text(key.public_key.to_text())
    proc = subprocess.run(
        ["minisign", "-V", "-p", str(pub), "-m", str(out / MANIFEST_FILE), "-x", str(out / SIGNATURE_FILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "name:kws" in proc.stdout and "version:1" in proc.stdout


def test_refusals_name_the_file_and_reason(tmp_path: Path, key: SecretKey) -> None:
    out = build_mcu_release(IMAGE, "kws", 2, tmp_path / "rel", key)
    other = SecretKey.generate()
    with pytest.raises(Rejected, match="signed by no trusted key") as err:
        verify_mcu_release(out, [other.public_key])
    assert err.value.code == "unknown_key"

    image = bytearray(IMAGE)
    image[100] ^= 1
    (out / IMAGE_FILE).write_bytes(bytes(image))
    with pytest.raises(Rejected, match=r"image.bin: does not match the signed size and SHA-256") as err:
        verify_mcu_release(out, [key.public_key])
    assert err.value.code == "hash_mismatch"

    (out / IMAGE_FILE).write_bytes(IMAGE)
    manifest = bytearray((out / MANIFEST_FILE).read_bytes())
    manifest[4] = 9  # version 2 -> 9
    (out / MANIFEST_FILE).write_bytes(bytes(manifest))
    with pytest.raises(Rejected, match="does not match the file") as err:
        verify_mcu_release(out, [key.public_key])
    assert err.value.code == "bad_signature"


def test_trusted_comment_must_name_the_manifest(tmp_path: Path, key: SecretKey) -> None:
    out = build_mcu_release(IMAGE, "kws", 2, tmp_path / "rel", key)
    data = (out / MANIFEST_FILE).read_bytes()
    sig = key.sign(data, "timestamp:1\tfile:manifest.bin\tname:kws\tversion:1")  # says v1, manifest is v2
    (out / SIGNATURE_FILE).write_text(sig.to_text())
    with pytest.raises(Rejected, match="trusted comment says kws v1, the manifest kws v2"):
        verify_mcu_release(out, [key.public_key])


def test_legacy_signatures_are_refused_because_the_mcu_checks_prehashed_only(tmp_path: Path, key: SecretKey) -> None:
    out = build_mcu_release(IMAGE, "kws", 2, tmp_path / "rel", key)
    data = (out / MANIFEST_FILE).read_bytes()
    sig = key.sign(data, McuManifest.parse(data).trusted_comment(1), prehash=False)
    (out / SIGNATURE_FILE).write_text(sig.to_text())
    with pytest.raises(Rejected, match="legacy signature"):
        verify_mcu_release(out, [key.public_key])


def test_build_refuses_bad_names_and_sizes(tmp_path: Path, key: SecretKey) -> None:
    with pytest.raises(Rejected, match="MCU model name 'much-too-long-model-name'"):
        build_mcu_release(IMAGE, "much-too-long-model-name", 1, tmp_path, key)
    with pytest.raises(Rejected, match="MCU image: 0 bytes"):
        build_mcu_release(b"", "kws", 1, tmp_path, key)
    with pytest.raises(Rejected, match=r"MCU model version 0: expected 1..4294967295"):
        build_mcu_release(IMAGE, "kws", 0, tmp_path, key)
    with pytest.raises(Rejected, match="magic b'XMM1'"):
        McuManifest.parse(b"XMM1" + bytes(60))


def test_command_line_signs_a_release(tmp_path: Path, key: SecretKey) -> None:
    from edgerun.mcu.release import main

    (tmp_path / "release.key").write_text(key.to_text())
    (tmp_path / "model.bin").write_bytes(IMAGE)
    args = [str(tmp_path / "model.bin"), "--name", "kws", "--version", "4", "--key", str(tmp_path / "release.key")]
    assert main([*args, "--out", str(tmp_path / "rel")]) == 0
    assert verify_mcu_release(tmp_path / "rel", [key.public_key]).manifest.version == 4
    assert main([*args[:-2], "--key", str(tmp_path / "missing.key"), "--out", str(tmp_path / "x")]) == 2

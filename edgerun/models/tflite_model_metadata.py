"""TFLite Model Metadata: the ``M001`` flatbuffer a ``.tflite`` carries in its ``TFLITE_METADATA`` entry.

The TFLite Support metadata writer (TF Hub's and Model Maker's files,
MediaPipe's) stores there, per input and output tensor, how to feed and read
it: ``NormalizationOptions`` (mean and std of the float input), ``Stats``
(the input's float range), the image colour space, and the associated files
(the label map of an output is a ``TENSOR_AXIS_LABELS`` file packed in the
``.tflite``'s appended zip).

Read here with the ``flatbuffers`` runtime (LiteRT's own dependency) over the
table layout of ``metadata_schema.fbs`` (tensorflow/tflite-support, the copy
MediaPipe ships in ``mediapipe/tasks/metadata``): the fields below are the
schema's, in its order. The generated reader that schema comes with ships only
inside ``tflite-support`` (last release 0.4.4, 2023, which pins
``protobuf<4`` while onnx and LiteRT need protobuf 4 or later, so pip cannot
install it beside them) and inside ``mediapipe`` (a platform wheel of some
40 MB with its own dependencies, for one generated file). The tests compare
this reader with MediaPipe's generated one, taken from the pinned wheel.

Metadata is untrusted bytes: anything malformed reads as no metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METADATA_BUFFER = b"TFLITE_METADATA"  # the model's metadata entry holding TFLite Model Metadata ...
METADATA_IDENTIFIER = b"M001"  # ... a flatbuffer with this file identifier

# metadata_schema.fbs: field slots (declaration order) of the tables read here.
_MODEL = {"name": 0, "description": 1, "version": 2, "subgraph_metadata": 3, "author": 4, "license": 5}
_MODEL_FILES = 6  # ModelMetadata.associated_files
_SUBGRAPH = {"input_tensor_metadata": 2, "output_tensor_metadata": 3, "associated_files": 4}
_TENSOR = {"name": 0, "content": 3, "process_units": 4, "stats": 5, "associated_files": 6}
_FILE = {"name": 0, "description": 1, "type": 2, "locale": 3}
# unions: a ``<name>_type`` byte in the slot before the value
_CONTENT_PROPERTIES_TYPE, _CONTENT_PROPERTIES = 0, 1
_PROCESS_UNIT_TYPE, _PROCESS_UNIT_OPTIONS = 0, 1
IMAGE_PROPERTIES = 2  # ContentProperties.ImageProperties
NORMALIZATION_OPTIONS = 1  # ProcessUnitOptions.NormalizationOptions
COLOR_SPACES = {0: "UNKNOWN", 1: "RGB", 2: "GRAYSCALE"}
# AssociatedFileType
TENSOR_AXIS_LABELS = 2
TENSOR_VALUE_LABELS = 3
FILE_TYPES = {
    0: "UNKNOWN",
    1: "DESCRIPTIONS",
    2: "TENSOR_AXIS_LABELS",
    3: "TENSOR_VALUE_LABELS",
    4: "TENSOR_AXIS_SCORE_CALIBRATION",
    5: "VOCABULARY",
    6: "SCANN_INDEX_FILE",
}


@dataclass(frozen=True)
class AssociatedFile:
    name: str
    type: str  # one of FILE_TYPES' names
    locale: str = ""


@dataclass(frozen=True)
class TensorMetadata:
    name: str = ""
    color_space: str | None = None  # "RGB" or "GRAYSCALE" for an image input (ImageProperties)
    mean: list[float] | None = None  # NormalizationOptions: the float input is (pixel - mean) / std
    std: list[float] | None = None
    stats_min: list[float] | None = None  # Stats: the tensor's float range
    stats_max: list[float] | None = None
    files: list[AssociatedFile] = field(default_factory=list)

    def label_file(self) -> str | None:
        """The tensor's label map: its first axis-labels file without a locale (else the first of any locale)."""
        labels = [f for f in self.files if f.type == "TENSOR_AXIS_LABELS"]
        plain = [f for f in labels if not f.locale]
        chosen = plain or labels
        return chosen[0].name if chosen else None


@dataclass(frozen=True)
class ModelMetadata:
    name: str = ""
    description: str = ""
    version: str = ""
    author: str = ""
    license: str = ""
    inputs: list[TensorMetadata] = field(default_factory=list)
    outputs: list[TensorMetadata] = field(default_factory=list)
    files: list[AssociatedFile] = field(default_factory=list)  # the model's and its subgraph's own


def read(data: bytes) -> ModelMetadata | None:
    """The TFLite Model Metadata of the ``.tflite`` bytes ``data``; None when it has none or it is unreadable."""
    blob = metadata_buffer(data)
    if blob is None or blob[4:8] != METADATA_IDENTIFIER:
        return None
    try:
        return _model_metadata(blob)
    except Exception:  # a corrupt flatbuffer raises whatever the reads hit (IndexError, struct.error, ...)
        return None


def metadata_buffer(data: bytes) -> bytes | None:
    """The bytes of the model's ``TFLITE_METADATA`` entry, read with the TFLite schema LiteRT ships."""
    try:
        from ai_edge_litert import schema_py_generated as schema
    except ImportError:
        try:
            import tflite as schema
        except ImportError:
            return None
    try:
        model = schema.Model.GetRootAsModel(data, 0)
        for i in range(model.MetadataLength()):
            entry = model.Metadata(i)
            if entry.Name() != METADATA_BUFFER:
                continue
            buffer = model.Buffers(entry.Buffer())
            blob = buffer.DataAsNumpy().tobytes() if buffer.DataLength() else b""
            if not blob and buffer.Size():  # large models keep buffers after the flatbuffer
                blob = data[buffer.Offset() : buffer.Offset() + buffer.Size()]
            return bytes(blob)
    except Exception:  # a corrupt flatbuffer raises whatever the generated reader hits
        return None
    return None


def _model_metadata(blob: bytes) -> ModelMetadata:
    from flatbuffers import encode, packer
    from flatbuffers.table import Table

    root = Table(bytearray(blob), encode.Get(packer.uoffset, blob, 0))
    subgraphs = _tables(root, _MODEL["subgraph_metadata"])
    inputs: list[TensorMetadata] = []
    outputs: list[TensorMetadata] = []
    files = [_file(t) for t in _tables(root, _MODEL_FILES)]
    if subgraphs:
        inputs = [_tensor(t) for t in _tables(subgraphs[0], _SUBGRAPH["input_tensor_metadata"])]
        outputs = [_tensor(t) for t in _tables(subgraphs[0], _SUBGRAPH["output_tensor_metadata"])]
        files += [_file(t) for t in _tables(subgraphs[0], _SUBGRAPH["associated_files"])]
    return ModelMetadata(
        name=_string(root, _MODEL["name"]),
        description=_string(root, _MODEL["description"]),
        version=_string(root, _MODEL["version"]),
        author=_string(root, _MODEL["author"]),
        license=_string(root, _MODEL["license"]),
        inputs=inputs,
        outputs=outputs,
        files=files,
    )


def _tensor(table: Any) -> TensorMetadata:
    color_space = mean = std = stats_min = stats_max = None
    content = _table(table, _TENSOR["content"])
    if content is not None and _byte(content, _CONTENT_PROPERTIES_TYPE) == IMAGE_PROPERTIES:
        image = _union(content, _CONTENT_PROPERTIES)
        if image is not None:
            color_space = COLOR_SPACES.get(_byte(image, 0), "UNKNOWN")
    for unit in _tables(table, _TENSOR["process_units"]):
        if _byte(unit, _PROCESS_UNIT_TYPE) == NORMALIZATION_OPTIONS and mean is None:
            options = _union(unit, _PROCESS_UNIT_OPTIONS)
            if options is not None:
                mean, std = _floats(options, 0), _floats(options, 1)
    stats = _table(table, _TENSOR["stats"])
    if stats is not None:
        stats_max, stats_min = _floats(stats, 0), _floats(stats, 1)
    return TensorMetadata(
        name=_string(table, _TENSOR["name"]),
        color_space=color_space,
        mean=mean,
        std=std,
        stats_min=stats_min,
        stats_max=stats_max,
        files=[_file(t) for t in _tables(table, _TENSOR["associated_files"])],
    )


def _file(table: Any) -> AssociatedFile:
    kind = _byte(table, _FILE["type"])
    return AssociatedFile(
        name=_string(table, _FILE["name"]), type=FILE_TYPES.get(kind, "UNKNOWN"), locale=_string(table, _FILE["locale"])
    )


# -- flatbuffer table reads by field slot (vtable entry 4 + 2 * slot) ---------------------------


def _offset(table: Any, slot: int) -> int:
    return int(table.Offset(4 + 2 * slot))


def _string(table: Any, slot: int) -> str:
    o = _offset(table, slot)
    return table.String(o + table.Pos).decode("utf-8", "replace").strip() if o else ""


def _byte(table: Any, slot: int) -> int:
    from flatbuffers import number_types

    o = _offset(table, slot)
    return int(table.Get(number_types.Int8Flags, o + table.Pos)) if o else 0


def _table(table: Any, slot: int) -> Any:
    from flatbuffers.table import Table

    o = _offset(table, slot)
    return Table(table.Bytes, table.Indirect(o + table.Pos)) if o else None


def _union(table: Any, slot: int) -> Any:
    from flatbuffers.table import Table

    o = _offset(table, slot)
    if not o:
        return None
    union = Table(bytearray(), 0)
    table.Union(union, o)
    return Table(union.Bytes, union.Pos)


def _tables(table: Any, slot: int) -> list[Any]:
    from flatbuffers.table import Table

    o = _offset(table, slot)
    if not o:
        return []
    start = table.Vector(o)
    return [Table(table.Bytes, table.Indirect(start + 4 * i)) for i in range(table.VectorLen(o))]


def _floats(table: Any, slot: int) -> list[float] | None:
    from flatbuffers import encode, packer

    o = _offset(table, slot)
    if not o:
        return None
    start = table.Vector(o)
    return [float(encode.Get(packer.float32, table.Bytes, start + 4 * i)) for i in range(table.VectorLen(o))]

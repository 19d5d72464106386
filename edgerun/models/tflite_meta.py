"""What a ``.tflite`` file says about itself, beyond its tensors.

A TFLite flatbuffer tolerates a zip archive appended to it, and exporters use
that to ship files inside the model:

* Ultralytics appends ``metadata.json`` (its export metadata: ``names``,
  ``imgsz``, ``stride``, ``task``, ``end2end``, ``version``; written by
  ``_add_tflite_metadata`` and ``utils/export/litert.py``); its releases before
  that used the TFLite Support metadata writer with one associated file holding
  ``str(metadata)``, a Python literal;
* TFLite Model Metadata (the TFLite Support writer) packs its associated files
  the same way, the label map among them (one label a line); which file is an
  output's label map, and how the input is normalised, its metadata flatbuffer
  says (``edgerun.models.tflite_model_metadata``).

An Edge TPU-compiled file holds its compiled subgraph as a custom operator
named ``edgetpu-custom-op``, which no CPU kernel runs.
"""

from __future__ import annotations

import ast
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgerun.errors import ModelError
from edgerun.models import tflite_model_metadata
from edgerun.models.tflite_model_metadata import ModelMetadata

EDGETPU_OP = "edgetpu-custom-op"
TFLITE_IDENTIFIER = b"TFL3"  # the flatbuffer's file identifier, at byte 4
# Associated files larger than this are not labels or metadata (some exporters pack vocabularies).
MAX_MEMBER_BYTES = 1 << 20


@dataclass
class TFLiteInfo:
    edgetpu: bool = False
    ultralytics: dict[str, Any] | None = None  # Ultralytics' export metadata, as written
    labels: list[str] | None = None  # a label map packed with TFLite Model Metadata
    labels_source: str = ""
    members: list[str] = field(default_factory=list)
    model_name: str | None = None  # the name in the file's TFLite Model Metadata (MediaPipe's files carry one)
    metadata: ModelMetadata | None = None  # the file's TFLite Model Metadata, where it has any


def read(path: Path) -> TFLiteInfo:
    """The Edge TPU flag, Ultralytics metadata and a packed label map of ``path``; ModelError if not TFLite."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelError(f"{path}: cannot read ({err.strerror or err})") from None
    if data[4:8] != TFLITE_IDENTIFIER:
        raise ModelError(f"{path}: not a TFLite flatbuffer (no {TFLITE_IDENTIFIER.decode()} identifier)")
    metadata = tflite_model_metadata.read(data)
    info = TFLiteInfo(edgetpu=has_custom_op(data, EDGETPU_OP), model_name=(metadata.name or None) if metadata else None)
    info.metadata = metadata
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        return info  # nothing appended: a plain TFLite file
    with archive:
        named = _metadata_labels(archive, metadata)
        if named is not None:
            info.labels, info.labels_source = named
        for entry in archive.infolist():
            info.members.append(entry.filename)
            if entry.file_size > MAX_MEMBER_BYTES:
                continue
            try:
                text = archive.read(entry).decode("utf-8")
            except (zipfile.BadZipFile, UnicodeDecodeError, OSError, RuntimeError, ValueError):
                continue  # an unreadable member is no metadata; the model itself may still be fine
            parsed = _ultralytics(entry.filename, text)
            if parsed is not None and info.ultralytics is None:
                info.ultralytics = parsed
            elif parsed is None and info.labels is None and entry.filename.lower().endswith(".txt"):
                labels = [line.strip() for line in text.splitlines()]
                while labels and not labels[-1]:
                    labels.pop()
                if labels and "" not in labels:
                    info.labels = labels
                    info.labels_source = f"{entry.filename} packed in the file (TFLite Model Metadata)"
    return info


def _metadata_labels(archive: zipfile.ZipFile, metadata: ModelMetadata | None) -> tuple[list[str], str] | None:
    """The label map the metadata names for an output (its ``TENSOR_AXIS_LABELS`` file), read from the archive."""
    if metadata is None:
        return None
    for i, tensor in enumerate(metadata.outputs):
        name = tensor.label_file()
        if name is None:
            continue
        try:
            entry = archive.getinfo(name)
            if entry.file_size > MAX_MEMBER_BYTES:
                return None
            text = archive.read(entry).decode("utf-8")
        except (KeyError, zipfile.BadZipFile, UnicodeDecodeError, OSError, RuntimeError, ValueError):
            return None  # named but missing or unreadable: the plain .txt search below may still find labels
        if _ultralytics(name, text) is not None:
            return None  # older Ultralytics exports pack str(metadata) as the "label" file; read as such below
        labels = [line.strip() for line in text.splitlines()]
        while labels and not labels[-1]:
            labels.pop()
        if not labels or "" in labels:
            return None
        where = f"{name}, the axis labels of output {i} {tensor.name!r} in the file's TFLite Model Metadata"
        return labels, where
    return None


def _ultralytics(name: str, text: str) -> dict[str, Any] | None:
    """Ultralytics metadata in a packed file: JSON (``metadata.json``) or an older ``str(dict)`` literal."""
    value: Any = None
    if name.endswith(".json"):
        try:
            value = json.loads(text)
        except ValueError:
            return None
    elif text.lstrip().startswith("{"):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    if isinstance(value, dict) and (value.get("author") == "Ultralytics" or {"names", "imgsz"} <= value.keys()):
        return value
    return None


def has_custom_op(data: bytes, op_name: str) -> bool:
    """Whether the model's operator codes name the custom operator ``op_name``.

    Read from the flatbuffer's operator codes with the tflite schema package
    where it is installed; otherwise a search for the name's bytes (the name is
    stored as a plain string in the flatbuffer).
    """
    try:
        import tflite
    except ImportError:
        return op_name.encode() in data
    try:
        model = tflite.Model.GetRootAsModel(data, 0)
        for i in range(model.OperatorCodesLength()):
            code = model.OperatorCodes(i).CustomCode()
            if code is not None and code.decode("utf-8", "replace") == op_name:
                return True
    except Exception:  # a corrupt flatbuffer raises whatever the generated reader hits
        return op_name.encode() in data
    return False


# TensorType codes of the TFLite schema, named as the tensors are shown to the user.
TENSOR_TYPES = {0: "float32", 1: "float16", 2: "int32", 3: "uint8", 4: "int64", 6: "bool", 7: "int16", 9: "int8"}


@dataclass(frozen=True)
class TensorSignature:
    name: str
    shape: tuple[int, ...]
    type: str

    def describe(self) -> str:
        return f"{self.name!r} [{', '.join(str(d) for d in self.shape)}] {self.type}"


def io_signature(path: Path) -> tuple[list[TensorSignature], list[TensorSignature]]:
    """The inputs and outputs of the first subgraph, read from the flatbuffer (a compiled file runs nowhere here)."""
    try:
        from ai_edge_litert import schema_py_generated as schema
    except ImportError:
        import tflite as schema
    data = path.read_bytes()
    try:
        model = schema.Model.GetRootAsModel(data, 0)
        if model.SubgraphsLength() < 1:
            return [], []
        graph = model.Subgraphs(0)

        def tensor(index: int) -> TensorSignature:
            t = graph.Tensors(index)
            shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
            name = (t.Name() or b"").decode("utf-8", "replace")
            return TensorSignature(name, shape, TENSOR_TYPES.get(int(t.Type()), f"type {t.Type()}"))

        inputs = [tensor(graph.Inputs(i)) for i in range(graph.InputsLength())]
        outputs = [tensor(graph.Outputs(i)) for i in range(graph.OutputsLength())]
    except Exception:  # a corrupt flatbuffer raises whatever the generated reader hits
        raise ModelError(f"{path}: its tensors cannot be read from the flatbuffer") from None
    return inputs, outputs


def signature_mismatch(compiled: Path, cpu: Path) -> str | None:
    """Where an Edge TPU file's inputs and outputs differ from its CPU file's (shape and type, in order), or None.

    The compiler keeps the model's inputs and outputs; a CPU file whose tensors
    differ is another model, and failing over to it would feed it the wrong input.
    """
    (tpu_in, tpu_out), (cpu_in, cpu_out) = io_signature(compiled), io_signature(cpu)
    for kind, tpu, cpu_side in (("input", tpu_in, cpu_in), ("output", tpu_out, cpu_out)):
        if len(tpu) != len(cpu_side):
            return f"{len(cpu_side)} {kind}s, the Edge TPU file {len(tpu)}"
        for i, (a, b) in enumerate(zip(tpu, cpu_side)):
            if (a.shape, a.type) != (b.shape, b.type):
                return f"{kind} {i} {b.describe()}, the Edge TPU file's {a.describe()}"
    return None

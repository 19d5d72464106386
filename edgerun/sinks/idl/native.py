"""Python twin of ``edgerun.idl``: the native ``edgerun::DetectionBatch`` DDS type.

Field names are those of the JSON payload so the conversion both ways is a
plain walk; ``tests/unit`` parses the IDL and checks that it matches these
classes, member by member.
"""

# No ``from __future__ import annotations``: cyclonedds reads these annotations as real types.

from dataclasses import dataclass, field

from cyclonedds.idl import IdlStruct
from cyclonedds.idl.annotations import key
from cyclonedds.idl.types import array, float64, int32, sequence, uint32, uint64

TOPIC = "edgerun/detections"
OBJECTS_TOPIC = "edgerun/objects"


@dataclass
class Keypoint(IdlStruct, typename="edgerun::Keypoint"):
    x: float64 = 0.0
    y: float64 = 0.0


@dataclass
class Detection(IdlStruct, typename="edgerun::Detection"):
    label: str = ""
    class_id: int32 = 0
    score: float64 = 0.0
    box: array[float64, 4] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    keypoints: sequence[Keypoint] = field(default_factory=list)


@dataclass
class Pose(IdlStruct, typename="edgerun::Pose"):
    east_m: float64 = 0.0
    north_m: float64 = 0.0
    up_m: float64 = 0.0
    yaw_deg: float64 = 0.0
    pitch_deg: float64 = 0.0
    roll_deg: float64 = 0.0
    hfov_deg: float64 = 0.0


@dataclass
class FrameInfo(IdlStruct, typename="edgerun::FrameInfo"):
    width: uint32 = 0
    height: uint32 = 0
    source: str = ""


@dataclass
class ModelInfo(IdlStruct, typename="edgerun::ModelInfo"):
    name: str = ""
    version: int32 = 0
    engine: str = ""


@dataclass
class DetectionBatch(IdlStruct, typename="edgerun::DetectionBatch"):
    node: str = ""
    key("node")
    schema: str = ""
    seq: uint64 = 0
    ts: float64 = 0.0
    frame: FrameInfo = field(default_factory=FrameInfo)
    model: ModelInfo = field(default_factory=ModelInfo)
    latency_ms: float64 = 0.0
    pose: sequence[Pose, 1] = field(default_factory=list)
    detections: sequence[Detection] = field(default_factory=list)
    trace_id: str = ""  # appended: the frame's OpenTelemetry trace, "" when not traced (JSON: absent)


@dataclass
class FleetObject(IdlStruct, typename="edgerun::FleetObject"):
    id: str = ""
    key("id")
    schema: str = ""
    label: str = ""
    east_m: float64 = 0.0
    north_m: float64 = 0.0
    uncertainty_m: float64 = 0.0
    first_seen: float64 = 0.0
    last_seen: float64 = 0.0
    score: float64 = 0.0
    owner: str = ""
    seen_by: sequence[str] = field(default_factory=list)
    ts: float64 = 0.0
    lat: float64 = 0.0  # WGS84 degrees (edgerun.object/2), appended so version 1 readers still match
    lon: float64 = 0.0
    alt_m: float64 = 0.0

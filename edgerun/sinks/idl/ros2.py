"""ROS 2 ``vision_msgs/msg/Detection2DArray`` (vision_msgs 4.x) as Cyclone DDS types.

ROS 2 over rmw_cyclonedds matches a topic by its DDS type name
(``<pkg>::msg::dds_::<Type>_``) and reads plain XCDR1, keyless; nested types
carry their ROS names too so XTypes assignability checks pass. Layouts follow
the .msg files: vision_msgs 4 uses its own ``Pose2D`` (``Point2D position`` +
``theta``) for the box centre, and ``ObjectHypothesisWithPose`` wraps an
``ObjectHypothesis`` (``string class_id``, ``float64 score``).
"""

# No ``from __future__ import annotations``: cyclonedds reads these annotations as real types.

from dataclasses import dataclass, field

from cyclonedds.idl import IdlStruct
from cyclonedds.idl.types import array, float64, int32, sequence, uint32

TYPE_NAME = "vision_msgs::msg::dds_::Detection2DArray_"


def topic_name(namespace: str) -> str:
    """The DDS topic behind the ROS 2 topic ``/<namespace>/detections``."""
    ns = namespace.strip("/")
    return f"rt/{ns}/detections" if ns else "rt/detections"


@dataclass
class Time(IdlStruct, typename="builtin_interfaces::msg::dds_::Time_"):
    sec: int32 = 0
    nanosec: uint32 = 0


@dataclass
class Header(IdlStruct, typename="std_msgs::msg::dds_::Header_"):
    stamp: Time = field(default_factory=Time)
    frame_id: str = ""


@dataclass
class Point2D(IdlStruct, typename="vision_msgs::msg::dds_::Point2D_"):
    x: float64 = 0.0
    y: float64 = 0.0


@dataclass
class Pose2D(IdlStruct, typename="vision_msgs::msg::dds_::Pose2D_"):
    position: Point2D = field(default_factory=Point2D)
    theta: float64 = 0.0


@dataclass
class BoundingBox2D(IdlStruct, typename="vision_msgs::msg::dds_::BoundingBox2D_"):
    center: Pose2D = field(default_factory=Pose2D)
    size_x: float64 = 0.0
    size_y: float64 = 0.0


@dataclass
class ObjectHypothesis(IdlStruct, typename="vision_msgs::msg::dds_::ObjectHypothesis_"):
    class_id: str = ""
    score: float64 = 0.0


@dataclass
class Point(IdlStruct, typename="geometry_msgs::msg::dds_::Point_"):
    x: float64 = 0.0
    y: float64 = 0.0
    z: float64 = 0.0


@dataclass
class Quaternion(IdlStruct, typename="geometry_msgs::msg::dds_::Quaternion_"):
    x: float64 = 0.0
    y: float64 = 0.0
    z: float64 = 0.0
    w: float64 = 1.0


@dataclass
class Pose(IdlStruct, typename="geometry_msgs::msg::dds_::Pose_"):
    position: Point = field(default_factory=Point)
    orientation: Quaternion = field(default_factory=Quaternion)


@dataclass
class PoseWithCovariance(IdlStruct, typename="geometry_msgs::msg::dds_::PoseWithCovariance_"):
    pose: Pose = field(default_factory=Pose)
    covariance: array[float64, 36] = field(default_factory=lambda: [0.0] * 36)


@dataclass
class ObjectHypothesisWithPose(IdlStruct, typename="vision_msgs::msg::dds_::ObjectHypothesisWithPose_"):
    hypothesis: ObjectHypothesis = field(default_factory=ObjectHypothesis)
    pose: PoseWithCovariance = field(default_factory=PoseWithCovariance)


@dataclass
class Detection2D(IdlStruct, typename="vision_msgs::msg::dds_::Detection2D_"):
    header: Header = field(default_factory=Header)
    results: sequence[ObjectHypothesisWithPose] = field(default_factory=list)
    bbox: BoundingBox2D = field(default_factory=BoundingBox2D)
    id: str = ""


@dataclass
class Detection2DArray(IdlStruct, typename=TYPE_NAME):
    header: Header = field(default_factory=Header)
    detections: sequence[Detection2D] = field(default_factory=list)

"""The data that flows from a frame source to the sinks.

Detections are kept as parallel numpy arrays (one row per object) so decoders
and the letterbox mapping stay vectorised; they become JSON only at the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from edgerun import wire

if TYPE_CHECKING:
    from edgerun.tracing import FrameTraceIds

# Version of the JSON payload published by every sink (edgerun.wire.DETECTIONS_SCHEMA).
PAYLOAD_SCHEMA = wire.DETECTIONS_SCHEMA

# DetectionBatch.engine of a frame a neighbour inferred (offloading): "remote:<the helper's node name>".
REMOTE_ENGINE_PREFIX = "remote:"


@dataclass(slots=True)
class Pose:
    """Camera pose: position in a local east/north/up frame (metres) and attitude (degrees).

    ``origin_lat``/``origin_lon`` (WGS84 degrees) and ``ground_alt_m`` (metres above mean sea level) place
    that frame on Earth: its origin, and the height of its flat ground (the plane up = 0), so ``up_m`` is
    the camera's height above the ground. None: a frame with no geographic anchor (its finds get no lat/lon).
    """

    east_m: float
    north_m: float
    up_m: float
    yaw_deg: float = 0.0
    pitch_deg: float = 0.0
    roll_deg: float = 0.0
    hfov_deg: float = 60.0
    origin_lat: float | None = None
    origin_lon: float | None = None
    ground_alt_m: float | None = None

    @property
    def anchor(self) -> tuple[float, float, float] | None:
        """(lat, lon, ground AMSL m) of the frame's origin, or None when the frame is not on the map."""
        if self.origin_lat is None or self.origin_lon is None or self.ground_alt_m is None:
            return None
        return (self.origin_lat, self.origin_lon, self.ground_alt_m)

    def to_wire(self) -> wire.Pose:
        pose = wire.Pose(
            round(self.east_m, 3),
            round(self.north_m, 3),
            round(self.up_m, 3),
            round(self.yaw_deg, 3),
            round(self.pitch_deg, 3),
            round(self.roll_deg, 3),
            round(self.hfov_deg, 3),
        )
        anchor = self.anchor
        if anchor is not None:
            # The closed form dedup uses (no PROJ pipeline per frame): under 1e-4 of the offset off within 10 km.
            from swarm.geo import offset_latlon

            lat, lon = offset_latlon(anchor[0], anchor[1], self.east_m, self.north_m)
            pose.lat, pose.lon, pose.alt_m = round(lat, 7), round(lon, 7), round(anchor[2] + self.up_m, 2)
        return pose

    def to_payload(self) -> dict[str, float]:
        return msgspec.structs.asdict(self.to_wire())


@dataclass(slots=True)
class Detections:
    """N detections as parallel arrays.

    ``boxes`` are ``(N, 4)`` float32 ``x1, y1, x2, y2``. Decoders return them
    normalised to the model input (0..1); after the letterbox is undone they are
    source-frame pixels. ``keypoints`` is ``(N, K, 2)`` in the same coordinates,
    or ``None`` for models without keypoints.
    """

    boxes: np.ndarray
    scores: np.ndarray
    class_ids: np.ndarray
    keypoints: np.ndarray | None = None

    @classmethod
    def empty(cls, num_keypoints: int = 0) -> Detections:
        kp = np.zeros((0, num_keypoints, 2), np.float32) if num_keypoints else None
        return cls(
            boxes=np.zeros((0, 4), np.float32),
            scores=np.zeros((0,), np.float32),
            class_ids=np.zeros((0,), np.int32),
            keypoints=kp,
        )

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def select(self, index: np.ndarray) -> Detections:
        """The subset at ``index`` (a boolean mask or integer indices)."""
        return Detections(
            boxes=self.boxes[index],
            scores=self.scores[index],
            class_ids=self.class_ids[index],
            keypoints=None if self.keypoints is None else self.keypoints[index],
        )


@dataclass(slots=True)
class FrameMeta:
    """What is known about one captured frame before inference."""

    seq: int
    source: str
    width: int
    height: int
    wall_time: float  # time.time() at capture, for payloads
    t_capture: float  # time.monotonic() at capture, for latency
    pose: Pose | None = None
    # Ground truth from synthetic sources: (M, 4) xyxy pixels and their labels.
    truth_boxes: np.ndarray | None = None
    truth_labels: tuple[str, ...] = ()


@dataclass(slots=True)
class DetectionBatch:
    """All detections of one frame, in source-frame pixels, ready for the sinks."""

    node_id: str
    meta: FrameMeta
    detections: Detections
    labels: tuple[str, ...]
    model_name: str
    model_version: int
    engine: str
    # Monotonic timestamps of each stage's end, keyed by stage name.
    stamps: dict[str, float] = field(default_factory=dict)
    # Pictures of some detections, by detection index, copied out of the frame before its slot went back to
    # the pool (edgerun.fleet.find_images.FindCrop); None when nobody asked for them.
    crops: dict[int, Any] | None = None
    # The ids of this frame's trace when it is traced (edgerun.tracing.FrameTracer.begin): set by the infer worker
    # that sent it to a helper, else by the node before the sinks take it; None when not traced.
    trace: FrameTraceIds | None = None

    @property
    def remote_helper(self) -> str | None:
        """The node that inferred this frame for us (offloading), None when it was inferred here."""
        if self.engine.startswith(REMOTE_ENGINE_PREFIX):
            return self.engine[len(REMOTE_ENGINE_PREFIX) :]
        return None

    def label_of(self, class_id: int) -> str:
        if 0 <= class_id < len(self.labels):
            return self.labels[class_id]
        return str(class_id)

    def to_wire(self, t_publish: float | None = None) -> wire.Detections:
        """This frame as the ``edgerun.detections/1`` Struct every sink encodes."""
        det = self.detections
        boxes = np.round(det.boxes.astype(np.float64), 1).tolist()
        scores = np.round(det.scores.astype(np.float64), 4).tolist()
        ids = det.class_ids.tolist()
        label_of = self.label_of
        if det.keypoints is None:
            items = [wire.Detection(label_of(cid), cid, score, box) for box, score, cid in zip(boxes, scores, ids)]
        else:
            keypoints = np.round(det.keypoints.astype(np.float64), 1).tolist()
            items = [
                wire.Detection(label_of(cid), cid, score, box, kp)
                for box, score, cid, kp in zip(boxes, scores, ids, keypoints)
            ]
        meta = self.meta
        return wire.Detections(
            node=self.node_id,
            seq=meta.seq,
            ts=round(meta.wall_time, 6),
            frame=wire.Frame(meta.width, meta.height, meta.source),
            model=wire.ModelRef(self.model_name, self.model_version, self.engine),
            latency_ms=None if t_publish is None else round((t_publish - meta.t_capture) * 1000.0, 3),
            pose=None if meta.pose is None else meta.pose.to_wire(),
            detections=items,
            trace_id=msgspec.UNSET if self.trace is None else self.trace.trace_id_hex,
        )

    def to_payload(self, t_publish: float | None = None) -> dict[str, Any]:
        """The versioned JSON payload documented in docs/payloads.md (schema ``edgerun.detections/1``), as builtins."""
        payload: dict[str, Any] = msgspec.to_builtins(self.to_wire(t_publish))
        return payload

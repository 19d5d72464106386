"""The node's swarm member: gossip membership, ground claims from detections, fleet-object reports.

Runs on the node's event loop beside the sinks (no thread of its own). Per frame it only
projects the frame's boxes onto the ground (a few vectorised numpy ops) and hands the fixes
to ``swarm.dedup.Dedup``; claims go out on the gossip as application broadcasts, and every
gossip interval the objects this node owns are published to the fleet topic through the sinks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any, Callable

import msgspec
import numpy as np

from edgerun import hostport, wire
from edgerun.config import SwarmConfig
from edgerun.errors import ConfigError, EdgerunError
from edgerun.fleet.find_images import FindCropper, FindImages
from edgerun.fleet.member_meta import MemberMeta, MetaUpdate, decode_meta, encode_meta
from edgerun.offload.capabilities import capabilities_due, quantised_capacity
from edgerun.types import DetectionBatch, Pose
from swarm.config import SwarmTiming
from swarm.dedup import Dedup, DedupConfig, Observation, deferral_s
from swarm.geo import CameraPose, LocalFrame, project_boxes
from swarm.membership import UserBroadcast

log = logging.getLogger(__name__)

# When this member's metadata goes out again, and how (see meta_update_kind). Pose, fps and capacity are quiet
# updates (push-pull only), at most every META_QUIET_MIN_S: at 20 members one broadcast update costs the swarm
# ~26 KB (each member retransmits it 8 times), so a broadcast per member per 30 s is the whole 1 KB/s budget.
META_QUIET_MIN_S = 30.0
# A pose that moved farther than this goes out (quietly) without waiting: a camera at the fleet's 30 m with a
# 62 deg lens sees a ground strip ~36 m wide, so past 20 m (or a 45 deg turn, < 1/3 of the view left in common)
# a map drawn from the old pose shows ground the camera no longer sees. Quiet updates cost no datagram (the
# state rides in every push-pull anyway); this only bounds how old the pose is when a push-pull carries it.
META_FAR_M = 20.0
META_FAR_TURN_DEG = 45.0
# Members declared dead that this node keeps counting as missing (the oldest go first past this).
MAX_MISSING_REMEMBERED = 1024
IMAGES_TICK_S = 0.5  # how often the pictures of owned objects are looked at


def camera_pose(pose: Pose) -> CameraPose:
    """The node's camera pose as swarm.geo takes it (the same east/north/up and Z-Y-X attitude convention)."""
    return CameraPose(pose.east_m, pose.north_m, pose.up_m, pose.yaw_deg, pose.pitch_deg, pose.roll_deg, pose.hfov_deg)


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """A swarm address setting (``swarm.bind``, ``swarm.seeds[i]``): host and port both required."""
    return hostport.parse_hostport(text, what, default_host=None)


def swarm_timing(cfg: SwarmConfig) -> SwarmTiming:
    """swarm.config.SwarmTiming with the configured overrides (0 keeps memberlist's LAN default)."""
    timing = cfg.timing
    overrides = {name: getattr(timing, name) for name in timing.__struct_fields__ if getattr(timing, name)}
    try:
        return dataclasses.replace(SwarmTiming(), **overrides)
    except ValueError as err:  # a combination the protocol cannot run with, e.g. a timeout above its interval
        raise ConfigError(f"swarm.timing: {err}") from None


def load_swarm_keyring(path: str) -> Any:
    """The swarm keyring, or a ConfigError naming the file (missing, unreadable, wrong size)."""
    from swarm.keyring import Keyring, KeyringError

    if not path:
        raise ConfigError("swarm.key_file: required when swarm.enabled (make one with `edgerun swarm keygen`)")
    try:
        return Keyring.load(path)
    except KeyringError as err:
        raise ConfigError(f"swarm.key_file: {err}") from None
    except OSError as err:
        raise ConfigError(f"swarm.key_file: {path}: {err.strerror or err}") from None


def meta_update_kind(meta: MemberMeta, sent: tuple[MemberMeta, float] | None, now: float) -> MetaUpdate:
    """How ``meta`` goes out (``sent``: the last published, by either kind, and when).

    Urgent (broadcast, every member within seconds): model, version, engine, fallback and health, which the
    station and the neighbours act on, what is served for offload and whether it is ready
    (``capabilities_due``), and a pose that appears or goes (once a start). Quiet (push-pull, minutes): the
    pose when it moved more than META_FAR_M or turned more than META_FAR_TURN_DEG, anything else (fps, a pose
    that moved less, capacity in its coarse steps) at most every META_QUIET_MIN_S. Capacity is compared in the
    steps it is advertised in, so noise is no news.
    """
    if sent is None:
        return MetaUpdate.URGENT
    last, at = sent
    if (meta.model, meta.version, meta.engine, meta.fallback, meta.health) != (
        last.model,
        last.version,
        last.engine,
        last.fallback,
        last.health,
    ):
        return MetaUpdate.URGENT
    capabilities = capabilities_due(meta, last, at, now, interval_s=META_QUIET_MIN_S)
    if capabilities is not MetaUpdate.NONE:
        return capabilities
    if (meta.east is None) != (last.east is None):
        return MetaUpdate.URGENT  # once a start: whether the camera has a place to be drawn at all
    if meta.east is not None and last.east is not None:
        moved = math.hypot(meta.east - last.east, (meta.north or 0.0) - (last.north or 0.0))
        turned = abs(((meta.yaw or 0.0) - (last.yaw or 0.0) + 180.0) % 360.0 - 180.0)
        if moved > META_FAR_M or turned > META_FAR_TURN_DEG:
            return MetaUpdate.QUIET
    if now - at >= META_QUIET_MIN_S and quantised_capacity(meta) != quantised_capacity(last):
        return MetaUpdate.QUIET
    return MetaUpdate.NONE


class FleetMember:
    """One node's place in the swarm: membership, dedup, fleet-object publishing, metadata."""

    def __init__(
        self,
        cfg: SwarmConfig,
        node_id: str,
        *,
        publish_object: Callable[[dict[str, Any], Callable[[], None]], None],
        publish_event: Callable[[str, dict[str, Any]], None],
        meta: Callable[[], MemberMeta],
        publish_image: Callable[[str, bytes, list[tuple[str, str]]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self._publish_object = publish_object
        self._publish_event = publish_event
        self._meta = meta
        self.keyring = load_swarm_keyring(cfg.key_file)
        self.bind = parse_hostport(cfg.bind, "swarm.bind")
        self.seeds = [parse_hostport(seed, f"swarm.seeds[{i}]") for i, seed in enumerate(cfg.seeds)]
        self.agent: Any = None
        self.dedup: Any = None
        self._task: asyncio.Task[None] | None = None
        self._labels = set(cfg.labels)
        self.objects_published = 0
        self.frames_without_geo = 0  # frames with detections whose pose has no geographic anchor
        self._frame: LocalFrame | None = None  # the tangent plane of the last anchored pose
        self.view_listeners: list[Callable[[dict[str, Any]], None]] = []
        self._sent_meta: tuple[MemberMeta, float] | None = None
        # Declared dead and not back: gossip forgets a dead member after ~30 s, an operator must not.
        self._dead_since: dict[str, float] = {}
        # The picture of each owned find: the cropper runs in the decode thread (the node hands it to the
        # pipeline), FindImages decides on the loop what goes out through publish_image.
        self._publish_image = publish_image
        images_on = cfg.images.enabled and publish_image is not None
        self.cropper = FindCropper(cfg.images, min_score=cfg.min_score, labels=cfg.labels) if images_on else None
        self.images = FindImages(cfg.images, now=time.monotonic()) if images_on else None
        self._images_task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        from swarm.agent import SwarmAgent  # sockets and crypto: only for a node that joins a swarm

        cfg = self.cfg
        now = time.monotonic()
        timing = swarm_timing(cfg)
        # _run ticks dedup every gossip interval; the deferral covers swarms up to dedup's node cap
        defer_s = deferral_s(timing, DedupConfig.max_nodes, timing.gossip_interval_s)
        try:
            dedup_cfg = DedupConfig(
                radius_m=cfg.radius_m,
                window_s=cfg.window_s,
                hold_s=cfg.hold_s,
                defer_s=defer_s,
                share_sightings=cfg.share_sightings,
            )
        except ValueError as err:  # e.g. a window too short to decide a track in (hold_s + defer_s)
            raise ConfigError(f"swarm: {err}") from None
        # Track ids from the wall clock (ms): a restarted node's new tracks do not reuse the ids of claims its
        # peers still hold from before the restart (and the reports those cover).
        self.dedup = Dedup(self.node_id, dedup_cfg, now=now, first_track=int(time.time() * 1000))
        self.agent = SwarmAgent(
            self.node_id, self.bind, timing, self.keyring, meta=encode_meta(self._meta()), seeds=self.seeds
        )
        self.agent.on_event(self._on_swarm_event)
        try:
            await self.agent.start()
        except OSError as err:  # the port is taken or the address is not this machine's: a restart may help
            host, port = self.bind
            raise EdgerunError(f"swarm.bind: cannot listen on {host}:{port}: {err.strerror or err}") from None
        self._task = asyncio.create_task(self._run())
        if self.images is not None:
            self._images_task = asyncio.create_task(self._run_images())
        log.info("swarm: %s gossiping on %s:%d, %d seed(s)", self.node_id, *self.agent.address, len(self.seeds))

    async def stop(self) -> None:
        tasks = [task for task in (self._task, self._images_task) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.dedup is not None and self.agent is not None:
            # Leaving: report what this node still holds and owns, and tell the swarm before going.
            for obj in self.dedup.flush(time.monotonic(), time.time()):
                self._publish(obj)
            for key, payload in self.dedup.outgoing():
                self.agent.queue_broadcast(key, payload)
        if self.agent is not None:
            await self.agent.stop(leave=True)

    # -- per frame, on the loop ---------------------------------------------------

    def observe(self, batch: DetectionBatch) -> None:
        """Hand a frame's detections (with the camera pose) to dedup as ground fixes."""
        pose = batch.meta.pose
        det = batch.detections
        if pose is None or not len(det) or self.dedup is None:
            return
        keep = det.scores >= self.cfg.min_score
        if self._labels:
            keep &= np.array([batch.label_of(c) in self._labels for c in det.class_ids.tolist()], bool)
        if not keep.any():
            return
        anchor = pose.anchor
        if anchor is None:
            # No place on Earth for this frame (a pose source with no geographic anchor): nothing to claim.
            self.frames_without_geo += 1
            return
        idx = np.flatnonzero(keep)
        fixes = project_boxes(det.boxes[idx], camera_pose(pose), batch.meta.width, batch.meta.height)
        hit = ~np.isnan(fixes[:, 0])
        if not hit.any():
            return
        frame = self._frame_of(anchor)
        lat, lon, _ = frame.to_geodetic(fixes[hit, 0], fixes[hit, 1], np.zeros(int(hit.sum())))
        ground = anchor[2]  # the height of the flat ground the box was projected onto
        detection_of = idx[hit].tolist()  # the detection index of each observation
        observations = [
            Observation(
                label=batch.label_of(int(det.class_ids[i])),
                lat=float(la),
                lon=float(lo),
                alt_m=ground,
                sigma_m=float(sigma),
                score=float(det.scores[i]),
            )
            for i, la, lo, sigma in zip(idx[hit].tolist(), lat.tolist(), lon.tolist(), fixes[hit, 2].tolist())
        ]
        if observations:
            tracks = self.dedup.observe(observations, time.monotonic(), batch.meta.wall_time)
            crops, images = batch.crops, self.images
            if crops and images is not None:
                for i, track in zip(detection_of, tracks):
                    crop = crops.get(i)
                    if crop is not None and track is not None:
                        images.offer(track, crop)

    # -- gossip interval -----------------------------------------------------------

    async def _run(self) -> None:
        interval = self.agent.timing.gossip_interval_s
        next_meta = 0.0
        while True:
            now, wall = time.monotonic(), time.time()
            # tick first: a claim it decides (reported, suppressed) goes out in this round, not the next
            for obj in self.dedup.tick(now, wall):
                self._publish(obj)
            for key, payload in self.dedup.outgoing():
                self.agent.queue_broadcast(key, payload)
            if now >= next_meta:
                next_meta = now + self.cfg.meta_interval_s
                meta = self._meta()
                kind = meta_update_kind(meta, self._sent_meta, now)
                if kind is not MetaUpdate.NONE:
                    self.agent.set_meta(encode_meta(meta), broadcast=kind is MetaUpdate.URGENT)
                    self._sent_meta = (meta, now)
                view = self.view()
                for listener in self.view_listeners:
                    listener(view)
            await asyncio.sleep(interval)

    async def _run_images(self) -> None:
        """The pictures of the objects this node owns: encoded off the loop, published within their bounds."""
        images = self.images
        publish = self._publish_image
        assert images is not None and publish is not None
        loop = asyncio.get_running_loop()
        max_bytes = self.cfg.images.max_bytes
        while True:
            await asyncio.sleep(IMAGES_TICK_S)
            images.forget_tracks(self.dedup.track_ids())
            for object_id, crop in images.due(self.dedup.owned_objects(), time.monotonic()):
                if crop.image is not None:
                    await loop.run_in_executor(None, crop.encode, max_bytes)
                if images.take(object_id, crop, time.monotonic()):
                    assert crop.jpeg is not None
                    publish(object_id, crop.jpeg, images.meta(self.node_id, crop).to_properties())

    def _frame_of(self, anchor: tuple[float, float, float]) -> LocalFrame:
        """The tangent plane of a pose's frame (one PROJ pipeline per anchor; a pose source keeps one)."""
        frame = self._frame
        if frame is None or (frame.lat0, frame.lon0, frame.alt0_m) != anchor:
            frame = self._frame = LocalFrame(*anchor)
        return frame

    def _publish(self, obj: Any) -> None:
        """A fleet object this node owns; an update (more drones saw it) goes out under the same id.

        Beside lat/lon, the object's metres east/north of this node's local frame (``origin``), for maps
        drawn in the frame of a scene.
        """
        if not obj.update:
            self.objects_published += 1
        payload = obj.to_payload()
        if self._frame is not None:
            east, north, _ = self._frame.from_geodetic(obj.lat, obj.lon, obj.alt_m)
            payload.update(east_m=round(float(east), 2), north_m=round(float(north), 2), origin=[
                self._frame.lat0, self._frame.lon0, self._frame.alt0_m])  # fmt: skip
        # Through the wire Struct: a field swarm adds that edgerun.wire does not know fails here, in the tests.
        # Only once it is known published (the broker's PUBACK where MQTT is on) do this node's claims say
        # "reported", which lets peers stay quiet about it; until then dedup hands it out again.
        dedup, object_id = self.dedup, obj.id
        self._publish_object(msgspec.to_builtins(wire.FleetObject(**payload)), lambda: dedup.published(object_id))

    def _on_swarm_event(self, event: Any) -> None:
        if isinstance(event, UserBroadcast):
            # bound to the gossip sender: a member's claim naming another node is dropped and counted
            self.dedup.receive(event.payload, time.monotonic(), sender=event.sender)
            return
        member = event.member
        if event.kind in ("join", "alive"):
            self.dedup.resend_claims()  # a newcomer or a healed side has heard none of this node's claims
        elif event.kind in ("dead", "leave"):
            self.dedup.forget_node(member.name)  # its unreported objects go to another owner
        if event.kind == "dead":
            self._dead_since[member.name] = time.monotonic()
            while len(self._dead_since) > MAX_MISSING_REMEMBERED:
                del self._dead_since[next(iter(self._dead_since))]
        elif event.kind in ("join", "alive", "leave"):
            self._dead_since.pop(member.name, None)  # back, or gone on purpose: not missing
        if event.kind in ("join", "dead", "leave", "refute", "suspect", "alive"):
            level = logging.WARNING if event.kind in ("dead", "suspect") else logging.INFO
            log.log(level, "swarm: %s %s (incarnation %d)", member.name, event.kind, member.incarnation)
            self._publish_event(
                "swarm",
                {
                    "change": event.kind,
                    "member": member.name,
                    "incarnation": member.incarnation,
                    "addr": f"{member.addr[0]}:{member.addr[1]}",
                },
            )

    # -- read by the service ---------------------------------------------------------

    def members(self) -> list[Any]:
        return self.agent.members() if self.agent is not None else []

    def missing(self) -> int:
        """Members suspect now, and members declared dead that have not rejoined or left since.

        A dead member stays missing after gossip forgets it, until it rejoins (or leaves cleanly) or this
        node restarts: an alert that waits minutes must still see a member killed minutes ago.
        """
        suspect = {m.name for m in self.members() if m.state.name == "SUSPECT"}
        return len(suspect | set(self._dead_since))

    def view(self) -> dict[str, Any]:
        """This node's view of the swarm, for /healthz and the retained ``swarm`` topic."""
        members = []
        for m in sorted(self.members(), key=lambda m: m.name):
            meta = decode_meta(m.meta)
            members.append(
                wire.SwarmMember(
                    name=m.name,
                    addr=f"{m.addr[0]}:{m.addr[1]}",
                    state=m.state.name.lower(),
                    incarnation=m.incarnation,
                    meta=meta.to_json() if meta is not None else None,
                )
            )
        view: dict[str, Any] = msgspec.to_builtins(
            wire.SwarmView(node=self.node_id, ts=round(time.time(), 3), members=members)
        )
        return view

    def counters(self) -> dict[str, Any]:
        agent_stats = self.agent.stats if self.agent is not None else {}
        dedup_stats = self.dedup.stats if self.dedup is not None else {}
        return {
            "agent": agent_stats,
            "dedup": dedup_stats,
            "objects_published": self.objects_published,
            "frames_without_geo": self.frames_without_geo,
            "images": self.image_counters(),
        }

    def image_counters(self) -> dict[str, Any]:
        """Pictures of owned finds: cropped (decode thread), published, their bytes, and those a bound held back."""
        images, cropper = self.images, self.cropper
        if images is None or cropper is None:
            return {}
        skipped = dict(images.skipped)
        skipped["frame_cap"] += cropper.skipped_frame_cap
        return {
            "cropped": cropper.cropped,
            "published": images.published,
            "bytes": images.bytes_published,
            "skipped": skipped,
        }

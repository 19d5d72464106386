"""``edgerun demo --drones N``: N node processes fly one scene as a swarm, scored against ground truth.

Each drone is a real ``edgerun run`` process with its own replayed flight over the shared
scene (the same lawnmower path, started a few metres apart and shifted sideways, so the views
overlap), gossiping under one swarm key on loopback and publishing to the demo's sinks. The
demo reads what the drones wrote (JSON Lines: detections and fleet objects) and scores it:

* per drone: frames, detections, face recall (the replay is a pure function of the frame
  index, so every published ``seq`` has its exact ground truth);
* the fleet: objects reported, ``duplicate_reports`` (fleet reports beyond the first for one
  ground-truth object) and ``object_recall`` (ground-truth faces seen by some drone that a
  fleet object lies within ``swarm.radius_m`` of).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import tomli_w

from edgerun.config import ReplayConfig, parse_config
from edgerun.demo import LocalListeners, add_demo_settings
from edgerun.hostport import parse_hostport
from edgerun.sources.replay import ReplaySource
from edgerun.testing.jsonl_reader import JsonlTail, read_jsonl
from edgerun.testing.ports import free_port, free_tcp_udp_port
from edgerun.testing.scoring import MIN_TRUTH_HEIGHT_PX, greedy_pairs, iou_matrix
from edgerun.wire import DETECTIONS_SCHEMA, OBJECT_SCHEMA, OBJECT_SCHEMA_V1
from swarm.geo import LocalFrame

# Drone k starts this far behind drone 0 along the path, and this far to the side: overlapping views.
SPACING_M = 3.0
SIDE_STEP_M = (0.0, 0.8, -0.8, 1.6, -1.6)
TRUTH_LABEL = "face"
# The demo scene lays faces 3-6 m apart along a lane; the node default (5 m) would merge neighbours into
# one object, so the demo claims within 2 m.
DEMO_RADIUS_M = 2.0


def write_swarm_key(path: Path) -> None:
    from swarm.keyring import Keyring, generate_key

    Keyring([generate_key()]).save(path)


@dataclass
class Drone:
    """One drone of the demo: its config, output files and process."""

    index: int
    node_id: str
    out_dir: Path
    config: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    log_file: Any = None

    @property
    def detections_path(self) -> Path:
        return self.out_dir / "detections.jsonl"

    @property
    def replay(self) -> ReplayConfig:
        return parse_config(self.config).source.replay


def drone_configs(
    out_dir: Path,
    drones: int,
    *,
    model: str | None = None,
    mqtt: str | None = None,
    dds: bool = False,
    fps: float | None = None,
    seed: int = 1,
    radius_m: float = DEMO_RADIUS_M,
    hold_s: float | None = None,
) -> list[Drone]:
    """One node config per drone: a shared scene and swarm key, a flight and gossip port of its own."""
    key_file = out_dir / "swarm.key"
    write_swarm_key(key_file)
    ports = [free_tcp_udp_port() for _ in range(drones)]
    result = []
    for k in range(drones):
        node_id = f"drone-{k + 1}"
        drone_dir = out_dir / node_id
        drone_dir.mkdir(parents=True, exist_ok=True)
        cfg: dict[str, Any] = {
            "node": {"id": node_id, "log_level": "warning"},
            "source": {
                "kind": "replay",
                "replay": {
                    "seed": seed,
                    "path_offset_m": -SPACING_M * k,
                    "east_offset_m": SIDE_STEP_M[k % len(SIDE_STEP_M)],
                },
            },
            "sinks": {"jsonl": {"path": str(drone_dir / "detections.jsonl")}},
            "service": {"http_port": 0},
            "engine": {"state_dir": str(drone_dir / "state")},
            "swarm": {
                "enabled": True,
                "bind": f"127.0.0.1:{ports[k]}",
                "seeds": [f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != k],
                "key_file": str(key_file),
                "radius_m": radius_m,
                "labels": [TRUTH_LABEL],
                "share_sightings": True,  # three drones: the station shows how many saw each face
            },
        }
        if hold_s is not None:
            cfg["swarm"]["hold_s"] = hold_s
        add_demo_settings(cfg, model=model, mqtt=mqtt, dds=dds, fps=fps)
        parse_config(cfg)  # a bad demo config fails here, before any process starts
        (drone_dir / "node.toml").write_text(tomli_w.dumps(cfg))
        result.append(Drone(k, node_id, drone_dir, cfg))
    return result


@contextlib.contextmanager
def ground_station(mqtt: str, seed: int, log_path: Path, timeout_s: float = 20.0) -> Iterator[str | None]:
    """``edgerun station`` on the demo's broker, the scene under its map; yields its address (None if it failed)."""
    port = free_port()
    # Each demo is a fresh mission: its own store beside its logs (not the operator's default one), emptied first.
    db = log_path.with_name("station.db")
    for stale in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        stale.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "edgerun", "station", "--mqtt", mqtt, "--bind", f"127.0.0.1:{port}",
        "--db", str(db), "--ground", f"replay:{seed}", "--truth", f"replay:{seed}",
        # The demo's drones serve their snapshots on loopback: let the station fetch from there, nowhere else.
        "--node-net", "127.0.0.0/8",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + timeout_s
        answered = False
        while not answered and proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "api/snapshot", timeout=1):
                    answered = True
            except OSError:
                time.sleep(0.2)
        try:
            yield url if answered else None
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_drones(drones: list[Drone], seconds: float) -> None:
    env = dict(os.environ)
    for drone in drones:
        drone.log_file = (drone.out_dir / "node.log").open("wb")
        config = str(drone.out_dir / "node.toml")
        cmd = [sys.executable, "-m", "edgerun", "run", "-c", config, "--seconds", str(seconds)]
        drone.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=drone.log_file, env=env)


def stop_drones(drones: list[Drone], timeout_s: float = 10.0) -> dict[str, int | None]:
    """Wait for (or stop) every drone; their exit codes."""
    deadline = time.monotonic() + timeout_s
    codes: dict[str, int | None] = {}
    for drone in drones:
        if drone.proc is None:
            continue
        try:
            drone.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            drone.proc.send_signal(signal.SIGTERM)
            try:
                drone.proc.wait(5)
            except subprocess.TimeoutExpired:
                drone.proc.kill()
                drone.proc.wait()
        codes[drone.node_id] = drone.proc.returncode
        if drone.log_file is not None:
            drone.log_file.close()
    return codes


@dataclass
class DroneTally:
    frames: int = 0
    detections: int = 0
    truths: int = 0
    matched: int = 0
    objects: set[str] = field(default_factory=set)  # ids of the fleet objects it reported (updates included once)
    # seq -> (faces detected, faces in view): picks the moment the snapshot shows
    frame_scores: dict[int, tuple[int, int]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)


class FleetScore:
    """Scores the drones' published rows as they come: per-drone recall, fleet objects against ground truth.

    Fed row by row (the live status line) or with whole files (the summary); both give the same figures.
    """

    def __init__(self, drones: list[Drone], radius_m: float) -> None:
        self.radius_m = radius_m
        self.sources: dict[str, ReplaySource] = {}
        for drone in drones:
            # The flight is a function of frame index / fps: score at the rate the drone flew (--fps).
            source = ReplaySource(drone.replay, fps=parse_config(drone.config).source.fps)
            source.open()
            self.sources[drone.node_id] = source
        self.scene = next(iter(self.sources.values())).scene
        self.frame = scene_frame(drones[0].replay)
        self.truth_points = self.scene.ground_points
        self.tallies = {d.node_id: DroneTally() for d in drones}
        self.seen_truth: set[int] = set()  # scene objects some drone had in view (>= MIN_TRUTH_HEIGHT_PX)
        # Per scene object: the frames a drone had it in view (drone, seq, box height px), and those in which a
        # detection matched it (drone, seq, capture time): a face never reported was either never detected
        # (the detector's miss) or detected and then lost on the way to the fleet topic (dedup's).
        self.in_view: dict[int, list[tuple[str, int, float]]] = {}
        self.detected: dict[int, list[tuple[str, int, float]]] = {}
        # Each fleet report is one object id published by one owner; later messages of an id are updates.
        self.reports: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        for source in self.sources.values():
            source.close()

    def add(self, drone: str, row: dict[str, Any]) -> None:
        tally = self.tallies[drone]
        schema = row.get("schema")
        if schema in (OBJECT_SCHEMA, OBJECT_SCHEMA_V1):
            tally.objects.add(str(row.get("id")))
            self.reports.setdefault(str(row.get("id")), row)
            return
        if schema != DETECTIONS_SCHEMA:
            return
        tally.frames += 1
        dets = [d for d in row["detections"] if d["label"] == TRUTH_LABEL]
        tally.detections += len(dets)
        if row.get("latency_ms") is not None:
            tally.latencies.append(row["latency_ms"])
        source, frame = self.sources[drone], row["frame"]
        ids, boxes = source.visible(source.pose_at(int(row["seq"])), int(frame["width"]), int(frame["height"]))
        tall = (boxes[:, 3] - boxes[:, 1]) >= MIN_TRUTH_HEIGHT_PX
        keep = np.array([self.scene.labels[i] == TRUTH_LABEL for i in ids.tolist()], bool) & tall
        self.seen_truth.update(ids[keep].tolist())
        tally.truths += int(keep.sum())
        seq = int(row["seq"])
        tally.frame_scores[seq] = (len(dets), int(keep.sum()))
        for truth, box in zip(ids[keep].tolist(), boxes[keep].tolist()):
            self.in_view.setdefault(truth, []).append((drone, seq, round(box[3] - box[1], 1)))
        if keep.any() and dets:
            det_boxes = np.asarray([d["box"] for d in dets], np.float32)
            pairs = greedy_pairs(iou_matrix(boxes[keep], det_boxes))
            tally.matched += len(pairs)
            truths = ids[keep].tolist()
            for t, _ in pairs:
                self.detected.setdefault(truths[t], []).append((drone, seq, float(row.get("ts") or 0.0)))

    def fleet(self) -> dict[str, Any]:
        per_truth = reports_per_truth(self.reports, self.truth_points, self.radius_m, self.frame)
        found = [i for i in self.seen_truth if i in per_truth]
        seen = len(self.seen_truth)
        located = []  # each report's place on Earth and its distance to the true face nearest to it
        for oid, obj in sorted(self.reports.items(), key=lambda item: item[1].get("first_seen") or 0.0):
            if obj.get("lat") is None or not self.truth_points.size:
                continue
            _, dist = nearest_truth(obj, self.truth_points, self.frame)
            located.append({
                "id": oid, "label": obj.get("label"), "lat": obj["lat"], "lon": obj["lon"],
                "uncertainty_m": obj.get("uncertainty_m"), "owner": obj.get("owner"),
                "truth_distance_m": round(dist, 2),
            })  # fmt: skip
        missed = sorted(set(self.seen_truth) - set(found))
        return {
            "located": located,
            # Faces in view and never reported, split by cause: the detector never matched them, or it did.
            "never_detected": [self._never_detected(i) for i in missed if i not in self.detected],
            "detected_not_reported": [
                {
                    "truth": i,
                    "detections": len(self.detected[i]),
                    "first": list(self.detected[i][0]),
                    "by": sorted({d for d, _, _ in self.detected[i]}),
                }
                for i in missed
                if i in self.detected
            ],  # fmt: skip
            "fleet_objects": len(self.reports),
            "duplicate_reports": sum(n - 1 for n in per_truth.values()),
            "objects_seen": seen,
            "objects_found": len(found),
            "object_recall": round(len(found) / seen, 4) if seen else None,
        }

    def _never_detected(self, truth: int, listed: int = 40) -> dict[str, Any]:
        """A face the detector never matched: every frame it was in view and how tall it was (the first ones)."""
        views = self.in_view.get(truth, [])
        heights = [h for _, _, h in views]
        return {
            "truth": truth,
            "frames_in_view": len(views),
            "height_px_max": max(heights, default=None),
            "frames": [{"drone": d, "seq": q, "height_px": h} for d, q, h in views[:listed]],
        }

    def summary(self) -> dict[str, Any]:
        tallies = self.tallies
        per_drone = {
            name: {
                "frames": t.frames,
                "detections": t.detections,
                "recall": round(t.matched / t.truths, 4) if t.truths else None,
                "fleet_objects": len(t.objects),
                "latency_p50_ms": round(float(np.percentile(t.latencies, 50)), 3) if t.latencies else None,
            }
            for name, t in tallies.items()
        }
        return {
            "drones": len(tallies),
            "per_drone": per_drone,
            "frames": sum(t.frames for t in tallies.values()),
            "detections": sum(t.detections for t in tallies.values()),
            **self.fleet(),
            "snapshot_seq": snapshot_seq(tallies),
        }

    def status_line(self) -> str:
        fleet = self.fleet()
        per = "  ".join(f"{name} {t.detections}" for name, t in self.tallies.items())
        recall = fleet["object_recall"]
        return (
            f"detections: {per}  | fleet objects {fleet['fleet_objects']}  duplicates {fleet['duplicate_reports']}"
            f"  object recall {'n/a' if recall is None else f'{recall:.2f}'}"
        )


def score_swarm(drones: list[Drone], radius_m: float) -> dict[str, Any]:
    """Per-drone and fleet figures from what the drones wrote."""
    score = FleetScore(drones, radius_m)
    try:
        for drone in drones:
            for row in read_jsonl(drone.detections_path):
                score.add(drone.node_id, row)
        return score.summary()
    finally:
        score.close()


def snapshot_seq(tallies: dict[str, DroneTally]) -> int:
    """The frame number at which the drones together detected the most faces (ties: more faces in view).

    Every drone publishes frame ``seq`` at about the same moment, so the views shown side by side
    are of one instant: where they overlap, the same face appears in several of them.
    """
    totals: dict[int, tuple[int, int]] = {}
    for tally in tallies.values():
        for seq, (found, in_view) in tally.frame_scores.items():
            a, b = totals.get(seq, (0, 0))
            totals[seq] = (a + found, b + in_view)
    return max(totals, key=lambda seq: (totals[seq], -seq)) if totals else 0


def side_by_side(drones: list[Drone], seq: int, path: Path) -> None:
    """Every drone's view at frame ``seq``, side by side: detections green, ground truth blue."""
    tiles = []
    for drone in drones:
        source = ReplaySource(drone.replay, fps=parse_config(drone.config).source.fps)
        source.open()
        cfg = drone.replay
        image = np.zeros((cfg.height, cfg.width, 3), np.uint8)
        pose = source.pose_at(seq)
        source.render(pose, image)
        boxes, _ = source.truth(pose, cfg.width, cfg.height)
        for x1, y1, x2, y2 in boxes.astype(int).tolist():
            cv2.rectangle(image, (x1, y1), (x2, y2), (255, 160, 0), 1)
        for row in read_jsonl(drone.detections_path):
            if row.get("schema") == DETECTIONS_SCHEMA and row.get("seq") == seq:
                for det in row["detections"]:
                    x1, y1, x2, y2 = (int(v) for v in det["box"])
                    cv2.rectangle(image, (x1, y1), (x2, y2), (0, 220, 0), 2)
                break
        cv2.putText(image, f"{drone.node_id} frame {seq}", (8, 22), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (255, 255, 255), 2)
        source.close()
        tiles.append(image)
    cv2.imwrite(str(path), np.hstack(tiles))


def scene_frame(replay: ReplayConfig) -> LocalFrame:
    """The tangent plane of the replay scene's anchor: its ground truth is in these metres."""
    return LocalFrame(replay.origin[0], replay.origin[1], replay.ground_alt_m)


def object_local(obj: dict[str, Any], frame: LocalFrame) -> tuple[float, float]:
    """A fleet object's metres east/north in ``frame``: from its lat/lon (version 2), else its own east/north."""
    if obj.get("lat") is not None and obj.get("lon") is not None:
        east, north, _ = frame.from_geodetic(float(obj["lat"]), float(obj["lon"]), float(obj.get("alt_m") or 0.0))
        return float(east), float(north)
    return float(obj["east_m"]), float(obj["north_m"])


def nearest_truth(obj: dict[str, Any], truth_points: np.ndarray, frame: LocalFrame) -> tuple[int, float]:
    """The ground-truth object nearest to a fleet object's position, and how far it is (metres)."""
    east, north = object_local(obj, frame)
    dist = np.hypot(truth_points[:, 0] - east, truth_points[:, 1] - north)
    nearest = int(np.argmin(dist))
    return nearest, float(dist[nearest])


def reports_per_truth(
    objects: dict[str, dict[str, Any]], truth_points: np.ndarray, radius_m: float, frame: LocalFrame
) -> dict[int, int]:
    """How many fleet reports (keyed by object id) lie within ``radius_m`` of each ground-truth object."""
    per_truth: dict[int, int] = {}
    if truth_points.size == 0:
        return per_truth
    for obj in objects.values():
        nearest, dist = nearest_truth(obj, truth_points, frame)
        if dist <= radius_m:
            per_truth[nearest] = per_truth.get(nearest, 0) + 1
    return per_truth


def watch_drones(drones: list[Drone], radius_m: float, live: bool) -> None:
    """Until every drone exits: a status line with per-drone detections, fleet objects, duplicates, recall."""
    tails = {d.node_id: JsonlTail(d.detections_path) for d in drones}
    score = FleetScore(drones, radius_m) if live else None
    try:
        while any(d.proc is not None and d.proc.poll() is None for d in drones):
            time.sleep(0.5)
            if score is None:
                continue
            for name, tail in tails.items():
                for row in tail.new_rows():
                    score.add(name, row)
            sys.stderr.write(f"\r{score.status_line()}   ")
            sys.stderr.flush()
    finally:
        if score is not None:
            score.close()
            sys.stderr.write("\n")


def run_swarm_demo(
    out_dir: Path,
    drones: int,
    seconds: float,
    *,
    model: str | None = None,
    mqtt: str | None = None,
    dds: bool = False,
    fps: float | None = None,
    live: bool = False,
    radius_m: float = DEMO_RADIUS_M,
) -> dict[str, Any]:
    """Fly ``drones`` node processes for ``seconds`` and score what they published."""
    crew = drone_configs(out_dir, drones, model=model, mqtt=mqtt, dds=dds, fps=fps, radius_m=radius_m)
    with contextlib.ExitStack() as stack:
        if mqtt:
            url = stack.enter_context(ground_station(mqtt, crew[0].replay.seed, out_dir / "station.log"))
            if url:
                print(f"edgerun demo: ground station on {url} (open it while the drones fly)", flush=True)
            else:
                print(f"edgerun demo: the ground station did not start; see {out_dir}/station.log", flush=True)
        return _fly(crew, out_dir, seconds, mqtt=mqtt, dds=dds, live=live, radius_m=radius_m)


def _fly(
    crew: list[Drone], out_dir: Path, seconds: float, *, mqtt: str | None, dds: bool, live: bool, radius_m: float
) -> dict[str, Any]:
    listeners = None
    if mqtt or dds:
        host, port = parse_hostport(mqtt, "--mqtt") if mqtt else ("", 0)
        listeners = LocalListeners(out_dir, port if host == "127.0.0.1" else None, dds)
        time.sleep(1.0)  # let the subscribers connect and match before the first frame
    t0 = time.monotonic()
    try:
        start_drones(crew, seconds)
        watch_drones(crew, radius_m, live)
    finally:
        codes = stop_drones(crew)
        received = listeners.stop() if listeners is not None else None
    summary = score_swarm(crew, radius_m)
    summary["exit_codes"] = codes
    if received is not None:
        summary["received"] = received
    summary["wall_s"] = round(time.monotonic() - t0, 3)
    side_by_side(crew, summary["snapshot_seq"], out_dir / "snapshot.png")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def format_swarm_summary(summary: dict[str, Any]) -> str:
    lines = []
    for name, d in summary["per_drone"].items():
        recall = d["recall"]
        lines.append(
            f"{name}: frames {d['frames']}  detections {d['detections']}  recall "
            f"{'n/a' if recall is None else f'{recall:.3f}'}  fleet objects reported {d['fleet_objects']}"
        )
    for obj in summary.get("located", []):
        lines.append(
            f"  {obj['label']} {obj['id']} at {obj['lat']:.7f}, {obj['lon']:.7f} (+-{obj['uncertainty_m']} m), "
            f"{obj['truth_distance_m']} m from the true face; owner {obj['owner']}"
        )
    recall = summary["object_recall"]
    heard = "".join(f"  {name} listener got {n}" for name, n in (summary.get("received") or {}).items())
    lines.append(
        f"fleet: {summary['fleet_objects']} objects, {summary['duplicate_reports']} duplicate reports, object recall "
        f"{'n/a' if recall is None else f'{recall:.3f}'} ({summary['objects_found']}/{summary['objects_seen']} "
        f"faces seen){heard}"
    )
    return "\n".join(lines)

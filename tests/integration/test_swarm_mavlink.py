"""Three drones, three autopilots, one person on the ground: real MAVLink bytes, real nodes, one fleet object.

The set-up, chosen as the simplest honest one:

* The target is a face on the ground (the astronaut photo laid flat, 2 m chin to crown, as the replay
  scene lays its faces) whose chin is at TARGET (lat, lon), on ground TARGET_GROUND_M above mean sea level.
* Each drone is a real ``edgerun run`` process with the swarm on, its pose from ``[source.pose] kind =
  "mavlink"``. Its autopilot is a thread here that encodes GLOBAL_POSITION_INT (10 Hz), ATTITUDE (25 Hz),
  GPS_RAW_INT (5 Hz) and HOME_POSITION (1 Hz, and on request) with pymavlink and sends them over UDP to the
  node's ``udpin`` port, and answers the node's MAV_CMD_REQUEST_MESSAGE(HOME_POSITION).
* The drones take off from homes 224-270 m apart at ground heights 12 and 14 m apart (119, 131 and 145 m
  AMSL), climb while flying to the target at 20 m/s and hover 20-27 m above its ground, each at its own
  offset and attitude, looking at the face.
* The camera is an ``images`` source reading one file that the autopilot thread replaces: a bare ground
  texture while the drone is on its way, then, once it hovers, the perspective view of the face rendered
  from exactly the pose its autopilot reports (``ground_to_image``, the replay's camera model). A static
  picture cannot follow a moving drone, so the face is only shown while the drone holds still.
* Each drone's ground is what it should be: drones 1 and 3, launched in a valley and on a hill, have the
  search area's height configured (``ground_alt_m``: their HOME_POSITION is 12 m below / 14 m above it);
  drone 2 took off at the search area's level, so its HOME_POSITION (the default) is right.

Also flown: drone 1's fix jumps 40 m east for a second on its way (a GNSS glitch), and drone 3 loses its
fix while it looks at the face: GPS_RAW_INT says "no fix" for 4 s while the autopilot dead-reckons a
position that drifts up to 24 m north (as ArduPilot keeps streaming), then the fix comes back, jumping the
position back. A claim made from those frames would put a second object 4-24 m away.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import tomli_w

from edgerun.demo_swarm import drone_configs, start_drones, stop_drones
from edgerun.sources.replay import ASTRONAUT_CROP, ASTRONAUT_FACE_BOX, ground_to_image
from edgerun.types import Pose
from swarm.geo import CameraPose, LocalFrame, ground_offset_m, project_points
from tests.conftest import free_port
from tests.integration.brokers import collecting, run_mosquitto, wait_for
from tests.integration.test_swarm_nodes import FAST_TIMING, healthz, metric_value, metrics

mavlink = pytest.importorskip("pymavlink.dialects.v20.common")
# Three nodes start, then a ~25 s mission: the first test's share of the module fixture needs more than the default.
pytestmark = pytest.mark.timeout(300)

TARGET = (53.1181, -4.1279)  # the chin of the face on the ground (WGS84), in a field near Llanberis
TARGET_GROUND_M = 131.0  # the search area's ground, metres above mean sea level
WIDTH, HEIGHT, HFOV_DEG = 640, 480, 25.0  # a narrow camera: the face is 110-160 px tall from 20-27 m
FACE_M = 2.0
SCENE_PX_PER_M = 100.0
SCENE_EXTENT_M = 30.0  # the ground texture rendered around the target
TRANSIT_MPS = 20.0
ON_GROUND_S = 1.0
SETTLE_S = 0.5  # hover this long before the camera shows the face


@dataclass(frozen=True)
class Flight:
    """One drone's plan, in metres of the target's local frame (east, north; heights AMSL)."""

    home_en: tuple[float, float]
    home_alt_m: float
    hover: Pose  # east/north/up (above the target's ground) and attitude while it looks at the face
    configured_ground: bool  # [source.pose] ground_alt_m = TARGET_GROUND_M (else the autopilot's HOME_POSITION)
    jump_at_s: float | None = None  # seconds into the transit: the fix jumps 40 m east for one second
    gps_loss_after_s: float | None = None  # seconds into the hover: no fix for 4 s, dead reckoning drifts north


def aimed(up: float, yaw: float, pitch: float, roll: float) -> Pose:
    """A hover pose whose view centre is 1 m north of the chin (the middle of the face)."""
    cam = CameraPose(0.0, 0.0, up, yaw, pitch, roll, HFOV_DEG)
    centre = project_points(np.array([[WIDTH / 2, HEIGHT / 2]]), cam, WIDTH, HEIGHT)[0, :2]
    return Pose(-centre[0], 1.0 - centre[1], up, yaw, pitch, roll, HFOV_DEG)


FLIGHTS = [
    Flight((-140.0, -60.0), TARGET_GROUND_M - 12.0, aimed(20.0, 3.0, 12.0, -9.0), True, jump_at_s=2.0),
    Flight((20.0, 125.0), TARGET_GROUND_M, aimed(24.0, -3.0, 10.0, 6.0), False),
    Flight((130.0, -70.0), TARGET_GROUND_M + 14.0, aimed(27.0, 2.0, 9.0, 2.0), True, gps_loss_after_s=4.0),
]
GPS_LOSS_S = 4.0
DRIFT_MPS2 = 3.0  # dead reckoning's error grows with the square of time: 24 m after 4 s


# -- the camera's pictures ------------------------------------------------------------------------


def scene_ground(with_face: bool) -> np.ndarray:
    """The ground around the target (BGR, north up, SCENE_PX_PER_M), the face's chin at the centre."""
    rng = np.random.default_rng(21)
    size = int(SCENE_EXTENT_M * SCENE_PX_PER_M)
    coarse = cv2.resize(rng.normal(0, 1, (size // 16, size // 16)).astype(np.float32), (size, size))
    fine = cv2.resize(rng.normal(0, 1, (size // 2, size // 2)).astype(np.float32), (size, size))
    grass = np.array([60.0, 120.0, 85.0], np.float32) + (coarse * 18.0 + fine * 10.0)[..., None]
    canvas = np.clip(grass, 0, 255).astype(np.uint8)
    if with_face:
        from skimage import data

        photo = cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)
        x0, y0, x1, y1 = ASTRONAUT_CROP
        k = FACE_M / (ASTRONAUT_FACE_BOX[2] - ASTRONAUT_FACE_BOX[0]) * SCENE_PX_PER_M  # canvas px per photo px
        crop = cv2.resize(
            photo[y0:y1, x0:x1], (round((x1 - x0) * k), round((y1 - y0) * k)), interpolation=cv2.INTER_AREA
        )
        chin_x = ((ASTRONAUT_FACE_BOX[0] + ASTRONAUT_FACE_BOX[2]) / 2 - x0) * k
        chin_y = (ASTRONAUT_FACE_BOX[3] - y0) * k
        left, top = round(size / 2 - chin_x), round(size / 2 - chin_y)
        canvas[top : top + crop.shape[0], left : left + crop.shape[1]] = crop
    return canvas


def render(ground: np.ndarray, pose: Pose) -> np.ndarray:
    """The camera's view of the target's ground from ``pose`` (the replay source's homography and warp)."""
    half, ppm = SCENE_EXTENT_M / 2.0, SCENE_PX_PER_M
    canvas_to_ground = np.array([[1 / ppm, 0, 0.5 / ppm - half], [0, -1 / ppm, half - 0.5 / ppm], [0, 0, 1]])
    to_centres = np.array([[1.0, 0.0, -0.5], [0.0, 1.0, -0.5], [0.0, 0.0, 1.0]])
    homography = to_centres @ ground_to_image(pose, WIDTH, HEIGHT) @ canvas_to_ground
    out = np.empty((HEIGHT, WIDTH, 3), np.uint8)
    cv2.warpPerspective(ground, homography, (WIDTH, HEIGHT), dst=out, flags=cv2.INTER_LINEAR,
                        borderMode=cv2.BORDER_CONSTANT, borderValue=(60, 120, 85))  # fmt: skip
    return out


def show(camera_dir: Path, image: np.ndarray) -> None:
    """Replace the picture the node's images source reads (atomically: it never reads half a file)."""
    tmp = camera_dir.parent / f".{camera_dir.name}.png"
    cv2.imwrite(str(tmp), image)
    os.replace(tmp, camera_dir / "view.png")


# -- the autopilots ------------------------------------------------------------------------------


@dataclass
class Autopilot:
    """A simulated autopilot flying one Flight, in its own thread, sending real MAVLink v2 over UDP."""

    flight: Flight
    system: int
    port: int
    camera_dir: Path
    view: np.ndarray
    frame: LocalFrame = field(default_factory=lambda: LocalFrame(TARGET[0], TARGET[1], TARGET_GROUND_M))
    t0: float = 0.0
    hover_from: float | None = None  # time.monotonic() when it reached the hover point
    face_shown: float | None = None
    gps_lost: tuple[float, float] | None = None  # monotonic interval without a fix
    home_requests: int = 0
    sent: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mav = mavlink.MAVLink(None, srcSystem=self.system, srcComponent=1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"autopilot-{self.system}", daemon=True)
        f = self.flight
        self.transit_s = math.dist(f.home_en, (f.hover.east_m, f.hover.north_m)) / TRANSIT_MPS
        self.home_latlon = self.frame.to_geodetic(*f.home_en, f.home_alt_m - TARGET_GROUND_M)[:2]

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.thread.start()

    def join(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close()

    def _send(self, msg: Any) -> None:
        self.sock.sendto(msg.pack(self.mav), ("127.0.0.1", self.port))
        self.sent[msg.get_type()] = self.sent.get(msg.get_type(), 0) + 1

    def true_position(self, t: float) -> tuple[float, float, float]:
        """East, north (target frame) and AMSL height at ``t`` seconds into the flight."""
        f, hover = self.flight, self.flight.hover
        flying = min(max(t - ON_GROUND_S, 0.0), self.transit_s) / self.transit_s
        east = f.home_en[0] + (hover.east_m - f.home_en[0]) * flying
        north = f.home_en[1] + (hover.north_m - f.home_en[1]) * flying
        return east, north, f.home_alt_m + (TARGET_GROUND_M + hover.up_m - f.home_alt_m) * flying

    def reported(self, t: float, now: float) -> tuple[float, float, float, int]:
        """What the autopilot reports: its position (a glitch, dead reckoning) and the GPS fix type."""
        east, north, alt = self.true_position(t)
        f = self.flight
        if f.jump_at_s is not None and 0.0 <= t - ON_GROUND_S - f.jump_at_s < 1.0:
            east += 40.0  # a GNSS glitch: the fix jumps and comes back
        if self.gps_lost is not None and self.gps_lost[0] <= now < self.gps_lost[1]:
            lost_for = now - self.gps_lost[0]
            return east, north + 0.5 * DRIFT_MPS2 * lost_for**2, alt, 1  # GPS_FIX_TYPE_NO_FIX
        return east, north, alt, 3  # GPS_FIX_TYPE_3D_FIX

    def _home(self) -> None:
        lat, lon = self.home_latlon
        nan = float("nan")
        alt_mm = round(self.flight.home_alt_m * 1e3)
        self._send(self.mav.home_position_encode(round(lat * 1e7), round(lon * 1e7), alt_mm, 0.0, 0.0, 0.0,
                                                 [1.0, 0.0, 0.0, 0.0], nan, nan, nan))  # fmt: skip

    def _answer_requests(self) -> None:
        while True:
            try:
                data = self.sock.recv(2048)
            except BlockingIOError:
                return
            for msg in mavlink.MAVLink(None).parse_buffer(data) or []:
                if msg.get_type() == "COMMAND_LONG" and msg.command == mavlink.MAV_CMD_REQUEST_MESSAGE:
                    self.home_requests += 1
                    self._send(self.mav.command_ack_encode(msg.command, mavlink.MAV_RESULT_ACCEPTED))
                    if int(msg.param1) == mavlink.MAVLINK_MSG_ID_HOME_POSITION:
                        self._home()

    def _run(self) -> None:
        f, hover = self.flight, self.flight.hover
        tick = 0
        while not self.stop.is_set():
            now = time.monotonic()
            t = now - self.t0
            if self.hover_from is None and t >= ON_GROUND_S + self.transit_s:
                self.hover_from = now
                if f.gps_loss_after_s is not None:
                    start = now + SETTLE_S + f.gps_loss_after_s
                    self.gps_lost = (start, start + GPS_LOSS_S)
            if self.face_shown is None and self.hover_from is not None and now >= self.hover_from + SETTLE_S:
                show(self.camera_dir, self.view)
                self.face_shown = now
            east, north, alt, fix = self.reported(t, now)
            if tick % 10 == 0:
                self._send(self.mav.gps_raw_int_encode(int(t * 1e6), fix, 0, 0, 0, 65535, 65535, 0, 65535,
                                                       12 if fix >= 3 else 0))  # fmt: skip
            if tick % 5 == 0:  # GLOBAL_POSITION_INT, 10 Hz
                lat, lon, _ = self.frame.to_geodetic(east, north, alt - TARGET_GROUND_M)
                rel = alt - f.home_alt_m
                self._send(self.mav.global_position_int_encode(int(t * 1e3) & 0xFFFFFFFF, round(lat * 1e7),
                                                               round(lon * 1e7), round(alt * 1e3), round(rel * 1e3),
                                                               0, 0, 0, 65535))  # fmt: skip
            if tick % 2 == 0:  # ATTITUDE, 25 Hz
                roll, pitch, yaw = (math.radians(a) for a in (hover.roll_deg, hover.pitch_deg, hover.yaw_deg))
                self._send(self.mav.attitude_encode(int(t * 1e3) & 0xFFFFFFFF, roll, pitch, yaw, 0.0, 0.0, 0.0))
            if tick % 50 == 0:  # HOME_POSITION, 1 Hz (PX4 streams it; ArduPilot sends it when asked)
                self._home()
            self._answer_requests()
            tick += 1
            time.sleep(max(0.0, self.t0 + tick * 0.02 - time.monotonic()))


# -- the test -----------------------------------------------------------------------------------


def posed_faces(path: Path) -> list[dict[str, Any]]:
    """The node's published frames that have a face, with or without a pose."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("schema") == "edgerun.detections/1" and any(d["label"] == "face" for d in row["detections"]):
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def mission(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mavswarm")
    bare = render(scene_ground(False), FLIGHTS[0].hover)
    ground = scene_ground(True)
    with run_mosquitto() as broker:
        crew = drone_configs(tmp, 3, mqtt=f"127.0.0.1:{broker.port}", fps=5.0)
        pilots, http = [], {}
        for drone, flight in zip(crew, FLIGHTS):
            camera = drone.out_dir / "camera"
            camera.mkdir()
            show(camera, bare)
            port = free_port()
            pose: dict[str, Any] = {"kind": "mavlink", "url": f"udpin:127.0.0.1:{port}", "hfov_deg": HFOV_DEG}
            if flight.configured_ground:
                pose["ground_alt_m"] = TARGET_GROUND_M
            drone.config["source"] = {"kind": "images", "path": str(camera), "fps": 5.0, "loop": True, "pose": pose}
            drone.config["node"]["log_level"] = "info"
            http[drone.node_id] = free_port()
            drone.config["service"]["http_port"] = http[drone.node_id]
            drone.config["swarm"]["timing"] = dict(FAST_TIMING)
            (drone.out_dir / "node.toml").write_text(tomli_w.dumps(drone.config))
            pilots.append(Autopilot(flight, drone.index + 1, port, camera, render(ground, flight.hover)))
        with collecting(broker.port, ["edgerun/fleet/objects"]) as collector:
            start_drones(crew, seconds=150)
            try:
                assert wait_for(lambda: all(healthz(p) for p in http.values()), timeout=90), [
                    (d.out_dir / "node.log").read_text()[-2000:] for d in crew
                ]
                for pilot in pilots:
                    pilot.start()
                lost = pilots[2]

                def flown() -> bool:
                    """Every drone has published faces with a pose, drone 3 also after its fix came back."""
                    if lost.gps_lost is None or time.monotonic() < lost.gps_lost[1] + 3.0:
                        return False
                    return all(len([r for r in posed_faces(d.detections_path) if r["pose"]]) >= 5 for d in crew)

                assert wait_for(flown, timeout=120, interval=0.5), [p.sent for p in pilots]
                time.sleep(3.0)  # a few gossip rounds for the owner's last update (seen_by)
                yield {"crew": crew, "pilots": pilots, "http": http, "collector": collector}
            finally:
                for pilot in pilots:
                    pilot.join()
                for drone in crew:
                    if drone.proc is not None and drone.proc.poll() is None:
                        drone.proc.send_signal(signal.SIGTERM)
                stop_drones(crew)


def test_one_fleet_object_at_the_targets_true_lat_lon(mission: dict[str, Any]) -> None:
    crew, collector = mission["crew"], mission["collector"]
    objects = collector.json_on("edgerun/fleet/objects")
    latest = {}
    for obj in objects:
        assert obj["schema"] == "edgerun.object/2"
        latest[obj["id"]] = obj
    assert len(latest) == 1, latest
    (obj,) = latest.values()
    east, north = ground_offset_m(TARGET[0], TARGET[1], obj["lat"], obj["lon"])
    miss = math.hypot(east, north)
    print(f"\nfleet object {obj['id']}: {miss:.2f} m from the target (uncertainty {obj['uncertainty_m']:.2f} m), "
          f"seen by {obj['seen_by']}, owner {obj['owner']}")  # fmt: skip
    if os.environ.get("EDGERUN_BENCH_JSON"):  # `make bench-swarm`: the figures as a benchmark record
        Path(os.environ["EDGERUN_BENCH_JSON"]).write_text(json.dumps({
            "benchmark": "swarm_mavlink", "fleet_objects": len(latest), "objects_in_scene": 1,
            "miss_m": round(miss, 3), "uncertainty_m": obj["uncertainty_m"], "alt_m": obj["alt_m"],
            "seen_by": sorted(obj["seen_by"]), "homes_alt_m": sorted(p.flight.home_alt_m for p in mission["pilots"]),
        }, indent=2) + "\n")  # fmt: skip
    assert miss <= obj["uncertainty_m"] and miss <= 1.0
    assert obj["alt_m"] == pytest.approx(TARGET_GROUND_M, abs=0.01)
    assert obj["label"] == "face" and sorted(obj["seen_by"]) == sorted(d.node_id for d in crew)
    # The drones took off far apart and at different heights, as the brief of this test says.
    pilots = mission["pilots"]
    homes = [p.home_latlon for p in pilots]
    assert min(math.hypot(*ground_offset_m(*a, *b)) for i, a in enumerate(homes) for b in homes[i + 1 :]) >= 100.0
    heights = sorted(p.flight.home_alt_m for p in pilots)
    assert min(b - a for a, b in zip(heights, heights[1:])) >= 10.0


def test_each_drone_used_the_ground_it_should(mission: dict[str, Any]) -> None:
    crew, http, pilots = mission["crew"], mission["http"], mission["pilots"]
    for drone, pilot in zip(crew, pilots):
        text = metrics(http[drone.node_id])
        source = "configured" if pilot.flight.configured_ground else "home_position"
        assert metric_value(text, f'edgerun_pose_ground_alt_m{{source="{source}"}}') == TARGET_GROUND_M, drone.node_id
        assert (
            f"pose: ground at {TARGET_GROUND_M:.2f} m AMSL (from {source})" in (drone.out_dir / "node.log").read_text()
        )
        # The configured drones never asked for a home; drone 2 asked, and its autopilot answered.
        assert (pilot.home_requests > 0) == (not pilot.flight.configured_ground)
        # Every face frame's pose: up is the height above the target's ground (not above each drone's home).
        poses = [r["pose"] for r in posed_faces(drone.detections_path) if r["pose"]]
        assert poses and all(p["up_m"] == pytest.approx(pilot.flight.hover.up_m, abs=0.01) for p in poses)


def test_a_jump_in_the_fix_moves_the_drone_not_its_frame(mission: dict[str, Any]) -> None:
    """Drone 1's fix jumped 40 m on its way: its frame's origin is still its first fix, and its hover pose is where
    its autopilot put it in that frame."""
    drone, pilot = mission["crew"][0], mission["pilots"][0]
    assert pilot.flight.jump_at_s is not None
    poses = [r["pose"] for r in posed_faces(drone.detections_path) if r["pose"]]
    hover = pilot.frame.to_geodetic(pilot.flight.hover.east_m, pilot.flight.hover.north_m, 0.0)
    text = (drone.out_dir / "node.log").read_text()
    first_fix = re.findall(r"pose: local origin at (-?[0-9.]+), (-?[0-9.]+) \(first fix\)", text)
    assert len(first_fix) == 1  # set once, never again
    lat0, lon0 = float(first_fix[0][0]), float(first_fix[0][1])
    assert (lat0, lon0) == pytest.approx(pilot.home_latlon, abs=2e-7)  # the nodes were up before the take-off
    expected = LocalFrame(lat0, lon0, 0.0).from_geodetic(hover[0], hover[1], TARGET_GROUND_M)
    for p in poses:
        assert (p["east_m"], p["north_m"]) == pytest.approx(expected[:2], abs=0.02)


def test_frames_without_a_fix_make_no_claims_and_are_counted(mission: dict[str, Any]) -> None:
    """Drone 3 saw the face for 4 s with no GPS fix: those frames went out without a pose (so no claim: a claim from
    the drifting dead reckoning would have been a second object), counted on /metrics."""
    drone, pilot = mission["crew"][2], mission["pilots"][2]
    assert pilot.gps_lost is not None and pilot.face_shown is not None
    rows = posed_faces(drone.detections_path)
    unposed = [r for r in rows if r["pose"] is None]
    assert len(unposed) >= 5, len(unposed)  # 4 s at 5 fps, the face in view, no pose
    text = metrics(mission["http"][drone.node_id])
    assert (metric_value(text, 'edgerun_pose_frames_total{result="no_gps_fix"}') or 0) >= len(unposed)
    # Every face frame of drone 3 that had a pose was at the hover point: none from the dead-reckoned drift.
    posed = [r["pose"] for r in rows if r["pose"]]
    assert posed and max(p["north_m"] for p in posed) - min(p["north_m"] for p in posed) < 0.05

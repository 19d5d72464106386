"""Live pose from MAVLink: real bytes from pymavlink's own encoder, sent over loopback UDP to the source.

The autopilot here reports its home at HOME_ALT m above mean sea level unless a test says otherwise:
GLOBAL_POSITION_INT carries ``alt`` (AMSL) and ``relative_alt`` (above home) as ArduPilot and PX4 fill them.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from edgerun.config import PoseConfig, parse_config
from edgerun.errors import ConfigError
from edgerun.sources.pose_mavlink import MavlinkPoseSource
from swarm.geo import CameraPose, LocalFrame, project_points

mavlink = pytest.importorskip("pymavlink.dialects.v20.common")

LAT0, LON0 = 47.3977419, 8.5455938
HOME_ALT = 488.0  # the home's height above mean sea level (m)


class Autopilot:
    """A MAVLink sender: pymavlink's encoder packs real v2 frames, a UDP socket sends them to the source."""

    def __init__(self, addr: tuple[str, int], system: int = 1, component: int = 1) -> None:
        self.mav = mavlink.MAVLink(None, srcSystem=system, srcComponent=component)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.addr = addr

    def send(self, msg: object) -> bytes:
        data = msg.pack(self.mav)  # type: ignore[attr-defined]  # any pymavlink message
        self.sock.sendto(data, self.addr)
        return data

    def raw(self, data: bytes) -> None:
        self.sock.sendto(data, self.addr)

    def position(self, lat: float, lon: float, rel_alt_m: float, home_alt_m: float = HOME_ALT) -> bytes:
        """GLOBAL_POSITION_INT: ``alt`` AMSL (mm) is the home's height plus the height above home."""
        alt_mm, rel_mm = round((home_alt_m + rel_alt_m) * 1000), round(rel_alt_m * 1000)
        return self.send(
            self.mav.global_position_int_encode(0, round(lat * 1e7), round(lon * 1e7), alt_mm, rel_mm, 0, 0, 0, 0)
        )

    def home(self, lat: float, lon: float, alt_m: float) -> bytes:
        """HOME_POSITION: where the autopilot will return to, its ``altitude`` AMSL in mm."""
        nan = float("nan")
        return self.send(
            self.mav.home_position_encode(
                round(lat * 1e7),
                round(lon * 1e7),
                round(alt_m * 1000),
                0.0,
                0.0,
                0.0,
                [1.0, 0.0, 0.0, 0.0],
                nan,
                nan,
                nan,
            )  # fmt: skip
        )

    def gps(self, fix_type: int) -> bytes:
        """GPS_RAW_INT with only the fix type filled (GPS_FIX_TYPE: 1 no fix, 3 3D fix)."""
        return self.send(self.mav.gps_raw_int_encode(0, fix_type, 0, 0, 0, 65535, 65535, 0, 65535, 0))

    def attitude(self, yaw: float, pitch: float, roll: float) -> bytes:
        rad = math.radians
        return self.send(self.mav.attitude_encode(0, rad(roll), rad(pitch), rad(yaw), 0.0, 0.0, 0.0))

    def gimbal(self, q: list[float], flags: int) -> bytes:
        nan = float("nan")
        return self.send(self.mav.gimbal_device_attitude_status_encode(0, 0, 0, flags, q, 0, 0, 0, 0, nan, nan, 0))

    def close(self) -> None:
        self.sock.close()


def quat(yaw: float, pitch: float, roll: float) -> list[float]:
    """Z-Y-X Euler degrees -> (w, x, y, z), as a gimbal reports it."""
    cy, sy = math.cos(math.radians(yaw) / 2), math.sin(math.radians(yaw) / 2)
    cp, sp = math.cos(math.radians(pitch) / 2), math.sin(math.radians(pitch) / 2)
    cr, sr = math.cos(math.radians(roll) / 2), math.sin(math.radians(roll) / 2)
    return [cr * cp * cy + sr * sp * sy, sr * cp * cy - cr * sp * sy, cr * sp * cy + sr * cp * sy,
            cr * cp * sy - sr * sp * cy]  # fmt: skip


async def until(cond: Callable[[], bool], what: str) -> None:
    """Wait for the loop to deliver datagrams (bounded, not a timing assertion)."""
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def run(body: Callable[[MavlinkPoseSource, Autopilot], Awaitable[None]], **cfg: object) -> None:
    async def main() -> None:
        source = MavlinkPoseSource(PoseConfig(kind="mavlink", url="udpin:127.0.0.1:0", **cfg))  # type: ignore[arg-type]  # each test passes PoseConfig fields
        await source.start()
        assert source.local_addr is not None
        pilot = Autopilot(source.local_addr)
        try:
            await body(source, pilot)
        finally:
            pilot.close()
            await source.stop()

    asyncio.run(main())


def test_position_and_attitude_become_a_local_pose() -> None:
    async def body(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        assert source.latest(time.monotonic()) is None and source.stats["no_fix"] == 1
        pilot.position(LAT0, LON0, 30.0)  # the first fix is the origin
        pilot.position(LAT0 + 0.0001, LON0 + 0.0002, 31.5)
        pilot.attitude(yaw=90.0, pitch=4.0, roll=-2.0)
        await until(lambda: source.stats["messages"] == 3, "three messages")
        pose = source.latest(time.monotonic())
        assert pose is not None
        east, north, _ = LocalFrame(LAT0, LON0, HOME_ALT).from_geodetic(LAT0 + 0.0001, LON0 + 0.0002, HOME_ALT)
        assert 14.0 < east < 16.0 and 11.0 < north < 11.2  # 0.0002 deg of longitude at 47.4 N, 0.0001 of latitude
        assert (pose.east_m, pose.north_m, pose.up_m) == pytest.approx((east, north, 31.5), abs=1e-6)
        # The pose names its frame: the first fix's lat/lon and the ground (here the home GLOBAL_POSITION_INT implies).
        assert (pose.origin_lat, pose.origin_lon, pose.ground_alt_m) == pytest.approx((LAT0, LON0, HOME_ALT), abs=1e-9)
        assert (pose.yaw_deg, pose.pitch_deg, pose.roll_deg) == pytest.approx((90.0, 4.0, -2.0), abs=1e-4)
        assert pose.hfov_deg == 70.0
        # A frame captured 2 s after the last fix gets no pose, and is counted.
        assert source.latest(time.monotonic() + 2.0) is None and source.stats["stale"] == 1

    run(body, hfov_deg=70.0)


def test_configured_origin_and_other_systems_ignored() -> None:
    async def body(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        pilot.position(LAT0 + 0.001, LON0, 10.0)
        pilot.attitude(0.0, 0.0, 0.0)
        other = Autopilot(pilot.addr, system=7)
        other.position(0.5, 0.5, 99.0)
        other.close()
        await until(lambda: source.stats["dropped"].get("other_system") == 1, "the other system")
        pose = source.latest(time.monotonic())
        assert pose is not None and pose.north_m == pytest.approx(111.2, abs=0.3) and pose.up_m == 10.0

    run(body, origin=[LAT0, LON0])


def test_bad_bytes_are_dropped_and_counted() -> None:
    async def body(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        good = pilot.position(LAT0, LON0, 5.0)
        corrupt = bytearray(good)
        corrupt[-3] ^= 0x5A  # a payload byte: the CRC no longer matches
        pilot.raw(bytes(corrupt))
        pilot.raw(b"\x00\x13garbage that is not MAVLink")
        pilot.raw(b"")
        pilot.attitude(10.0, 0.0, 0.0)
        await until(lambda: source.stats["messages"] == 2, "the good messages after the bad bytes")
        dropped = source.stats["dropped"]
        assert dropped.get("bad_crc") == 1 and dropped.get("bad_prefix", 0) >= 1
        pose = source.latest(time.monotonic())
        assert pose is not None and pose.yaw_deg == pytest.approx(10.0, abs=1e-4)
        # Random bytes never raise out of the parser.
        rng = np.random.default_rng(5)
        for _ in range(200):
            source.feed(rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes(), time.monotonic())

    run(body)


def test_gimbal_attitude_is_folded_into_the_camera_pose() -> None:
    async def body(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        pilot.position(LAT0, LON0, 20.0)
        pilot.attitude(yaw=30.0, pitch=10.0, roll=5.0)
        await until(lambda: source.stats["messages"] == 2, "position and attitude")
        assert source.latest(time.monotonic()) is None  # a gimbal mount needs the gimbal's attitude
        # Straight down, yaw in the vehicle frame: the body's pitch and roll do not move a stabilised view.
        pilot.gimbal(quat(0.0, -90.0, 0.0), flags=32)
        await until(lambda: source.stats["messages"] == 3, "gimbal status")
        pose = source.latest(time.monotonic())
        assert pose is not None
        centre = project_points(np.array([[320.0, 240.0]]), CameraPose(0.0, 0.0, 20.0, pose.yaw_deg, pose.pitch_deg,
                                                                        pose.roll_deg), 640, 480)  # fmt: skip
        assert centre[0, :2] == pytest.approx([0.0, 0.0], abs=1e-6)
        assert pose.yaw_deg == pytest.approx(30.0, abs=1e-4)
        # 45 degrees down towards the east in the earth frame: the view centre is 20 m east.
        pilot.gimbal(quat(90.0, -45.0, 0.0), flags=64)
        await until(lambda: source.stats["messages"] == 4, "earth-frame gimbal status")
        pose = source.latest(time.monotonic())
        assert pose is not None
        cam = CameraPose(pose.east_m, pose.north_m, pose.up_m, pose.yaw_deg, pose.pitch_deg, pose.roll_deg)
        assert project_points(np.array([[320.0, 240.0]]), cam, 640, 480)[0, :2] == pytest.approx([20.0, 0.0], abs=1e-4)
        # MOUNT_ORIENTATION (older gimbals): 60 degrees down, 90 degrees left of the heading (30 -> -60 from north).
        pilot.send(pilot.mav.mount_orientation_encode(0, 0.0, -60.0, -90.0, float("nan")))
        await until(lambda: source.stats["messages"] == 5, "mount orientation")
        pose = source.latest(time.monotonic())
        assert pose is not None
        cam = CameraPose(pose.east_m, pose.north_m, pose.up_m, pose.yaw_deg, pose.pitch_deg, pose.roll_deg)
        ground = 20.0 / math.tan(math.radians(60.0))
        expected = [ground * math.sin(math.radians(-60.0)), ground * math.cos(math.radians(-60.0))]
        assert project_points(np.array([[320.0, 240.0]]), cam, 640, 480)[0, :2] == pytest.approx(expected, abs=1e-4)

    run(body, mount="gimbal")


def test_pose_config_section() -> None:
    cfg = parse_config({"source": {"pose": {"kind": "mavlink", "url": "/dev/ttyAMA0,57600", "mount": "gimbal"}}})
    assert cfg.source.pose.url == "/dev/ttyAMA0,57600" and cfg.source.pose.mount == "gimbal"
    assert parse_config({}).source.pose.kind == "none"
    with pytest.raises(ConfigError, match=r"^source\.pose\.url: expected 'udpin:HOST:PORT' or 'DEVICE,BAUD'"):
        parse_config({"source": {"pose": {"kind": "mavlink", "url": "tcp:localhost"}}})
    assert parse_config({"source": {"pose": {"origin": [47.0, 8.5]}}}).source.pose.origin == [47.0, 8.5]
    with pytest.raises(ConfigError, match=r"^source\.pose\.origin: expected \[latitude, longitude\] in degrees"):
        parse_config({"source": {"pose": {"origin": [47.0]}}})
    with pytest.raises(ConfigError, match=r"^source\.pose\.origin: expected \[latitude, longitude\]"):
        parse_config({"source": {"pose": {"origin": [147.0, 8.0]}}})
    with pytest.raises(ConfigError, match=r"^source\.pose\.kind: expected one of 'none', 'mavlink', got 'gps'"):
        parse_config({"source": {"pose": {"kind": "gps"}}})


def test_serial_link_reads_a_pty() -> None:
    """The serial path through pyserial-asyncio-fast, on a pseudo-terminal standing in for the autopilot's UART."""
    pytest.importorskip("serial_asyncio_fast")
    import os

    master, slave = os.openpty()
    tx = mavlink.MAVLink(None, srcSystem=1, srcComponent=1)

    async def main() -> None:
        source = MavlinkPoseSource(PoseConfig(kind="mavlink", url=f"{os.ttyname(slave)},57600"))
        await source.start()
        try:
            os.write(master, tx.global_position_int_encode(0, round(LAT0 * 1e7), round(LON0 * 1e7), 0, 12_000,
                                                            0, 0, 0, 0).pack(tx))  # fmt: skip
            os.write(master, tx.attitude_encode(0, 0.0, 0.0, math.radians(-45.0), 0.0, 0.0, 0.0).pack(tx))
            await until(lambda: source.stats["messages"] == 2, "two messages over the pty")
            pose = source.latest(time.monotonic())
            assert pose is not None and pose.up_m == 12.0 and pose.yaw_deg == pytest.approx(-45.0, abs=1e-4)
        finally:
            await source.stop()

    try:
        asyncio.run(main())
    finally:
        os.close(master)
        os.close(slave)


def test_a_link_that_cannot_open_is_one_clear_error() -> None:
    from edgerun.errors import SourceError

    async def main() -> None:
        source = MavlinkPoseSource(PoseConfig(kind="mavlink", url="/dev/edgerun-no-such-uart,57600"))
        await source.start()

    with pytest.raises(SourceError, match=r"^source\.pose: cannot open '/dev/edgerun-no-such-uart,57600': "):
        asyncio.run(main())


def test_the_sample_nearest_the_capture_time_is_used() -> None:
    """Sans-I/O: bytes fed with explicit receive times, no socket."""
    source = MavlinkPoseSource(PoseConfig(kind="mavlink", origin=[LAT0, LON0]))
    tx = mavlink.MAVLink(None, srcSystem=1, srcComponent=1)
    for t, rel_alt, yaw in ((100.0, 10_000, 0.0), (100.5, 12_000, 20.0), (101.0, 14_000, 40.0)):
        source.feed(tx.global_position_int_encode(0, round(LAT0 * 1e7), round(LON0 * 1e7), 0, rel_alt,
                                                  0, 0, 0, 0).pack(tx), t)  # fmt: skip
        source.feed(tx.attitude_encode(0, 0.0, 0.0, math.radians(yaw), 0.0, 0.0, 0.0).pack(tx), t)
    picks = [source.latest(t) for t in (99.9, 100.2, 100.4, 100.9, 101.3)]
    assert [(p.up_m, round(p.yaw_deg, 3)) for p in picks if p is not None] == [
        (10.0, 0.0), (10.0, 0.0), (12.0, 20.0), (14.0, 40.0), (14.0, 40.0)
    ]  # fmt: skip
    assert source.latest(102.2) is None and source.stats["stale"] == 1  # attitude 1.2 s old (timeout 0.5 s)


def test_the_ground_is_configured_else_home_position_else_implied(caplog: pytest.LogCaptureFixture) -> None:
    """up_m = alt (AMSL) - the ground's height, taken from the best source there is; each source logged once."""

    async def body(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        with caplog.at_level("INFO", logger="edgerun.sources.pose_mavlink"):
            pilot.position(LAT0, LON0, 40.0, home_alt_m=HOME_ALT)  # alt 528 m AMSL
            pilot.attitude(0.0, 0.0, 0.0)
            await until(lambda: source.stats["messages"] == 2, "position and attitude")
            # No HOME_POSITION yet: the home GLOBAL_POSITION_INT implies (alt - relative_alt).
            pose = source.latest(time.monotonic())
            assert pose is not None and (pose.ground_alt_m, pose.up_m) == pytest.approx((HOME_ALT, 40.0))
            assert source.latest(time.monotonic()) is not None and source.stats["ground_source"] == "global_position"
            # The autopilot's HOME_POSITION is better: its home was set 3 m lower than the EKF's origin.
            pilot.home(LAT0, LON0, HOME_ALT - 3.0)
            pilot.position(LAT0, LON0, 40.0, home_alt_m=HOME_ALT)
            await until(lambda: source.stats["messages"] == 4, "home position")
            pose = source.latest(time.monotonic())
            assert pose is not None and (pose.ground_alt_m, pose.up_m) == pytest.approx((HOME_ALT - 3.0, 43.0))
            assert (pose.origin_lat, pose.origin_lon) == (LAT0, LON0)
        lines = [r.getMessage() for r in caplog.records if "ground at" in r.getMessage()]
        assert lines == [
            f"pose: ground at {HOME_ALT:.2f} m AMSL (from global_position)",
            f"pose: ground at {HOME_ALT - 3.0:.2f} m AMSL (from home_position)",
        ]

    run(body)

    async def configured(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        pilot.home(LAT0, LON0, HOME_ALT)
        pilot.position(LAT0, LON0, 40.0)
        pilot.attitude(0.0, 0.0, 0.0)
        await until(lambda: source.stats["messages"] == 3, "home, position and attitude")
        pose = source.latest(time.monotonic())
        # The operator's ground (a survey of the search area) beats the autopilot's home.
        assert pose is not None and (pose.ground_alt_m, pose.up_m) == pytest.approx((470.0, HOME_ALT + 40.0 - 470.0))
        assert source.stats["ground_source"] == "configured" and source.stats["home_requests"] == 0

    run(configured, ground_alt_m=470.0)


def test_home_position_is_requested_from_the_autopilot() -> None:
    """MAV_CMD_REQUEST_MESSAGE goes back to the autopilot's address; its HOME_POSITION answer sets the ground."""

    async def body(source: MavlinkPoseSource, pilot: Autopilot) -> None:
        pilot.sock.settimeout(5.0)
        pilot.position(LAT0, LON0, 25.0, home_alt_m=HOME_ALT + 1.0)
        pilot.attitude(0.0, 0.0, 0.0)
        data, _ = await asyncio.get_running_loop().run_in_executor(None, pilot.sock.recvfrom, 512)
        msgs = mavlink.MAVLink(None).parse_buffer(data)
        assert [m.get_type() for m in msgs] == ["COMMAND_LONG"]
        cmd = msgs[0]
        assert (cmd.target_system, cmd.target_component, cmd.command, cmd.param1) == (1, 1, 512, 242.0)
        assert (cmd.get_srcSystem(), cmd.get_srcComponent()) == (1, mavlink.MAV_COMP_ID_ONBOARD_COMPUTER)
        pilot.home(LAT0, LON0, HOME_ALT)
        pilot.position(LAT0, LON0, 25.0, home_alt_m=HOME_ALT + 1.0)
        await until(lambda: source.stats["messages"] == 4, "the answer")
        pose = source.latest(time.monotonic())
        assert pose is not None and (pose.ground_alt_m, pose.up_m) == pytest.approx((HOME_ALT, 26.0))

    run(body)


def test_home_requests_stop_when_answered_or_after_a_few_tries() -> None:
    """Sans-I/O: outgoing(now) hands out at most five requests, two seconds apart, and none once the home is known."""
    tx = mavlink.MAVLink(None, srcSystem=3, srcComponent=1)
    fix = tx.global_position_int_encode(0, round(LAT0 * 1e7), round(LON0 * 1e7), 500_000, 20_000, 0, 0, 0, 0)
    source = MavlinkPoseSource(PoseConfig(kind="mavlink"))
    assert source.outgoing(0.0) == []  # no autopilot heard: nobody to ask
    source.feed(fix.pack(tx), 0.0)
    sent = [t for t in (x * 0.5 for x in range(40)) if source.outgoing(t)]
    assert sent == [0.0, 2.0, 4.0, 6.0, 8.0] and source.stats["home_requests"] == 5
    answered = MavlinkPoseSource(PoseConfig(kind="mavlink"))
    answered.feed(fix.pack(tx), 0.0)
    assert len(answered.outgoing(0.0)) == 1
    answered.feed(tx.home_position_encode(round(LAT0 * 1e7), round(LON0 * 1e7), 480_000, 0, 0, 0, [1, 0, 0, 0],
                                          0, 0, 0).pack(tx), 1.0)  # fmt: skip
    assert answered.outgoing(2.0) == [] and answered.outgoing(10.0) == []
    # A home of 0, 0 is "no home set yet": dropped and counted, and the source keeps asking.
    unset = MavlinkPoseSource(PoseConfig(kind="mavlink"))
    unset.feed(fix.pack(tx), 0.0)
    unset.feed(tx.home_position_encode(0, 0, 0, 0, 0, 0, [1, 0, 0, 0], 0, 0, 0).pack(tx), 0.1)
    assert unset.stats["dropped"] == {"no_home": 1} and len(unset.outgoing(0.2)) == 1


def test_a_lost_gps_fix_gives_no_pose_and_is_counted() -> None:
    """Dead reckoning (GPS_RAW_INT below a 3D fix, as ArduPilot goes on streaming) and a silent stream (PX4) both."""
    source = MavlinkPoseSource(PoseConfig(kind="mavlink"))
    tx = mavlink.MAVLink(None, srcSystem=1, srcComponent=1)

    def at(t: float, fix_type: int | None, north_m: float = 0.0) -> None:
        lat = LAT0 + north_m / 111_200.0
        source.feed(tx.global_position_int_encode(0, round(lat * 1e7), round(LON0 * 1e7), 520_000, 30_000,
                                                  0, 0, 0, 0).pack(tx), t)  # fmt: skip
        source.feed(tx.attitude_encode(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0).pack(tx), t)
        if fix_type is not None:
            source.feed(tx.gps_raw_int_encode(0, fix_type, 0, 0, 0, 0, 0, 0, 0, 0).pack(tx), t)

    at(10.0, 3)
    assert source.latest(10.0) is not None
    for k in range(1, 20):  # lost: the autopilot dead-reckons, drifting north 5 m/s
        at(10.0 + k * 0.1, 1, north_m=5.0 * k * 0.1)
    assert all(source.latest(10.0 + k * 0.1) is None for k in range(1, 20))
    assert source.stats["no_gps_fix"] == 19 and source.stats["poses"] == 1
    at(12.0, 6)  # RTK fixed again
    pose = source.latest(12.0)
    assert pose is not None and pose.north_m == pytest.approx(0.0, abs=0.01)
    # The autopilot stops sending positions (PX4 without a valid global position): stale, counted.
    source.feed(tx.attitude_encode(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0).pack(tx), 14.0)
    assert source.latest(14.0) is None and source.stats["stale"] == 1
    # A status stream that stopped 3 s ago says nothing any more; without GPS_RAW_INT positions are taken as they come.
    at(16.0, None)
    assert source.latest(16.0) is not None


def test_a_jump_in_the_fix_moves_only_the_drone() -> None:
    """The origin stays where the first fix put it: after a 60 m jump (a GNSS re-acquiring, a glitch) the pose is at
    the new fix in the same frame, and the fix before it is where it was."""
    source = MavlinkPoseSource(PoseConfig(kind="mavlink"))
    tx = mavlink.MAVLink(None, srcSystem=1, srcComponent=1)
    frame = LocalFrame(LAT0, LON0, 0.0)
    jumped_lat, jumped_lon, _ = frame.to_geodetic(42.0, -43.0, HOME_ALT)
    for t, (lat, lon) in ((1.0, (LAT0, LON0)), (5.0, (jumped_lat, jumped_lon))):
        source.feed(tx.global_position_int_encode(0, round(lat * 1e7), round(lon * 1e7), round((HOME_ALT + 20) * 1e3),
                                                  20_000, 0, 0, 0, 0).pack(tx), t)  # fmt: skip
        source.feed(tx.attitude_encode(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0).pack(tx), t)
    before, after = source.latest(1.0), source.latest(5.0)
    assert before is not None and after is not None
    assert (before.east_m, before.north_m) == pytest.approx((0.0, 0.0), abs=1e-6)
    assert (after.east_m, after.north_m, after.up_m) == pytest.approx((42.0, -43.0, 20.0), abs=0.01)
    assert (after.origin_lat, after.origin_lon) == (before.origin_lat, before.origin_lon) == (LAT0, LON0)


def test_local_positions_go_back_to_the_fixes_lat_lon() -> None:
    """A pose's east/north, taken back through the frame it names, is the autopilot's fix (to 1e-7 degree, the
    resolution of GLOBAL_POSITION_INT), a few km from the origin and across ground heights."""
    tx = mavlink.MAVLink(None, srcSystem=1, srcComponent=1)
    rng = np.random.default_rng(21)
    for lat0, lon0, ground in (
        (LAT0, LON0, HOME_ALT),
        (53.117, -4.13, 100.0),
        (-33.86, 151.21, 2.0),
        (64.1, -21.9, 0.0),
    ):
        source = MavlinkPoseSource(PoseConfig(kind="mavlink", origin=[lat0, lon0], ground_alt_m=ground))
        for k, (dn, de) in enumerate(rng.uniform(-3000.0, 3000.0, (20, 2))):
            lat, lon = lat0 + dn / 111_000.0, lon0 + de / (111_000.0 * math.cos(math.radians(lat0)))
            t = float(k)
            fix = tx.global_position_int_encode(0, round(lat * 1e7), round(lon * 1e7), round((ground + 50) * 1e3),
                                                50_000, 0, 0, 0, 0)  # fmt: skip
            source.feed(fix.pack(tx), t)
            source.feed(tx.attitude_encode(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0).pack(tx), t)
            pose = source.latest(t)
            assert pose is not None and pose.up_m == pytest.approx(50.0, abs=1e-3)
            assert pose.origin_lat is not None and pose.origin_lon is not None and pose.ground_alt_m is not None
            back = LocalFrame(pose.origin_lat, pose.origin_lon, pose.ground_alt_m).to_geodetic(
                pose.east_m, pose.north_m, 0.0
            )
            assert back[0] == pytest.approx(round(lat * 1e7) / 1e7, abs=2e-8)
            assert back[1] == pytest.approx(round(lon * 1e7) / 1e7, abs=2e-8)

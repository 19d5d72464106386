"""Live pose from MAVLink: real bytes from pymavlink's own encoder, sent over loopback UDP to the source."""

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
from edgerun.sources.pose_mavlink import MavlinkPoseSource, local_east_north
from swarm.geo import CameraPose, project_points

mavlink = pytest.importorskip("pymavlink.dialects.v20.common")

LAT0, LON0 = 47.3977419, 8.5455938


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

    def position(self, lat: float, lon: float, rel_alt_m: float) -> bytes:
        return self.send(
            self.mav.global_position_int_encode(
                0, round(lat * 1e7), round(lon * 1e7), 500_000, round(rel_alt_m * 1000), 0, 0, 0, 0
            )  # fmt: skip
        )

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
        east, north = local_east_north(LAT0 + 0.0001, LON0 + 0.0002, LAT0, LON0)
        assert 14.0 < east < 16.0 and 11.0 < north < 11.2  # 0.0002 deg of longitude at 47.4 N, 0.0001 of latitude
        assert (pose.east_m, pose.north_m, pose.up_m) == pytest.approx((east, north, 31.5), abs=1e-6)
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

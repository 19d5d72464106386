"""Live camera pose from a MAVLink autopilot (``[source.pose] kind = "mavlink"``).

Reads GLOBAL_POSITION_INT (position, height above mean sea level), ATTITUDE
(body attitude), HOME_POSITION (the home's height), GPS_RAW_INT (whether the
GNSS has a 3D fix) and, for a gimbal mount, GIMBAL_DEVICE_ATTITUDE_STATUS or
MOUNT_ORIENTATION, decoded by pymavlink's own parser, and turns them into an
``edgerun.types.Pose`` in the replay's convention: east/north metres in the
``swarm.geo.LocalFrame`` of the configured origin (or the first position fix),
which never moves once set, and ``up_m`` the camera's height above the ground.
Every pose carries its frame's geodetic origin and the ground's height above
mean sea level (``origin_lat``, ``origin_lon``, ``ground_alt_m``), so its ground
fixes become latitude/longitude that every drone agrees on whatever its launch
point. The attitude is the camera's, expressed as the belly camera the Pose
convention describes (a gimbal's angles are folded in by ``swarm.geo``).

The ground's height, in order: ``[source.pose] ground_alt_m`` (the operator's,
AMSL); else the autopilot's HOME_POSITION altitude (requested with
MAV_CMD_REQUEST_MESSAGE over the link, never waited for); else the home height
GLOBAL_POSITION_INT implies (``alt - relative_alt``). A frame captured while
the GNSS reports no 3D fix, or too long after the last position, gets no pose
(counted as ``no_gps_fix`` / ``stale``): a pose that may be tens of metres off
would put a found person in the wrong place, so the frame makes no claim.

I/O runs on the asyncio loop with no thread: an asyncio datagram endpoint for
``udpin:HOST:PORT`` and pyserial-asyncio-fast for a serial port. The parser is
fed bytes (``feed``), so the same code is driven by tests without sockets; the
messages are small and few (tens per second), so parsing them on the loop costs
less than a thread hand-off would. Bad bytes are dropped and counted by reason.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import re
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from edgerun.config import PoseConfig
from edgerun.errors import ConfigError, SourceError
from edgerun.types import Pose
from swarm.geo import CameraPose, LocalFrame, angles_zyx, fold_gimbal

log = logging.getLogger(__name__)

_GIMBAL_YAW_LOCK = 16
_GIMBAL_YAW_IN_VEHICLE_FRAME = 32
_GIMBAL_YAW_IN_EARTH_FRAME = 64
_HISTORY = 32  # samples kept per stream, to pick the one nearest a frame's capture time
_GPS_FIX_TYPE_3D = 3  # GPS_FIX_TYPE_3D_FIX: below it (no GPS, no fix, 2D) the position is dead reckoning at best
# GPS_RAW_INT older than this says nothing about the fix any more (autopilots stream it at 1-10 Hz).
_GPS_STATUS_TIMEOUT_S = 3.0
_HOME_REQUESTS = 5  # MAV_CMD_REQUEST_MESSAGE(HOME_POSITION) tries, one every _HOME_REQUEST_EVERY_S
_HOME_REQUEST_EVERY_S = 2.0
# Where the ground's height came from, best first (Pose.ground_alt_m; the source is logged when it changes).
GROUND_SOURCES = ("configured", "home_position", "global_position")

_UDP_RE = re.compile(r"^(?:udpin|udp):(?P<host>[^:]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")
_SERIAL_RE = re.compile(r"^(?P<device>/[^,]+),(?P<baud>\d{3,7})$")


@dataclass(frozen=True, slots=True)
class LinkUrl:
    kind: str  # "udp" or "serial"
    host: str = ""
    port: int = 0
    device: str = ""
    baud: int = 0


def parse_link_url(url: str) -> LinkUrl:
    """``udpin:HOST:PORT`` or ``DEVICE,BAUD``; raises ConfigError naming source.pose.url otherwise."""
    m = _UDP_RE.match(url)
    if m and 0 <= int(m.group("port")) <= 65535:
        return LinkUrl("udp", host=m.group("host").strip("[]"), port=int(m.group("port")))
    m = _SERIAL_RE.match(url)
    if m:
        return LinkUrl("serial", device=m.group("device"), baud=int(m.group("baud")))
    raise ConfigError(f"source.pose.url: expected 'udpin:HOST:PORT' or 'DEVICE,BAUD', got {url!r}")


def quaternion_angles(w: float, x: float, y: float, z: float) -> tuple[float, float, float]:
    """A unit quaternion (w, x, y, z) -> Z-Y-X (yaw, pitch, roll) degrees."""
    n = math.sqrt(w * w + x * x + y * y + z * z)
    w, x, y, z = w / n, x / n, y / n, z / n
    rot = np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )
    return angles_zyx(rot)


class _Samples:
    """The last few (time, value) samples of one stream, in arrival order.

    One deque of tuples, read through a snapshot: ``latest`` may run on another thread than ``feed``.
    """

    def __init__(self) -> None:
        self.samples: deque[tuple[float, Any]] = deque(maxlen=_HISTORY)

    def add(self, t: float, value: Any) -> None:
        self.samples.append((t, value))

    def nearest(self, t: float) -> tuple[float, Any] | None:
        samples = list(self.samples)
        if not samples:
            return None
        i = bisect.bisect_left(samples, t, key=lambda s: s[0])
        candidates = [samples[j] for j in (i - 1, i) if 0 <= j < len(samples)]
        return min(candidates, key=lambda s: abs(s[0] - t))


class MavlinkPoseSource:
    """The latest camera pose from a MAVLink autopilot: ``await start()``, ``latest(t_capture)``, ``await stop()``."""

    def __init__(self, cfg: PoseConfig) -> None:
        try:
            from pymavlink.dialects.v20 import common as mavlink  # the 'mavlink' extra; imported when used
        except ImportError:
            raise SourceError("source.pose: kind 'mavlink' needs pymavlink (pip install 'edgerun[mavlink]')") from None

        self.cfg = cfg
        self.link = parse_link_url(cfg.url)
        self._mavlink = mavlink
        self._parser = self._new_parser()
        self._system = cfg.system_id
        self._component = 0  # the component that sends GLOBAL_POSITION_INT: HOME_POSITION is requested from it
        self._origin: tuple[float, float] | None = (cfg.origin[0], cfg.origin[1]) if cfg.origin else None
        self._frame: LocalFrame | None = None
        self._position = _Samples()  # (lat, lon, alt AMSL m, alt - relative_alt: the home height it implies)
        self._attitude = _Samples()  # (yaw, pitch, roll) degrees, body
        self._gimbal = _Samples()  # (yaw relative to the heading or None, yaw in earth frame or None, pitch, roll)
        self._gps = _Samples()  # GPS_RAW_INT fix_type
        self._home_alt_m: float | None = None  # HOME_POSITION altitude, AMSL
        self._home_requests = 0
        self._next_home_request = 0.0
        self._sender: Any = None  # pymavlink encoder for the requests, made once the system id is known
        self._ground_logged: str | None = None
        self._transport: Any = None
        self.stats: dict[str, Any] = {
            "messages": 0,
            "poses": 0,
            "stale": 0,
            "no_fix": 0,
            "no_gps_fix": 0,
            "home_requests": 0,
            "ground_source": "",  # one of GROUND_SOURCES once a pose was made
            "ground_alt_m": None,
            "dropped": {},
        }
        self.local_addr: tuple[str, int] | None = None

    def _new_parser(self) -> Any:
        parser = self._mavlink.MAVLink(None)
        parser.robust_parsing = True  # bad bytes come back as BAD_DATA messages instead of exceptions
        return parser

    def _drop(self, reason: str) -> None:
        dropped = self.stats["dropped"]
        dropped[reason] = dropped.get(reason, 0) + 1

    # I/O

    async def start(self) -> None:
        """Open the link (UDP listener or serial port) on the running loop."""
        loop = asyncio.get_running_loop()
        source = self

        class _Protocol(asyncio.DatagramProtocol, asyncio.Protocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                now = time.monotonic()
                source.feed(data, now)
                for request in source.outgoing(now):  # back to where the autopilot's stream comes from
                    source._transport.sendto(request, addr)

            def data_received(self, data: bytes) -> None:
                now = time.monotonic()
                source.feed(data, now)
                for request in source.outgoing(now):
                    source._transport.write(request)

            def error_received(self, exc: Exception) -> None:
                source._drop("socket_error")

        try:
            if self.link.kind == "udp":
                self._transport, _ = await loop.create_datagram_endpoint(
                    _Protocol, local_addr=(self.link.host, self.link.port)
                )
                self.local_addr = self._transport.get_extra_info("sockname")[:2]
            else:
                import serial_asyncio_fast

                self._transport, _ = await serial_asyncio_fast.create_serial_connection(
                    loop, _Protocol, self.link.device, baudrate=self.link.baud
                )
        except (OSError, ImportError) as err:
            raise SourceError(f"source.pose: cannot open {self.cfg.url!r}: {err}") from None
        log.info("pose: MAVLink on %s (mount %s)", self.cfg.url, self.cfg.mount)

    async def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # parsing (sans-I/O: ``now`` is time.monotonic(), the clock of FrameMeta.t_capture)

    def feed(self, data: bytes, now: float) -> None:
        """Bytes from the link. Never raises: bad bytes are dropped and counted by reason."""
        try:
            messages = self._parser.parse_buffer(data) or []
        except Exception:  # pymavlink's parser on bytes it did not expect: start over, count it
            self._parser = self._new_parser()
            self._drop("parser_error")
            return
        for msg in messages:
            try:
                self._handle(msg, now)
            except (ArithmeticError, TypeError, ValueError):  # a field pymavlink decoded but we cannot use
                self._drop("bad_message")

    def outgoing(self, now: float) -> list[bytes]:
        """Bytes to send the autopilot now: a HOME_POSITION request while its home height is unknown.

        A few tries, a couple of seconds apart, once the autopilot has been heard; a link that is read-only or
        an autopilot that never answers costs nothing more (the ground then comes from GLOBAL_POSITION_INT).
        """
        if (
            self.cfg.ground_alt_m is not None
            or self._home_alt_m is not None
            or self._system == 0
            or self._home_requests >= _HOME_REQUESTS
            or now < self._next_home_request
        ):
            return []
        if self._sender is None:
            # A companion computer on the vehicle: the autopilot's system id, the onboard-computer component.
            self._sender = self._mavlink.MAVLink(
                None, srcSystem=self._system, srcComponent=self._mavlink.MAV_COMP_ID_ONBOARD_COMPUTER
            )
        msg = self._sender.command_long_encode(
            self._system,
            self._component,
            self._mavlink.MAV_CMD_REQUEST_MESSAGE,
            self._home_requests,  # confirmation: 0 for the first try, then counts the retransmissions
            float(self._mavlink.MAVLINK_MSG_ID_HOME_POSITION),
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,  # param7 0: the response goes where the flight stack sends its stream
        )
        self._home_requests += 1
        self._next_home_request = now + _HOME_REQUEST_EVERY_S
        self.stats["home_requests"] += 1
        return [msg.pack(self._sender)]

    def _handle(self, msg: Any, now: float) -> None:
        kind = msg.get_type()
        if kind == "BAD_DATA":
            reason = str(getattr(msg, "reason", ""))
            self._drop("bad_crc" if "CRC" in reason else "bad_prefix" if "prefix" in reason else "bad_frame")
            return
        if kind not in (
            "GLOBAL_POSITION_INT",
            "ATTITUDE",
            "HOME_POSITION",
            "GPS_RAW_INT",
            "GIMBAL_DEVICE_ATTITUDE_STATUS",
            "MOUNT_ORIENTATION",
        ):
            return
        system = msg.get_srcSystem()
        if self._system == 0:
            self._system = system
            log.info("pose: following MAVLink system %d", system)
        if system != self._system:
            self._drop("other_system")
            return
        self.stats["messages"] += 1
        if kind == "GLOBAL_POSITION_INT":
            lat, lon = msg.lat / 1e7, msg.lon / 1e7
            if not (-90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0) or (msg.lat == 0 and msg.lon == 0):
                self._drop("no_gnss")  # autopilots send 0, 0 before the first fix
                return
            if self._origin is None:
                self._origin = (lat, lon)
                log.info("pose: local origin at %.7f, %.7f (first fix)", lat, lon)
            if not self._component:
                self._component = msg.get_srcComponent()
            alt_m = msg.alt / 1000.0
            self._position.add(now, (lat, lon, alt_m, alt_m - msg.relative_alt / 1000.0))
        elif kind == "ATTITUDE":
            values = (math.degrees(msg.yaw), math.degrees(msg.pitch), math.degrees(msg.roll))
            if not all(math.isfinite(v) for v in values):
                self._drop("attitude_invalid")
                return
            self._attitude.add(now, values)
        elif kind == "HOME_POSITION":
            if msg.latitude == 0 and msg.longitude == 0:
                self._drop("no_home")  # no home set yet
                return
            altitude = msg.altitude / 1000.0
            if self._home_alt_m is not None and abs(altitude - self._home_alt_m) > 0.5:
                log.info("pose: the autopilot's home moved to %.1f m AMSL (was %.1f)", altitude, self._home_alt_m)
            self._home_alt_m = altitude
        elif kind == "GPS_RAW_INT":
            self._gps.add(now, int(msg.fix_type))
        elif kind == "GIMBAL_DEVICE_ATTITUDE_STATUS":
            if not all(math.isfinite(v) for v in msg.q) or not any(msg.q):
                self._drop("gimbal_invalid")
                return
            yaw, pitch, roll = quaternion_angles(*msg.q)
            flags = msg.flags
            earth = bool(flags & _GIMBAL_YAW_IN_EARTH_FRAME) or (
                not flags & _GIMBAL_YAW_IN_VEHICLE_FRAME and bool(flags & _GIMBAL_YAW_LOCK)
            )
            self._gimbal.add(now, (None, yaw, pitch, roll) if earth else (yaw, None, pitch, roll))
        else:  # MOUNT_ORIENTATION: roll and pitch to the horizon, yaw to the heading and to north, degrees
            if not (math.isfinite(msg.roll) and math.isfinite(msg.pitch)):
                self._drop("gimbal_invalid")
                return
            relative = msg.yaw if math.isfinite(msg.yaw) else None
            absolute = msg.yaw_absolute if math.isfinite(msg.yaw_absolute) else None
            if relative is None and absolute is None:
                self._drop("gimbal_invalid")
                return
            self._gimbal.add(now, (relative, absolute, msg.pitch, msg.roll))

    # the pose

    def ground(self, implied_m: float) -> tuple[float, str]:
        """The ground's height AMSL and where it came from (GROUND_SOURCES), given the home height a fix implies."""
        if self.cfg.ground_alt_m is not None:
            ground, source = self.cfg.ground_alt_m, "configured"
        elif self._home_alt_m is not None:
            ground, source = self._home_alt_m, "home_position"
        else:
            ground, source = implied_m, "global_position"
        if source != self._ground_logged:
            self._ground_logged = source
            self.stats["ground_source"] = source
            log.info("pose: ground at %.2f m AMSL (from %s)", ground, source)
        self.stats["ground_alt_m"] = ground
        return ground, source

    def _local_frame(self) -> LocalFrame:
        """The east/north frame at the origin, made once (its origin never moves).

        Its height is 0: a topocentric frame's east/north do not depend on its origin's height, so the ground's
        height (which may come from HOME_POSITION later) changes only ``up``, which is measured from the ground.
        """
        frame = self._frame
        if frame is None:
            assert self._origin is not None  # set with the first position sample
            frame = self._frame = LocalFrame(self._origin[0], self._origin[1], 0.0)
        return frame

    def latest(self, t_capture: float) -> Pose | None:
        """The pose nearest ``t_capture`` (time.monotonic() seconds), or None when a needed stream is stale."""
        cfg = self.cfg
        position = self._position.nearest(t_capture)
        attitude = self._attitude.nearest(t_capture)
        if position is None or attitude is None:
            self.stats["no_fix"] += 1
            return None
        gimbal = self._gimbal.nearest(t_capture) if cfg.mount == "gimbal" else None
        if cfg.mount == "gimbal" and gimbal is None:
            self.stats["no_fix"] += 1
            return None
        if (
            abs(t_capture - position[0]) > cfg.position_timeout_s
            or abs(t_capture - attitude[0]) > cfg.attitude_timeout_s
            or (gimbal is not None and abs(t_capture - gimbal[0]) > cfg.attitude_timeout_s)
        ):
            self.stats["stale"] += 1
            return None
        gps = self._gps.nearest(t_capture)
        if gps is not None and abs(t_capture - gps[0]) <= _GPS_STATUS_TIMEOUT_S and gps[1] < _GPS_FIX_TYPE_3D:
            self.stats["no_gps_fix"] += 1  # the autopilot's position is dead reckoning: no pose, no claim
            return None
        lat, lon, alt_m, implied_ground_m = position[1]
        ground_m, _ = self.ground(implied_ground_m)
        frame = self._local_frame()
        east, north, _ = frame.from_geodetic(lat, lon, ground_m)  # the point on the ground below the drone
        up = alt_m - ground_m
        yaw, pitch, roll = attitude[1]
        camera = CameraPose(float(east), float(north), up, yaw, pitch, roll, cfg.hfov_deg)
        if gimbal is not None:
            relative, absolute, g_pitch, g_roll = gimbal[1]
            g_yaw = relative if relative is not None else absolute - yaw
            camera = fold_gimbal(
                replace(camera, gimbal_yaw_deg=g_yaw, gimbal_pitch_deg=g_pitch, gimbal_roll_deg=g_roll)
            )
        self.stats["poses"] += 1
        return Pose(
            east_m=camera.east_m,
            north_m=camera.north_m,
            up_m=camera.up_m,
            yaw_deg=camera.yaw_deg,
            pitch_deg=camera.pitch_deg,
            roll_deg=camera.roll_deg,
            hfov_deg=camera.hfov_deg,
            origin_lat=frame.lat0,
            origin_lon=frame.lon0,
            ground_alt_m=ground_m,
        )

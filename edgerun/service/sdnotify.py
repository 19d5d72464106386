"""systemd's notify protocol (READY=1, STATUS=, WATCHDOG=1, STOPPING=1) and a progress-aware watchdog.

systemd starts the unit with ``Type=notify`` and ``WatchdogSec=``; the node says
READY=1 once it is built and its engines are warm (not on its first frame: a node
whose camera is missing at boot is up, degraded, and must not be killed for it)
and pings WATCHDOG=1 only while frames are being inferred or the camera is being
reopened, so a pipeline that hangs (a wedged accelerator driver, a dead camera
thread) gets the process restarted even though its event loop is fine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Callable, Mapping

from edgerun.service.health import Health

log = logging.getLogger(__name__)


# No well-kept library speaks this without pulling in libsystemd, and the protocol is one datagram: ours is right.
class SdNotifier:
    """Sends notify datagrams to ``$NOTIFY_SOCKET``; a no-op when it is unset. Never raises."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if env is None else env
        self.name = self._env.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace.
        self.address = "\0" + self.name[1:] if self.name.startswith("@") else self.name
        self._sock: socket.socket | None = None
        self.send_errors = 0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` lines in one datagram; True when it was sent."""
        if not self.address:
            return False
        lines = (f"{key.upper()}={str(value).replace(chr(10), ' ')}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # a full queue on systemd's side must not stall the loop
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as err:
            if self.send_errors == 0:
                log.warning("sd_notify to %s failed (%s); further failures are only counted", self.name, err)
            self.send_errors += 1
            return False

    def ready(self) -> bool:
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def stopping(self) -> bool:
        return self.notify(STOPPING=1)

    def watchdog_interval(self) -> float | None:
        """systemd's watchdog timeout in seconds (ping at half of it), or None when not asked for."""
        pid = self._env.get("WATCHDOG_PID", "")
        if pid and pid != str(os.getpid()):
            return None
        try:
            usec = int(self._env.get("WATCHDOG_USEC", ""))
        except ValueError:
            return None
        return usec / 1e6 if usec > 0 else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Watchdog:
    """Pings WATCHDOG=1 only while inference makes progress, and reports a stall to Health.

    ``last_progress()`` is the monotonic time of the last inference. When it is
    older than ``stall_s`` the pings stop (systemd then restarts the node after
    ``WatchdogSec``) and ``health`` gets the problem "pipeline"; both undo
    themselves when frames resume. ``stall_excused()``, when given and true,
    keeps the pings going through a stall whose cause is known and being
    handled (a camera being reopened), since a restart would not bring it back.
    """

    PROBLEM_KEY = "pipeline"

    def __init__(
        self,
        notifier: SdNotifier,
        *,
        last_progress: Callable[[], float],
        stall_s: float,
        health: Health,
        status_text: Callable[[], str] | None = None,
        stall_excused: Callable[[], bool] | None = None,
        period_s: float | None = None,
    ) -> None:
        self.notifier = notifier
        self.last_progress = last_progress
        self.stall_s = stall_s
        self.health = health
        self.status_text = status_text
        self.stall_excused = stall_excused
        interval = notifier.watchdog_interval()
        # Half of systemd's interval, as sd_watchdog_enabled(3) advises; 1 s keeps the health check alive without it.
        self.period_s = period_s if period_s is not None else (interval / 2 if interval else 1.0)
        self.stalled = False

    def tick(self) -> None:
        """One check: update the stall problem, then send WATCHDOG=1 (if progressing) and STATUS=."""
        idle = time.monotonic() - self.last_progress()
        if idle > self.stall_s:
            if not self.stalled:
                self.stalled = True
                if self.PROBLEM_KEY not in self.health.reasons:  # keep a more specific cause (a stage crash)
                    self.health.set_problem(self.PROBLEM_KEY, f"no frame inferred for {idle:.1f} s")
        elif self.stalled:
            self.stalled = False
            self.health.clear_problem(self.PROBLEM_KEY)
        fields: dict[str, object] = {}
        if not self.stalled or (self.stall_excused is not None and self.stall_excused()):
            fields["WATCHDOG"] = 1
        if self.status_text is not None:
            fields["STATUS"] = self.status_text()
        if fields:
            self.notifier.notify(**fields)

    async def run(self) -> None:
        """Tick until cancelled; a failing callback ends the pings, so systemd restarts a broken node."""
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("watchdog check failed; no more watchdog pings")
                return
            await asyncio.sleep(self.period_s)

"""The updater's wall clock: now, and whether it can be trusted to judge a manifest's expiry.

A node that booted without a real-time clock or a network fix may believe it is 1970 or
last month; the updater then checks expiry against the newest signed time it has seen
instead (``ota.untrusted_clock``). Whether the clock is synchronised is asked of the kernel,
then of systemd-timesyncd. Tests hand the updater their own ``Clock`` instead.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Callable

# (now in seconds since the epoch, whether the clock is trusted for expiry checks)
Clock = Callable[[], tuple[float, bool]]

TIME_ERROR = 5  # adjtimex(2): the kernel clock is not synchronised

# systemd-timesyncd touches this file at every successful synchronisation (systemd-timesyncd.service(8)).
TIMESYNC_FLAG = Path("/run/systemd/timesync/synchronized")


def kernel_clock_synchronised() -> bool | None:
    """What the kernel says of NTP/PTP sync (adjtimex, read only); None where it cannot tell."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        timex = ctypes.create_string_buffer(512)  # struct timex is 208 bytes on 64-bit Linux; modes=0 reads
        state = libc.adjtimex(timex)
    except (OSError, AttributeError):
        return None
    if state < 0:
        return None
    return state != TIME_ERROR


def clock_synchronised() -> bool | None:
    """Whether the wall clock is synchronised; None where nothing can tell.

    Under the hardened unit adjtimex is denied (ProtectClock= and ~@privileged both remove @clock),
    so timesyncd's flag file is asked next.
    """
    kernel = kernel_clock_synchronised()
    if kernel is not None:
        return kernel
    return True if TIMESYNC_FLAG.exists() else None


def system_clock(mode: Callable[[], str]) -> Clock:
    """The system's wall clock under the policy ``mode()`` returns (``ota.clock``): ``trusted``,
    ``untrusted``, or ``auto`` (trusted while the system says it is synchronised)."""

    def read() -> tuple[float, bool]:
        policy = mode()
        trusted = policy == "trusted" or (policy == "auto" and bool(clock_synchronised()))
        return time.time(), trusted

    return read

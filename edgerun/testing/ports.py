"""Free ports on 127.0.0.1, chosen at run time, for tests, benches, the HIL rig and the demos' local processes.

A port is free "a moment ago": another process may take it before the caller binds. Asking the kernel for
port 0 hands out ports from the ephemeral range (``net.ipv4.ip_local_port_range``), the same range every
outgoing connection and every ``bind(0)`` on the machine draws from, so a port picked that way can be taken
by any socket before the caller binds it (a CI run lost a swarm demo drone to exactly that: ``swarm.bind:
cannot listen on 127.0.0.1:34381``). These pick at random *below* the ephemeral range instead, where the
kernel never assigns a port on its own: only another picker drawing the same number could take it.
Callers that start a server on the port still retry where they can (``run_mosquitto``).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
_ATTEMPTS = 256
_LOWEST = 10000  # below: well-known and registered services people run on their machines
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.SystemRandom()  # not the test's seeded `random`: two processes must not draw alike


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux: 32768 unless configured)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # not Linux: the common default (macOS and the BSDs start at 49152)


def _candidates() -> list[int]:
    low = _ephemeral_low()
    if low - _LOWEST < 1000:  # an ephemeral range reaching down to the registered ports: draw above it
        return [_random.randrange(61000, 65536) for _ in range(_ATTEMPTS)]
    return [_random.randrange(_LOWEST, low) for _ in range(_ATTEMPTS)]


def _free(port: int, kinds: tuple[int, ...]) -> bool:
    for kind in kinds:
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, outside the kernel's ephemeral range."""
    for port in _candidates():
        if _free(port, (socket.SOCK_STREAM,)):
            return port
    raise OSError("no free TCP port on 127.0.0.1")


def free_tcp_udp_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (gossip uses one number for both)."""
    for port in _candidates():
        if _free(port, (socket.SOCK_STREAM, socket.SOCK_DGRAM)):
            return port
    raise OSError("no free port for both UDP and TCP on 127.0.0.1")

"""Free ports on 127.0.0.1, chosen at run time, for tests, benches, the HIL rig and the demos' local processes.

A port is free "a moment ago": another process may take it before the caller binds, so callers that
start a server on it either retry (``run_mosquitto``) or run where nothing else picks ports.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
_ATTEMPTS = 64


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.bind((LOOPBACK, 0))
        return int(tcp.getsockname()[1])


def free_tcp_udp_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (gossip uses one number for both)."""
    for _ in range(_ATTEMPTS):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((LOOPBACK, 0))
            port = int(tcp.getsockname()[1])
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind((LOOPBACK, port))
            except OSError:
                continue  # the kernel's free TCP port is taken for UDP: draw another
            return port
    raise OSError("no free port for both UDP and TCP on 127.0.0.1")

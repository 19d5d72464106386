"""The test and demo port pickers: free ports outside the range the kernel hands out on its own."""

from __future__ import annotations

import socket

import pytest

from edgerun.testing import ports


def test_picked_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(20)] + [ports.free_tcp_udp_port() for _ in range(20)]
    # the kernel's bind(0) and every outgoing connection draw from [low, high]: a port there can be taken
    # by any socket on the machine before the caller binds it (a CI run lost a demo drone that way)
    assert all(ports._LOWEST <= p < low for p in picked), picked
    for port in picked[20:]:
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            with socket.socket(socket.AF_INET, kind) as sock:
                sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_picked(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        # every draw but the last names the taken port: the picker must skip it (UDP taken, TCP free)
        draws = [busy] * 5 + [ports.free_tcp_udp_port()]
        monkeypatch.setattr(ports, "_candidates", lambda: list(draws))
        assert ports.free_tcp_udp_port() == draws[-1]
        monkeypatch.setattr(ports, "_candidates", lambda: [busy] * 3)
        with pytest.raises(OSError, match="no free port for both UDP and TCP"):
            ports.free_tcp_udp_port()

"""``HOST:PORT``: the one parser for every option, setting and tool that names a host and a port."""

from __future__ import annotations

from edgerun.errors import ConfigError, EdgerunError


def parse_hostport(
    text: str,
    what: str,
    default_port: int | None = None,
    *,
    default_host: str | None = "127.0.0.1",
    error: type[EdgerunError] = ConfigError,
) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` into (host, port 0..65535), raising ``error`` that names ``what``.

    ``HOST`` alone takes ``default_port`` (an error when it is None); an empty host is ``default_host``
    (an error when it is None).
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "" if default_port is None else str(default_port)
    host = host.strip("[]") or (default_host or "")
    try:
        number = int(port) if port.isdigit() else -1  # isdigit: no sign, space or underscore slips through int()
    except ValueError:
        number = -1
    if not host or not 0 <= number <= 65535:
        raise error(f"{what}: expected HOST:PORT, got {text!r}")
    return host, number

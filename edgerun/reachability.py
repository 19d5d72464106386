"""Whether a host:port answers a TCP connect, and in a few words why not (a camera's open, ``edgerun doctor``)."""

from __future__ import annotations

import socket


def tcp_problem(host: str, port: int, timeout_s: float) -> str:
    """Why a TCP connect to host:port fails within ``timeout_s`` ("" when it connects): one short reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except socket.gaierror as err:
        return f"cannot resolve {host} ({err.strerror})"
    except OSError as err:
        return err.strerror or str(err)

"""The real node process's HTTP port: malformed requests are one journal line, and the snapshot token."""

from __future__ import annotations

import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

from tests.integration.test_node import NodeProcess

WAIT_S = 60.0


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        return s.recv(200)


def test_malformed_requests_are_one_log_line_not_a_traceback(tmp_path: Path, blazeface_bundle: object) -> None:
    node = NodeProcess(tmp_path)
    try:
        node.wait_http(WAIT_S)
        # Garbage (aiohttp logs it at debug, below the node's info level) and a request with a broken header.
        assert b" 400 " in _raw(node.port, b"GARBAGE\r\n\r\n").split(b"\r\n")[0]
        assert b" 400 " in _raw(node.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n").split(b"\r\n")[0]
        assert node.get("/healthz")[0] == 200
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(WAIT_S) == 0
    finally:
        node.stop()
    log = node.stderr_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    bad = [line for line in log.splitlines() if "bad request" in line]
    assert len(bad) == 1 and "Bad Header" in bad[0], log[-3000:]


def test_the_node_asks_for_the_snapshot_token(tmp_path: Path, blazeface_bundle: object) -> None:
    token = tmp_path / "snapshot.token"
    token.write_text("node-camera-token\n")
    node = NodeProcess(tmp_path, extra=f'snapshot_token_file = "{token}"')
    try:
        node.wait_http(WAIT_S)
        assert node.get("/snapshot.jpg")[0] == 401
        request = urllib.request.Request(
            f"http://127.0.0.1:{node.port}/snapshot.jpg", headers={"Authorization": "Bearer node-camera-token"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                status = r.status
        except urllib.error.HTTPError as err:
            status = err.code
        assert status in (200, 404)  # 404: no frame decoded yet
    finally:
        node.stop()

"""journald's native protocol, spoken to a real unix datagram socket standing in for /run/systemd/journal/socket."""

from __future__ import annotations

import io
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap

import pytest

from edgerun.service.journal import JournalHandler, encode_field, journal_stream_is, priority


def parse_entry(data: bytes) -> dict[str, str]:
    """journald's reading of a native entry (KEY=value lines, or KEY, u64 LE length, bytes)."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        end = data.index(b"\n", pos)
        line = data[pos:end]
        if b"=" in line:
            key, value = line.split(b"=", 1)
            pos = end + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", data, end + 1)
            value = data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n"
            pos = end + 10 + size
        fields[key.decode()] = value.decode()
    return fields


@pytest.fixture
def journal(tmp_path):
    """A bound datagram socket where journald's would be, and a logger writing to it."""
    path = str(tmp_path / "socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    handler = JournalHandler(socket_path=path)
    logger = logging.getLogger("edgerun.engines.failover")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield sock, handler, logger
    logger.removeHandler(handler)
    logger.propagate = True
    handler.close()
    sock.close()


def receive(sock: socket.socket) -> dict[str, str]:
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
    if fds:  # a large entry: empty datagram, the entry in a sealed memfd
        assert data == b""
        with os.fdopen(fds[0], "rb") as f:
            data = os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0)  # journald maps it from offset 0
    return parse_entry(data)


def test_one_entry_per_record_with_structured_fields(journal):
    sock, handler, logger = journal
    handler.set_engine(lambda: "tflite")
    logger.warning("switched to %s after %d errors", "tflite", 3, extra={"event": "failover"})
    entry = receive(sock)
    assert entry["MESSAGE"] == "switched to tflite after 3 errors"
    assert entry["PRIORITY"] == "4"
    assert entry["SYSLOG_IDENTIFIER"] == "edgerun"
    assert entry["EDGERUN_EVENT"] == "failover"
    assert entry["EDGERUN_ENGINE"] == "tflite"
    assert entry["LOGGER"] == "edgerun.engines.failover"
    assert entry["CODE_FUNC"] == "test_one_entry_per_record_with_structured_fields"


def test_event_defaults_to_the_module_and_engine_comes_from_the_call(journal):
    sock, _handler, logger = journal
    logger.info("opened", extra={"engine": "edgetpu", "journal": {"device": "usb:0", "bad-key": 1}})
    entry = receive(sock)
    assert entry["EDGERUN_EVENT"] == "failover" and entry["EDGERUN_ENGINE"] == "edgetpu"
    assert entry["EDGERUN_DEVICE"] == "usb:0" and "EDGERUN_BAD-KEY" not in entry
    assert entry["PRIORITY"] == "6"


def test_a_traceback_keeps_its_newlines(journal):
    sock, _handler, logger = journal
    try:
        raise ValueError("bad\nframe")
    except ValueError:
        logger.exception("decode failed")
    entry = receive(sock)
    assert entry["PRIORITY"] == "3"
    assert entry["MESSAGE"].startswith("decode failed\nTraceback")
    assert entry["MESSAGE"].endswith("ValueError: bad\nframe")


def test_an_entry_larger_than_a_datagram_goes_in_a_memfd(journal):
    sock, _handler, logger = journal
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    big = "x" * (1 << 20)  # over the kernel's datagram limit (net.core.wmem_max, ~212 KiB)
    logger.error("%s", big)
    entry = receive(sock)
    assert entry["MESSAGE"] == big


def test_without_journald_the_line_goes_to_stderr(tmp_path):
    fallback = io.StringIO()
    handler = JournalHandler(socket_path=str(tmp_path / "absent"), fallback=fallback)
    record = logging.LogRecord("edgerun.node", logging.WARNING, __file__, 1, "camera lost", None, None)
    handler.emit(record)
    handler.close()
    assert fallback.getvalue() == "<4>edgerun.node: camera lost\n"
    assert handler.send_errors == 1


def test_encoding_and_priorities():
    assert encode_field("MESSAGE", "hi") == b"MESSAGE=hi\n"
    assert encode_field("MESSAGE", "a\nb") == b"MESSAGE\n" + struct.pack("<Q", 3) + b"a\nb\n"
    assert [priority(level) for level in (50, 40, 30, 20, 10, 5)] == [2, 3, 4, 6, 7, 7]


def test_journal_stream_must_name_this_stream(tmp_path):
    with open(tmp_path / "err", "w") as stream, open(tmp_path / "other", "w") as other:
        st = os.fstat(stream.fileno())
        assert journal_stream_is(stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not journal_stream_is(other, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not journal_stream_is(stream, {})
        assert not journal_stream_is(stream, {"JOURNAL_STREAM": "garbage"})


def test_cli_logs_to_the_journal_only_under_systemd(tmp_path):
    """The CLI's logging set-up in a real process: journal entries when JOURNAL_STREAM names stderr, else lines."""
    path = str(tmp_path / "socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    script = textwrap.dedent(
        f"""
        import logging, os, sys
        from edgerun.service import journal
        journal.SOCKET_PATH = {path!r}
        if sys.argv[1] == "systemd":
            st = os.fstat(2)
            os.environ["JOURNAL_STREAM"] = f"{{st.st_dev}}:{{st.st_ino}}"
        from edgerun.commands.options import setup_logging as _setup_logging
        _setup_logging("info")
        logging.getLogger("edgerun.node").info("started")
        logging.getLogger("edgerun.node").debug("per frame")
        """
    )
    try:
        for mode in ("systemd", "plain"):
            proc = subprocess.run(
                [sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60, env=os.environ.copy()
            )
            assert proc.returncode == 0, proc.stderr
            if mode == "systemd":
                assert proc.stderr == ""
                entry = receive(sock)
                assert entry["MESSAGE"] == "started" and entry["EDGERUN_EVENT"] == "node"
                with pytest.raises(TimeoutError):  # the debug line was filtered by level
                    sock.recv(1 << 16)
            else:
                assert proc.stderr.rstrip().endswith("INFO edgerun.node: started")
                with pytest.raises(TimeoutError):
                    sock.recv(1 << 16)
    finally:
        sock.close()

"""Log records straight into journald, with structured fields, when the node runs under systemd.

systemd tells a service that its standard error is the journal with ``JOURNAL_STREAM=<dev>:<inode>``
(systemd.exec(5)); then each record goes to ``/run/systemd/journal/socket`` as one datagram in
journald's native protocol (https://systemd.io/JOURNAL_NATIVE_PROTOCOL/): ``KEY=value\\n`` per field,
or ``KEY\\n`` + 64-bit little-endian length + bytes + ``\\n`` for a value holding a newline (a
traceback). An entry too big for a datagram goes in a sealed memfd passed with SCM_RIGHTS. Fields:

* ``MESSAGE``, ``PRIORITY`` (syslog level from the record's level), ``SYSLOG_IDENTIFIER=edgerun``,
  ``CODE_FILE``/``CODE_LINE``/``CODE_FUNC``, ``LOGGER`` (the logger's name);
* ``EDGERUN_EVENT``: ``extra={"event": ...}`` of the log call, else the logging module's last name
  (``failover``, ``updater``, ``mqtt``), so ``journalctl -u edgerun EDGERUN_EVENT=failover`` works;
* ``EDGERUN_ENGINE``: ``extra={"engine": ...}`` of the call, else the engine serving frames at the
  time, which the node hands over with ``bind_engine`` (absent until one serves).

No library: python-systemd needs libsystemd and a compiler on the board, and the protocol is one
datagram. A send that fails (journald restarting, a full queue) writes the line to standard error
instead, which is the journal's stream socket anyway; the node never waits for the journal.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import sys
from typing import IO, Callable, Mapping

SOCKET_PATH = "/run/systemd/journal/socket"
# syslog(3) levels: journald and journalctl -p filter on these.
PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
_RESERVED = frozenset(("MESSAGE", "PRIORITY"))


def journal_stream_is(stream: IO[str] | IO[bytes] | None, env: Mapping[str, str] | None = None) -> bool:
    """True when ``$JOURNAL_STREAM`` names this stream's file (systemd connected it to the journal)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    if not value or stream is None:
        return False
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def priority(levelno: int) -> int:
    for level, prio in PRIORITIES.items():  # highest first
        if levelno >= level:
            return prio
    return 7


def encode_field(name: str, value: str | bytes) -> bytes:
    """One field in the native protocol; values with a newline get the length-prefixed form."""
    data = value.encode("utf-8", "replace") if isinstance(value, str) else value
    key = name.encode("ascii")
    if b"\n" in data:
        return key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key + b"=" + data + b"\n"


def valid_field_name(name: str) -> bool:
    """journald keeps only upper-case ASCII, digits and underscores, not starting with "_" or a digit."""
    return (
        0 < len(name) <= 64
        and not name.startswith("_")
        and not name[0].isdigit()
        and all(c.isupper() or c.isdigit() or c == "_" for c in name)
        and name.isascii()
    )


class JournalHandler(logging.Handler):
    """A logging handler that writes one journal entry per record over the native protocol."""

    def __init__(
        self, identifier: str = "edgerun", socket_path: str | None = None, fallback: IO[str] | None = None
    ) -> None:
        super().__init__()
        self.identifier = identifier
        self.socket_path = socket_path or SOCKET_PATH
        self.fallback = fallback if fallback is not None else sys.stderr
        self.engine: Callable[[], str] = str  # "" until bind_engine
        self.send_errors = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)  # a full journal queue must not stall the event loop

    def set_engine(self, engine: Callable[[], str]) -> None:
        """Where the serving back end's key is read, stamped as EDGERUN_ENGINE on records that do not name one."""
        self.engine = engine

    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        if record.stack_info:
            message += "\n" + record.stack_info
        fields = {
            "MESSAGE": message,
            "PRIORITY": str(priority(record.levelno)),
            "SYSLOG_IDENTIFIER": self.identifier,
            "LOGGER": record.name,
            "CODE_FILE": record.pathname,
            "CODE_LINE": str(record.lineno),
            "CODE_FUNC": record.funcName or "",
            "THREAD_NAME": record.threadName or "",
            "EDGERUN_EVENT": str(getattr(record, "event", "") or record.name.rsplit(".", 1)[-1]),
        }
        engine = getattr(record, "engine", "")
        if not engine:
            try:
                engine = self.engine()
            except Exception:  # a node half built or torn down: the entry goes without the field
                engine = ""
        if engine:
            fields["EDGERUN_ENGINE"] = str(engine)
        for key, value in getattr(record, "journal", {}).items():  # extra={"journal": {"FRAME_ID": 7}}
            name = f"EDGERUN_{key}".upper()
            if valid_field_name(name) and name not in _RESERVED:
                fields[name] = str(value)
        return fields

    def encode(self, record: logging.LogRecord) -> bytes:
        return b"".join(encode_field(name, value) for name, value in self.fields(record).items())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entry = self.encode(record)
            try:
                self._sock.sendto(entry, self.socket_path)
            except OSError as err:
                if err.errno != getattr(os, "EMSGSIZE", 90):
                    raise
                self._send_memfd(entry)
        except OSError:
            self.send_errors += 1
            self._write_fallback(record)
        except Exception:
            self.handleError(record)

    def _send_memfd(self, entry: bytes) -> None:
        """A large entry (a long traceback) in a sealed memfd, as sd_journal_send() does."""
        fd = os.memfd_create("edgerun-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, entry)
            import fcntl

            seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            fds = array.array("i", [fd])
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], 0, self.socket_path)
        finally:
            os.close(fd)

    def _write_fallback(self, record: logging.LogRecord) -> None:
        # "<N>" is the priority prefix journald reads on a service's stream (SyslogLevelPrefix=yes).
        self.fallback.write(f"<{priority(record.levelno)}>{record.name}: {record.getMessage()}\n")
        self.fallback.flush()

    def close(self) -> None:
        self._sock.close()
        super().close()


def bind_engine(engine: Callable[[], str]) -> None:
    """Give every journal handler on the root logger the node's serving engine (a no-op off systemd)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, JournalHandler):
            handler.set_engine(engine)

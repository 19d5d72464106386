"""Crash evidence for accelerator calls, kept in the node's state directory.

A driver that segfaults or aborts inside an inference call takes the whole
process with it; no exception handler runs. To still learn which back end did
it, every call into an engine that failover can leave (everything but the CPU
last resort: open, warm-up, infer, close) is bracketed by a counter in a small
memory-mapped file, one per back end::

    <state_dir>/inflight-<key>     64 bytes: magic, calls in flight, boot id, pid

Stores into a shared file mapping land in the page cache at once, so they
survive the death of the process (SIGKILL, SIGSEGV, the systemd watchdog) at
the cost of a memory store per call: no syscall, no fsync on the frame path.
They do not survive a power cut, which is why the boot id is recorded: a count
left by an earlier boot (power loss, kernel panic) is not blamed on the back end.

At start ``recover`` reads the files a previous process left. A non-zero count
written by this boot means that process died inside a call of that back end:
its crash count goes up in ``<state_dir>/engine-state.json`` (written with
fsync and rename, only on these rare events), and failover starts on the next
candidate and re-probes the crashed one after a backoff that grows with the
count. The count is forgiven once the back end has served cleanly for a while.
A clean shutdown removes the in-flight files.

One ``Breadcrumbs`` per state directory per process (``Breadcrumbs.shared``):
an OTA update runs a second failover beside the first for a while, and both
must count into the same files, which are removed when the last one closes.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"EDGRCRB1"
RECORD = struct.Struct("<8sq36si8x")  # magic, in-flight count, boot id, pid; 64 bytes
COUNT_OFFSET = 8
STATE_FILE = "engine-state.json"
INFLIGHT_PREFIX = "inflight-"


def boot_id() -> str:
    """This boot's random id (Linux); empty where the kernel does not offer one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def default_state_dir() -> Path:
    """systemd's ``$STATE_DIRECTORY`` (first entry), else ``./.cache/state``."""
    value = os.environ.get("STATE_DIRECTORY", "")
    if value:
        return Path(value.split(":")[0])
    return Path.cwd() / ".cache" / "state"


class InFlight:
    """Counts calls in flight into one back end, in a file that outlives the process.

    ``with inflight:`` around every call. Several engine instances of one back
    end (a hung one and its re-probe) share the counter, hence the lock.
    """

    def __init__(self, path: Path, boot: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            os.write(fd, RECORD.pack(MAGIC, 0, boot.encode("ascii", "replace")[:36], os.getpid()))
            self._map = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def __enter__(self) -> InFlight:
        with self._lock:
            self._count += 1
            struct.pack_into("<q", self._map, COUNT_OFFSET, self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._count -= 1
            struct.pack_into("<q", self._map, COUNT_OFFSET, self._count)

    def remove(self) -> None:
        with self._lock:
            self._map.close()
        self.path.unlink(missing_ok=True)


def read_inflight(path: Path) -> tuple[int, str, int] | None:
    """(count, boot id, pid) from an in-flight file, or None when it is not one of ours."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < RECORD.size:
        return None
    magic, count, boot, pid = RECORD.unpack_from(data)
    if magic != MAGIC:
        return None
    return count, boot.rstrip(b"\0").decode("ascii", "replace"), pid


_SHARED: dict[Path, Breadcrumbs] = {}
_SHARED_LOCK = threading.Lock()


class Breadcrumbs:
    """The state directory's crash evidence: in-flight counters and persisted crash counts."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.boot = boot_id()
        self._inflight: dict[str, InFlight] = {}
        self._lock = threading.Lock()
        self.crashes: dict[str, int] = {}
        self.last_crash: dict[str, float] = {}
        self._blamed: dict[str, int] | None = None
        self._users = 0

    @classmethod
    def shared(cls, state_dir: Path) -> Breadcrumbs:
        """This process's instance for ``state_dir``."""
        key = Path(state_dir).resolve()
        with _SHARED_LOCK:
            crumbs = _SHARED.get(key)
            if crumbs is None:
                crumbs = _SHARED[key] = cls(key)
            return crumbs

    def retain(self) -> None:
        """One more user (a failover); ``release`` by each, the last one cleans up."""
        with self._lock:
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.close()

    # -- at start ----------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """Blame back ends a previous process died inside; returns key -> crash count for those.

        Also loads the persisted counts (``crashes``) and removes the old files. Only
        the first call per instance looks: later ones return the same answer.
        """
        with self._lock:
            if self._blamed is not None:
                return dict(self._blamed)
            self._blamed = blamed = self._recover()
            return dict(blamed)

    def _recover(self) -> dict[str, int]:
        self._load_state()
        blamed: dict[str, int] = {}
        if not self.state_dir.is_dir():
            return blamed
        for path in sorted(self.state_dir.glob(INFLIGHT_PREFIX + "*")):
            key = path.name[len(INFLIGHT_PREFIX) :]
            record = read_inflight(path)
            if record is not None and record[2] == os.getpid():
                continue  # a live counter of this very process, not a crash
            path.unlink(missing_ok=True)
            if record is None:
                continue
            count, boot, pid = record
            if count <= 0:
                continue
            if self.boot and boot != self.boot:
                log.info("engine %s had a call in flight when the machine went down (earlier boot): not blamed", key)
                continue
            self.crashes[key] = self.crashes.get(key, 0) + 1
            self.last_crash[key] = time.time()
            blamed[key] = self.crashes[key]
            log.warning(
                "engine %s: the last process (pid %d) died inside a call to it; crash %d", key, pid, self.crashes[key]
            )
        if blamed:
            self._save_state()
        return blamed

    # -- while running -------------------------------------------------------------

    def inflight(self, key: str) -> InFlight:
        """The in-flight counter of ``key`` (made on first use, with the state directory)."""
        with self._lock:
            counter = self._inflight.get(key)
            if counter is None:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                counter = self._inflight[key] = InFlight(self.state_dir / f"{INFLIGHT_PREFIX}{key}", self.boot)
            return counter

    def forgive(self, key: str) -> None:
        """``key`` served cleanly for long enough: its crash count starts again from zero."""
        with self._lock:
            if self.crashes.pop(key, None) is None:
                return
            self.last_crash.pop(key, None)
            self._save_state()
        log.info("engine %s served cleanly; its crash count is reset", key)

    def close(self) -> None:
        """Clean shutdown: nothing was in flight when the process ended."""
        with self._lock:
            counters, self._inflight = list(self._inflight.values()), {}
        for counter in counters:
            counter.remove()

    # -- the persisted counts ------------------------------------------------------

    def _load_state(self) -> None:
        path = self.state_dir / STATE_FILE
        try:
            data: Any = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            log.warning("%s unreadable (%s); crash counts start from zero", path, err)
            return
        crashes = data.get("crashes", {}) if isinstance(data, dict) else {}
        self.crashes = {str(k): int(v) for k, v in crashes.items() if isinstance(v, int) and v > 0}
        last = data.get("last_crash", {}) if isinstance(data, dict) else {}
        self.last_crash = {str(k): float(v) for k, v in last.items() if isinstance(v, (int, float))}

    def _save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        body = json.dumps({"crashes": self.crashes, "last_crash": self.last_crash}, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        try:
            dir_fd = os.open(self.state_dir, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

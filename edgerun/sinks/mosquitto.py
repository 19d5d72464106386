"""A private mosquitto broker, for ``edgerun demo --local-broker``, tests, ``edgerun bench --sinks`` and the HIL rig.

The broker is a real ``mosquitto -c FILE`` process with a config written here:
one listener on 127.0.0.1 (plain or TLS; the HIL rig binds its namespace's
address), anonymous access, persistence off unless asked for. It can be stopped
and started again on the same port, which is how the reconnect tests take the
broker away from a running sink. edgerun, hil and the test helpers start
mosquitto only through here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.testing.ports import free_port

# Debian installs the broker in sbin, which is not on a normal user's PATH.
_SEARCH_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def find_mosquitto() -> str | None:
    """The mosquitto binary, or None when it is not installed."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for directory in _SEARCH_DIRS:
        candidate = Path(directory) / "mosquitto"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def give_to_broker_user(paths: list[Path]) -> None:
    """Started as root, mosquitto drops to its own user: let that user read its files and write persistence."""
    if os.geteuid() != 0:
        return
    try:
        import pwd

        entry = pwd.getpwnam("mosquitto")
    except (ImportError, KeyError):
        return
    for path in paths:
        os.chown(path, entry.pw_uid, entry.pw_gid)


@dataclass
class BrokerTls:
    """Files for a TLS listener; ``require_certificate`` makes it mutual TLS."""

    ca: str
    cert: str
    key: str
    require_certificate: bool = False


@dataclass
class Mosquitto:
    """A running (or stopped) private broker; ``start``/``stop`` keep the same port."""

    port: int
    workdir: Path
    tls: BrokerTls | None = None
    persistence: bool = False
    extra: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def config_text(self) -> str:
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            f"persistence {'true' if self.persistence else 'false'}",
            "set_tcp_nodelay true",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if self.persistence:
            # A trailing slash is how mosquitto tells a directory from a file prefix.
            lines.append(f"persistence_location {self.workdir}/")
            lines.append("autosave_interval 0")
        if self.tls is not None:
            # Copies in the workdir: a broker started as root reads them after dropping to its own user.
            lines += [f"cafile {self.workdir / 'ca.crt'}", f"certfile {self.workdir / 'server.crt'}"]
            lines.append(f"keyfile {self.workdir / 'server.key'}")
            lines.append(f"require_certificate {'true' if self.tls.require_certificate else 'false'}")
        lines += self.extra
        return "\n".join(lines) + "\n"

    def prepare(self) -> list[str]:
        """Write the config (and TLS copies) into the workdir; the command that runs this broker.

        ``start`` runs it here; the HIL rig runs it inside the broker's network namespace instead.
        """
        binary = find_mosquitto()
        if binary is None:
            raise EdgerunError("mosquitto is not installed (run .ci/install-system-deps)")
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(self.config_text(), encoding="utf-8")
        owned = [self.workdir]
        if self.tls is not None:
            for source, name in ((self.tls.ca, "ca.crt"), (self.tls.cert, "server.crt"), (self.tls.key, "server.key")):
                shutil.copyfile(source, self.workdir / name)
                owned.append(self.workdir / name)
        give_to_broker_user(owned)
        return [binary, "-c", str(conf)]

    def start(self, timeout: float = 10.0) -> None:
        """Start the broker and wait until its port accepts connections."""
        if self.running:
            return
        command = self.prepare()
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a Ctrl-C in the terminal is for the test runner, not the broker
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                self.process = None
                raise EdgerunError(f"mosquitto on port {self.port} exited at start: {' | '.join(tail)}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise EdgerunError(f"mosquitto on port {self.port} did not listen within {timeout:.0f} s") from None
                time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (mosquitto saves its persistence file), then SIGKILL if it lingers."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    def kill(self) -> None:
        """Take the broker away without a goodbye, as a crash or a cut cable would."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5.0)


@contextlib.contextmanager
def run_mosquitto(
    port: int = 0,
    *,
    tls: BrokerTls | None = None,
    persistence: bool = False,
    extra: list[str] | None = None,
    workdir: str | Path | None = None,
) -> Iterator[Mosquitto]:
    """A private broker on 127.0.0.1 for the duration of the ``with`` block.

    ``port=0`` picks a free port (and retries if another process takes it
    first); the broker is always stopped on exit, even when the block raises.
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="edgerun-mosquitto-"))
        attempts = 1 if port else 5
        broker: Mosquitto | None = None
        for attempt in range(attempts):
            broker = Mosquitto(
                port=port or free_port(),
                workdir=Path(workdir),
                tls=tls,
                persistence=persistence,
                extra=list(extra or []),
            )
            try:
                broker.start()
                break
            except EdgerunError:
                if attempt == attempts - 1:
                    raise
        assert broker is not None
        try:
            yield broker
        finally:
            broker.stop()

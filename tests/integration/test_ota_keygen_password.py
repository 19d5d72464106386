"""``edgerun ota keygen`` asks for a password like minisign -G: real processes, a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from edgerun.ota.errors import SignatureError
from edgerun.ota.minisign import PublicKey, SecretKey

pytestmark = pytest.mark.timeout(120)


def keygen(tmp_path: Path, *extra: str, stdin: bytes | None = None, env: dict[str, str] | None = None):
    cmd = [sys.executable, "-m", "edgerun", "ota", "keygen", "-p", str(tmp_path / "k.pub"), "-s",
           str(tmp_path / "k.key"), *extra]  # fmt: skip
    return subprocess.run(
        cmd, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL, capture_output=True,
        env={**os.environ, **(env or {})}, timeout=60,
    )  # fmt: skip


def _check_pair(tmp_path: Path, password: bytes | None) -> None:
    key = SecretKey.load(tmp_path / "k.key", password)
    assert key.public_key.line() == PublicKey.load(tmp_path / "k.pub").line()
    assert (tmp_path / "k.key").stat().st_mode & 0o077 == 0


def test_without_a_terminal_or_a_password_option_it_refuses_and_writes_nothing(tmp_path: Path) -> None:
    proc = keygen(tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "--no-password" in lines[0] and "not a terminal" in lines[0], lines
    assert not (tmp_path / "k.key").exists() and not (tmp_path / "k.pub").exists()


def test_no_password_writes_an_unencrypted_key(tmp_path: Path) -> None:
    proc = keygen(tmp_path, "--no-password")
    assert proc.returncode == 0, proc.stderr
    assert b"(not encrypted)" in proc.stdout
    assert "not encrypted" in (tmp_path / "k.key").read_text().splitlines()[0]
    _check_pair(tmp_path, None)


def test_a_password_from_stdin_or_the_environment_encrypts_the_key(tmp_path: Path) -> None:
    proc = keygen(tmp_path, "--password-stdin", stdin=b"correct horse\n")
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(SignatureError, match="encrypted"):
        SecretKey.load(tmp_path / "k.key")
    _check_pair(tmp_path, b"correct horse")
    proc = keygen(tmp_path, "-f", "--password-env", "KEYGEN_TEST_PW", env={"KEYGEN_TEST_PW": "battery staple"})
    assert proc.returncode == 0, proc.stderr
    _check_pair(tmp_path, b"battery staple")
    assert keygen(tmp_path, "-f", "--password-stdin", stdin=b"\n").returncode == 2
    both = keygen(tmp_path, "-f", "--no-password", "--password-stdin", stdin=b"x\n")
    assert both.returncode == 2 and b"not allowed with" in both.stderr


def _on_a_terminal(tmp_path: Path, answers: list[bytes]) -> tuple[int, str]:
    """Run keygen with a pseudo-terminal as its controlling terminal, answering each password prompt."""
    master, slave = os.openpty()
    cmd = [sys.executable, "-m", "edgerun", "ota", "keygen", "-p", str(tmp_path / "k.pub"), "-s",
           str(tmp_path / "k.key")]  # fmt: skip

    def take_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # getpass reads /dev/tty: make the pty this session's terminal

    proc = subprocess.Popen(
        cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=take_terminal
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        pending = list(answers)
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
                while pending and seen.count(b"assword") > len(answers) - len(pending):
                    os.write(master, pending.pop(0) + b"\n")
            elif proc.poll() is not None:
                break
        return proc.wait(30), seen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_on_a_terminal_it_asks_twice_and_encrypts(tmp_path: Path) -> None:
    rc, out = _on_a_terminal(tmp_path, [b"tr0ub4dor", b"tr0ub4dor"])
    assert rc == 0, out
    assert out.count("assword") == 2 and "tr0ub4dor" not in out  # not echoed
    _check_pair(tmp_path, b"tr0ub4dor")


def test_on_a_terminal_two_different_answers_are_refused(tmp_path: Path) -> None:
    rc, out = _on_a_terminal(tmp_path, [b"one", b"two"])
    assert rc == 2 and "do not match" in out, out
    assert not (tmp_path / "k.key").exists()

"""Progress lines for long commands: drawn on a terminal, never on a pipe or after -q, never on stdout."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

SCRIPT = """
import sys, time
from edgerun import progress
if len(sys.argv) > 1:
    progress.set_enabled(False)
with progress.phases("work", 2) as bar:
    bar.step("first phase")
    time.sleep(0.3)
    bar.step("second phase")
    time.sleep(0.3)
print("RESULT")
"""


def _run_on_terminal(*args: str) -> str:
    """Run SCRIPT with its stderr on a real pseudo-terminal (stdout a pipe, as `cmd > file` would be)."""
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, *args], stdout=subprocess.PIPE, stderr=child, env={**os.environ}
    )
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(parent, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=30)
    os.close(parent)
    assert out.decode().strip() == "RESULT", "stdout carries only the result"
    return seen.decode(errors="replace")


def test_a_terminal_sees_each_phase() -> None:
    shown = _run_on_terminal()
    assert "work: first phase [0/2 done" in shown
    assert "work: second phase [1/2 done" in shown


def test_quiet_draws_nothing_on_a_terminal() -> None:
    assert "work" not in _run_on_terminal("quiet")


def test_a_pipe_gets_no_progress() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "RESULT"
    assert proc.stderr == ""

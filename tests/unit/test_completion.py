"""``edgerun completion bash``: the script a real bash loads, and what it completes.

The script comes from a real ``edgerun`` process; a real bash checks its syntax (``bash -n``), sources it and
calls the completion function the way readline would (COMP_WORDS, COMP_CWORD), so a generator that emits
something bash cannot load, or that misses a subcommand, fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "edgerun", "completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    path = tmp_path_factory.mktemp("completion") / "edgerun.bash"
    path.write_text(done.stdout)
    return path


def complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of ``words`` (``edgerun`` first), from the sourced script."""
    quoted = " ".join(f"'{w}'" for w in words)
    program = f'source "{script}"; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _shtab_edgerun; '
    program += 'printf "%s\\n" "${COMPREPLY[@]}"'
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_bash_script_is_valid_bash(bash_script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "complete -o bashdefault -F _shtab_edgerun edgerun" in bash_script.read_text()


def test_it_completes_subcommands_and_their_options(bash_script: Path) -> None:
    assert complete(bash_script, "edgerun", "fl") == ["fleet"]
    assert complete(bash_script, "edgerun", "fleet", "st") == ["status"]
    assert complete(bash_script, "edgerun", "ota", "keygen", "--sig") == ["--signing-key"]
    assert "completion" in complete(bash_script, "edgerun", "")


def test_old_spellings_are_not_offered(bash_script: Path) -> None:
    assert complete(bash_script, "edgerun", "ota", "keygen", "--sec") == []


@pytest.mark.parametrize("shell", ["zsh", "tcsh"])
def test_other_shells_get_a_script_too(shell: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "edgerun", "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0 and "edgerun" in done.stdout, done.stderr

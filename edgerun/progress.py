"""Progress of long commands (``bench``, ``model fetch-demo``, ``ota publish``) while a person watches.

Drawn by tqdm on stderr, so stdout stays the command's result (JSON or a table) for pipes and files.
Nothing is drawn when stderr is not a terminal (systemd's journal, CI, a pipe: carriage-return redraws
would litter them) or after ``-q``: tqdm's ``disable=None`` makes the terminal check.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_enabled = True  # off for the whole process after -q (edgerun.commands.options)


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def shown() -> bool:
    """Whether a progress line would be drawn now (stderr is a terminal and -q was not given)."""
    return _enabled and sys.stderr.isatty()


class Phases:
    """``bench blazeface_short: stages [4/9 done, 00:41]``: which of a command's known phases runs, and for how long.

    ``step(name)`` marks the start of the next phase; the line goes away when the block ends.
    """

    def __init__(self, title: str, total: int) -> None:
        from tqdm import tqdm

        self._bar: Any = tqdm(
            total=total,
            desc=title,
            file=sys.stderr,
            disable=None if _enabled else True,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc} [{n_fmt}/{total_fmt} done, {elapsed}]",
        )
        self._title = title
        self._started = False

    def step(self, name: str) -> None:
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_description_str(f"{self._title}: {name}", refresh=True)

    def close(self) -> None:
        self._bar.close()


@contextmanager
def phases(title: str, total: int) -> Iterator[Phases]:
    bar = Phases(title, total)
    try:
        yield bar
    finally:
        bar.close()

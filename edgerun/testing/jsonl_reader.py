"""Reading back the JSON Lines that nodes (``[sinks.jsonl]``) and the HIL observer write, whole or as they grow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a half-written last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_bytes().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


class JsonlTail:
    """Reads the lines appended to a JSON Lines file since the last call (for the live status line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

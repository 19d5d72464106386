"""Reading a node's JSON Lines output while the node is still writing it."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """Every complete record in ``path``; a last line still being written is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out

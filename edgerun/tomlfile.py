"""Reading a TOML file the node was given, whatever bytes it holds, into a table or one clear error.

Config files, ``model.toml`` and bundle manifests come from people and from
disks that fail: a file that is missing, a directory, unreadable, too large,
not UTF-8, binary garbage, invalid or absurdly nested TOML each end in one
``EdgerunError`` line naming the file and what is wrong, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from edgerun.errors import EdgerunError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6): the same parser, published as tomli before it joined the stdlib
    import tomli as tomllib

__all__ = ["MAX_TOML_BYTES", "load_toml", "tomllib"]

# A node's config or a model manifest is a few KiB; anything this large is the wrong file.
MAX_TOML_BYTES = 1 << 20


def load_toml(path: Path, error: type[EdgerunError], what: str) -> dict[str, Any]:
    """The table in ``path``; ``error`` (ConfigError, ModelError...) names the file and the fault otherwise."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_TOML_BYTES + 1)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{path}: {what} is a directory, expected a file") from None
    except OSError as err:
        raise error(f"{path}: cannot read {what} ({err.strerror or err})") from None
    if len(raw) > MAX_TOML_BYTES:
        raise error(f"{path}: {what} is larger than {MAX_TOML_BYTES} bytes; not a TOML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: {what} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise error(f"{path}: invalid TOML ({err})") from None
    except RecursionError:
        raise error(f"{path}: invalid TOML (arrays or tables nested too deeply)") from None

"""The offline basemap the operator gives (``edgerun station --tiles PATH``): a tile directory or an MBTiles file.

A field tent has no internet, so the map's tiles come from the operator's disk, served by the station
itself at ``/tiles/{z}/{x}/{y}``:

* a directory of ``{z}/{x}/{y}.png`` (or ``.jpg``) files in the XYZ scheme (what most tile downloaders write);
* an MBTiles 1.3 file (SQLite: ``tiles(zoom_level, tile_column, tile_row, tile_data)`` in the TMS scheme, its
  rows counted from the south, and a ``metadata`` table with ``format``, ``minzoom``, ``maxzoom``, ``bounds``).

The file is opened read-only; a tile that is not there is a 404 (Leaflet shows the background).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError

MAX_ZOOM = 24
MAX_TILE_BYTES = 1 << 20  # a 256 px tile is tens of KiB; anything larger is not one
CONTENT_TYPES = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass(frozen=True)
class TileInfo:
    """What the page needs to place the basemap: its image type, zoom range and extent (west, south, east, north)."""

    format: str
    minzoom: int
    maxzoom: int
    bounds: tuple[float, float, float, float] | None

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "minzoom": self.minzoom, "maxzoom": self.maxzoom, "bounds": self.bounds}


def tile_in_range(z: int, x: int, y: int) -> bool:
    return 0 <= z <= MAX_ZOOM and 0 <= x < (1 << z) and 0 <= y < (1 << z)


class TileSource:
    """One basemap; ``tile`` is blocking (disk or SQLite), so the server calls it in a thread."""

    info: TileInfo

    def tile(self, z: int, x: int, y: int) -> bytes | None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the file (nothing to do for a directory)."""

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES.get(self.info.format, "application/octet-stream")


class TileDirectory(TileSource):
    """``{z}/{x}/{y}.png`` (or .jpg/.webp, whichever the directory holds), XYZ scheme."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        zooms = sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())
        if not zooms:
            raise ConfigError(f"--tiles {root}: no zoom-level directories ({{z}}/{{x}}/{{y}}.png) in it")
        fmt = "png"
        for ext in CONTENT_TYPES:
            if next(self.root.glob(f"{zooms[0]}/*/*.{ext}"), None) is not None:
                fmt = ext
                break
        self.info = TileInfo(fmt, zooms[0], zooms[-1], None)

    def tile(self, z: int, x: int, y: int) -> bytes | None:
        path = self.root / str(z) / str(x) / f"{y}.{self.info.format}"  # ints only: no way out of the root
        try:
            if path.stat().st_size > MAX_TILE_BYTES:
                return None
            return path.read_bytes()
        except OSError:
            return None


class MBTiles(TileSource):
    """An MBTiles file, read-only; one connection shared by the server's threads under a lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
            meta = dict(self._db.execute("SELECT name, value FROM metadata").fetchall())
            zooms = self._db.execute("SELECT MIN(zoom_level), MAX(zoom_level) FROM tiles").fetchone()
        except sqlite3.Error as err:
            raise ConfigError(f"--tiles {path}: not an MBTiles file ({err})") from None
        self._lock = threading.Lock()
        fmt = str(meta.get("format", "png")).lower()
        if fmt not in CONTENT_TYPES:
            raise ConfigError(f"--tiles {path}: tile format {fmt!r} is not an image this page can show (png, jpg)")
        low, high = zooms if zooms and zooms[0] is not None else (0, 0)
        minzoom = _int(meta.get("minzoom"), low)
        maxzoom = _int(meta.get("maxzoom"), high)
        self.info = TileInfo(fmt, minzoom, maxzoom, _bounds(meta.get("bounds")))

    def tile(self, z: int, x: int, y: int) -> bytes | None:
        row = (1 << z) - 1 - y  # TMS counts rows from the south
        with self._lock:
            found = self._db.execute(
                "SELECT tile_data FROM tiles WHERE zoom_level = ? AND tile_column = ? AND tile_row = ?", (z, x, row)
            ).fetchone()
        if found is None or not isinstance(found[0], bytes) or len(found[0]) > MAX_TILE_BYTES:
            return None
        return found[0]

    def close(self) -> None:
        self._db.close()


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _bounds(text: Any) -> tuple[float, float, float, float] | None:
    try:
        west, south, east, north = (float(v) for v in str(text).split(","))
    except ValueError:
        return None
    if not (-180 <= west < east <= 180 and -90 <= south < north <= 90):
        return None
    return (west, south, east, north)


def open_tiles(path: str | Path) -> TileSource:
    """The operator's basemap: a directory or an .mbtiles file; a ConfigError naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        return TileDirectory(path)
    if path.is_file():
        return MBTiles(path)
    raise ConfigError(f"--tiles {path}: no such file or directory")

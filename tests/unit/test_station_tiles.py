"""The station's offline basemap sources and the vendored map files shipping in the wheel."""

from __future__ import annotations

import configparser
import fnmatch
from pathlib import Path

import pytest

from edgerun.errors import ConfigError
from edgerun.station.tiles import TileDirectory, open_tiles, tile_in_range

REPO = Path(__file__).resolve().parents[2]


def test_a_tile_directory_serves_its_files_and_nothing_outside_them(tmp_path):
    (tmp_path / "15" / "16892").mkdir(parents=True)
    (tmp_path / "15" / "16892" / "10900.png").write_bytes(b"\x89PNG tile")
    (tmp_path / "17").mkdir()
    tiles = open_tiles(tmp_path)
    assert isinstance(tiles, TileDirectory)
    assert (tiles.info.minzoom, tiles.info.maxzoom, tiles.info.format) == (15, 17, "png")
    assert tiles.tile(15, 16892, 10900) == b"\x89PNG tile"
    assert tiles.tile(15, 16892, 10901) is None
    assert tiles.content_type == "image/png"


def test_a_path_that_is_no_basemap_is_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="--tiles .*missing: no such file or directory"):
        open_tiles(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"no zoom-level directories"):
        open_tiles(tmp_path)
    junk = tmp_path / "junk.mbtiles"
    junk.write_bytes(b"not a database" * 100)
    with pytest.raises(ConfigError, match="--tiles .*junk.mbtiles: not an MBTiles file"):
        open_tiles(junk)


def test_tile_coordinates_outside_the_zoom_are_refused():
    assert tile_in_range(3, 7, 7) and not tile_in_range(3, 8, 0) and not tile_in_range(25, 0, 0)


def test_every_static_file_of_the_page_ships_in_the_wheel():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    patterns = [p.strip() for p in cfg["options.package_data"]["edgerun"].split(",")]
    package = REPO / "edgerun"
    files = [p.relative_to(package).as_posix() for p in (package / "station" / "static").rglob("*") if p.is_file()]
    assert any(f.startswith("station/static/vendor/leaflet/") for f in files)
    # setuptools globs do not cross "/": a pattern matches files at its own depth only
    matched = [f for f in files if any(fnmatch.fnmatchcase(f, p) and f.count("/") == p.count("/") for p in patterns)]
    missing = sorted(set(files) - set(matched))
    assert not missing, f"not in setup.cfg's package_data: {missing}"

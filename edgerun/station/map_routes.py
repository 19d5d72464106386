"""The station's map and export routes, beside the page's own (edgerun.station.server):

    GET /static/vendor/leaflet/<file>     Leaflet and its marker-cluster plugin, vendored from Debian (no CDN)
    GET /api/map                          the basemap's zoom range and extent ({"tiles": null} without --tiles)
    GET /tiles/<z>/<x>/<y>                one tile of the operator's basemap (--tiles DIR or FILE.mbtiles)
    GET /api/export/objects.<fmt>         the fleet objects as GeoJSON, KML or CSV (edgerun.fleet.export)

They sit behind the server's doors like every route: with --users only the vendored files are served
without a login (they are the same for everyone, like the page's own script).
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from importlib.abc import Traversable
from typing import Any

from aiohttp import web

from edgerun import wire
from edgerun.fleet import export
from edgerun.station.tiles import TileSource, tile_in_range

VENDOR_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
EXPORT_TYPES = {
    "geojson": "application/geo+json",
    "kml": "application/vnd.google-earth.kml+xml",
    "csv": "text/csv",
}


def _vendor_files() -> dict[str, Traversable]:
    """Every vendored file by its path under vendor/leaflet/ (the licences too, as text)."""
    root = resources.files("edgerun.station") / "static" / "vendor" / "leaflet"
    files: dict[str, Traversable] = {}
    stack: list[tuple[str, Traversable]] = [("", root)]
    while stack:
        prefix, folder = stack.pop()
        for item in folder.iterdir():
            if item.is_dir():
                stack.append((f"{prefix}{item.name}/", item))
            else:
                files[prefix + item.name] = item
    return files


def station_object(obj: dict[str, Any]) -> export.ExportedObject:
    """A fleet object as the station's model keeps it (edgerun.station.model.parse_object), for the writers."""
    has_latlon = obj.get("lat") is not None and obj.get("lon") is not None
    return export.ExportedObject(
        id=str(obj["id"]),
        label=str(obj["label"]),
        lat=obj.get("lat"),
        lon=obj.get("lon"),
        alt_m=obj.get("alt_m"),
        uncertainty_m=obj.get("uncertainty_m"),
        first_seen=obj.get("first_seen"),
        last_seen=obj.get("last_seen"),
        owner=str(obj.get("owner") or ""),
        seen_by=tuple(str(n) for n in obj.get("seen_by") or ()),
        score=obj.get("score"),
        schema=wire.OBJECT_SCHEMA if has_latlon else wire.OBJECT_SCHEMA_V1,
        east_m=obj.get("east_m"),
        north_m=obj.get("north_m"),
    )


class MapRoutes:
    def __init__(self, objects: Any, tiles: TileSource | None) -> None:
        """``objects``: the station model's objects (id -> dict), read at each export; ``tiles``: the basemap."""
        self.objects = objects
        self.tiles = tiles
        self._vendor = _vendor_files()
        self.tiles_served = 0
        self.tiles_missing = 0

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/static/vendor/leaflet/{path:.+}", self._vendor_file)
        app.router.add_get("/api/map", self._map_info)
        app.router.add_get("/tiles/{z:\\d+}/{x:\\d+}/{y:\\d+}", self._tile)
        app.router.add_get("/api/export/objects.{fmt}", self._export)

    async def _vendor_file(self, request: web.Request) -> web.Response:
        name = request.match_info["path"]
        item = self._vendor.get(name)
        if item is None:
            raise web.HTTPNotFound()
        suffix = name[name.rfind(".") :] if "." in name else ""
        content_type = VENDOR_TYPES.get(suffix, "text/plain")
        headers = {"Cache-Control": "max-age=86400"}
        return web.Response(body=item.read_bytes(), content_type=content_type, headers=headers)

    async def _map_info(self, request: web.Request) -> web.Response:
        info = self.tiles.info.to_json() if self.tiles is not None else None
        return web.json_response({"tiles": info}, headers={"Cache-Control": "no-store"})

    async def _tile(self, request: web.Request) -> web.Response:
        if self.tiles is None:
            raise web.HTTPNotFound(text="no basemap: start the station with --tiles DIR or FILE.mbtiles\n")
        m = request.match_info
        z, x, y = int(m["z"][:3]), int(m["x"][:9]), int(m["y"][:9])
        if not tile_in_range(z, x, y):
            raise web.HTTPNotFound()
        body = await asyncio.to_thread(self.tiles.tile, z, x, y)
        if body is None:
            self.tiles_missing += 1
            raise web.HTTPNotFound()
        self.tiles_served += 1
        return web.Response(body=body, content_type=self.tiles.content_type, headers={"Cache-Control": "max-age=3600"})

    async def _export(self, request: web.Request) -> web.Response:
        fmt = request.match_info["fmt"]
        if fmt not in EXPORT_TYPES:
            raise web.HTTPNotFound(text=f"export formats: {', '.join(EXPORT_TYPES)}\n")
        found = export.Export()
        for obj in list(self.objects.values()):
            found.add(station_object(obj))
        body = export.render(found, fmt)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return web.Response(
            body=body,
            content_type=EXPORT_TYPES[fmt],
            headers={
                "Cache-Control": "no-store",
                "Content-Disposition": f'attachment; filename="edgerun-objects-{stamp}.{fmt}"',
            },
        )

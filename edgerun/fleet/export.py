"""Fleet objects for a ground team's tools: GeoJSON (RFC 7946), KML 2.2 and CSV.

``edgerun fleet objects`` writes these from what it hears on the broker; the station
reuses the same writers. Objects come in as payloads (untrusted bytes), are decoded
through ``edgerun.wire.ObjectReport`` (``edgerun.object/2`` and ``/1``), and the latest
report of each id is kept (an owner re-reports an object as more drones see it).

* GeoJSON: a FeatureCollection of Points at [lon, lat] (RFC 7946's order). Heights are not
  put in the coordinates: RFC 7946's third coordinate is height above the WGS84 ellipsoid,
  and ``alt_m`` is the ground's height above mean sea level, so it is a property.
* KML 2.2: one Placemark per object, clamped to the ground, its time span from first to
  last seen, every field again as ExtendedData (written with the standard library's
  ElementTree, so the node needs no KML package; the tests check it against the OGC schema).
* CSV: one row per object with a header; ``edgerun.object/1`` objects (no lat/lon, only
  east/north metres in their owner's frame) are rows too, with their lat/lon empty.

Objects without lat/lon (``edgerun.object/1``) cannot be placed on a map: the GeoJSON and KML
writers skip them and say how many (``Export.skipped_no_latlon``).
"""

from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import msgspec

from edgerun import wire

FORMATS = ("geojson", "kml", "csv")
MAX_OBJECT_BYTES = 16 * 1024  # a fleet object is a few hundred bytes; anything far larger is not one
KML_NS = "http://www.opengis.net/kml/2.2"
CSV_FIELDS = (
    "id", "label", "lat", "lon", "alt_m", "uncertainty_m", "first_seen", "last_seen", "owner", "seen_by", "score",
    "schema", "east_m", "north_m",
)  # fmt: skip
# A spreadsheet runs a cell that starts with one of these as a formula; text from the broker must not.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


@dataclass(frozen=True, slots=True)
class ExportedObject:
    """One fleet object as the ground team gets it (a decoded ObjectReport, times in Unix seconds)."""

    id: str
    label: str
    lat: float | None
    lon: float | None
    alt_m: float | None
    uncertainty_m: float | None
    first_seen: float | None
    last_seen: float | None
    owner: str
    seen_by: tuple[str, ...]
    score: float | None
    schema: str
    east_m: float | None = None
    north_m: float | None = None

    @property
    def has_latlon(self) -> bool:
        return self.lat is not None and self.lon is not None


@dataclass
class Export:
    """The latest report of each object heard, and what could not be used."""

    objects: dict[str, ExportedObject] = field(default_factory=dict)
    bad: int = 0  # payloads that were not a fleet object (too big, not JSON, wrong shape)
    first_error: str = ""

    def add_payload(self, payload: bytes) -> bool:
        """Decode one message from the fleet topic; False (counted) when it is not a fleet object."""
        obj = decode_object(payload)
        if isinstance(obj, str):
            self.bad += 1
            self.first_error = self.first_error or obj
            return False
        self.add(obj)
        return True

    def add(self, obj: ExportedObject) -> None:
        """Keep the newest report of an id (by last_seen; a later report of the same instant wins)."""
        old = self.objects.get(obj.id)
        if old is None or (obj.last_seen or 0.0) >= (old.last_seen or 0.0):
            self.objects[obj.id] = obj

    def sorted(self) -> list[ExportedObject]:
        """Objects in the order they were first seen (then by id): a stable file for the same objects."""
        return sorted(self.objects.values(), key=lambda o: (o.first_seen or 0.0, o.id))

    @property
    def skipped_no_latlon(self) -> int:
        return sum(1 for o in self.objects.values() if not o.has_latlon)


def decode_object(payload: bytes) -> ExportedObject | str:
    """A fleet object from untrusted bytes, or a one-line reason it is not one."""
    if len(payload) > MAX_OBJECT_BYTES:
        return f"{len(payload)} bytes, more than a fleet object ({MAX_OBJECT_BYTES})"
    try:
        report = msgspec.json.decode(payload, type=wire.ObjectReport)
    except msgspec.DecodeError as err:
        return wire.describe(err)
    seen_by = report.seen_by
    nodes = tuple(str(n) for n in seen_by) if isinstance(seen_by, list) else ()
    return ExportedObject(
        id=str(report.id),
        label=report.label,
        lat=report.lat,
        lon=report.lon,
        alt_m=report.alt_m,
        uncertainty_m=report.uncertainty_m,
        first_seen=report.first_seen,
        last_seen=report.last_seen,
        owner=report.owner,
        seen_by=nodes,
        score=report.score,
        schema=report.schema or ("edgerun.object/2" if report.lat is not None else "edgerun.object/1"),
        east_m=report.east_m,
        north_m=report.north_m,
    )


def iso_utc(ts: float | None) -> str | None:
    """Unix seconds -> ISO 8601 in UTC with a Z (``2026-05-01T12:00:03.250Z``), milliseconds kept."""
    if ts is None:
        return None
    text = datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def _properties(obj: ExportedObject) -> dict[str, Any]:
    return {
        "id": obj.id,
        "label": obj.label,
        "first_seen": iso_utc(obj.first_seen),
        "last_seen": iso_utc(obj.last_seen),
        "owner": obj.owner,
        "seen_by": list(obj.seen_by),
        "uncertainty_m": obj.uncertainty_m,
        "score": obj.score,
        "alt_m": obj.alt_m,  # the ground's height above mean sea level, not RFC 7946's ellipsoidal height
    }


def to_geojson(objects: Iterable[ExportedObject]) -> str:
    """An RFC 7946 FeatureCollection of the objects that have lat/lon."""
    features = [
        {
            "type": "Feature",
            "id": obj.id,
            "geometry": {"type": "Point", "coordinates": [obj.lon, obj.lat]},
            "properties": _properties(obj),
        }
        for obj in objects
        if obj.has_latlon
    ]
    return json.dumps({"type": "FeatureCollection", "features": features}, indent=1) + "\n"


def _kml(tag: str) -> str:
    return f"{{{KML_NS}}}{tag}"


def _number(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def to_kml(objects: Iterable[ExportedObject], name: str = "edgerun fleet objects") -> bytes:
    """A KML 2.2 document (UTF-8 bytes) with one Placemark per object that has lat/lon."""
    ET.register_namespace("", KML_NS)
    root = ET.Element(_kml("kml"))
    doc = ET.SubElement(root, _kml("Document"))
    ET.SubElement(doc, _kml("name")).text = name
    for obj in objects:
        if not obj.has_latlon:
            continue
        # The OGC schema fixes the order: name, description, TimeSpan, ExtendedData, then the geometry.
        mark = ET.SubElement(doc, _kml("Placemark"), id=f"object-{obj.id}")
        ET.SubElement(mark, _kml("name")).text = f"{obj.label} {obj.id}"
        seen = ", ".join(obj.seen_by) or "-"
        uncertainty = "?" if obj.uncertainty_m is None else f"{obj.uncertainty_m:.1f}"
        ET.SubElement(mark, _kml("description")).text = (
            f"{obj.label} within {uncertainty} m; first seen {iso_utc(obj.first_seen) or '?'}, "
            f"last seen {iso_utc(obj.last_seen) or '?'}; reported by {obj.owner or '?'}, seen by {seen}"
        )
        if obj.first_seen is not None or obj.last_seen is not None:
            span = ET.SubElement(mark, _kml("TimeSpan"))
            if obj.first_seen is not None:
                ET.SubElement(span, _kml("begin")).text = iso_utc(obj.first_seen)
            if obj.last_seen is not None:
                ET.SubElement(span, _kml("end")).text = iso_utc(obj.last_seen)
        data = ET.SubElement(mark, _kml("ExtendedData"))
        for key, value in _properties(obj).items():
            text = ",".join(value) if isinstance(value, list) else "" if value is None else str(value)
            ET.SubElement(ET.SubElement(data, _kml("Data"), name=key), _kml("value")).text = text
        point = ET.SubElement(mark, _kml("Point"))
        # clampToGround (KML's default): the object lies on the terrain whatever height the viewer's model has.
        ET.SubElement(point, _kml("coordinates")).text = f"{_number(obj.lon)},{_number(obj.lat)}"
    ET.indent(root, space=" ")
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _cell(text: str) -> str:
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def to_csv(objects: Iterable[ExportedObject]) -> str:
    """A header and one row per object (``edgerun.object/1`` ones too, with empty lat/lon); times ISO 8601 UTC."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for obj in objects:
        writer.writerow(
            [
                _cell(obj.id),
                _cell(obj.label),
                _number(obj.lat),
                _number(obj.lon),
                _number(obj.alt_m),
                _number(obj.uncertainty_m),
                iso_utc(obj.first_seen) or "",
                iso_utc(obj.last_seen) or "",
                _cell(obj.owner),
                _cell(";".join(obj.seen_by)),
                _number(obj.score),
                obj.schema,
                _number(obj.east_m),
                _number(obj.north_m),
            ]
        )
    return out.getvalue()


def render(export: Export, fmt: str) -> bytes:
    """The whole export in one of FORMATS, as the bytes of a file."""
    objects = export.sorted()
    if fmt == "geojson":
        return to_geojson(objects).encode()
    if fmt == "kml":
        return to_kml(objects)
    if fmt == "csv":
        return to_csv(objects).encode()
    raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")

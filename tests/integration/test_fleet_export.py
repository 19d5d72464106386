"""``edgerun fleet objects``: what the swarm found, exported for a ground team, read back by real parsers.

The writers (edgerun/fleet/export.py) are checked with the libraries a ground team's tools are
built on: GeoJSON with the ``geojson`` package (RFC 7946 objects and their validity), KML against
the OGC KML 2.2 schema that ``fastkml`` ships (with lxml) and parsed by ``fastkml``, CSV with the
standard library's reader. The command is run as a person would, against a real mosquitto.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgerun.fleet.export import Export, decode_object, iso_utc, render, to_csv, to_geojson, to_kml
from tests.integration.brokers import python_env, run_mosquitto

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def v2(oid: str, lat: float, lon: float, *, last: float = 5.0, seen_by: list[str] | None = None, **extra) -> bytes:
    payload = {
        "schema": "edgerun.object/2",
        "id": oid,
        "label": "face",
        "lat": lat,
        "lon": lon,
        "alt_m": 112.5,
        "uncertainty_m": 1.8,
        "first_seen": T0 + 1.25,
        "last_seen": T0 + last,
        "score": 0.91,
        "owner": "drone-2",
        "seen_by": seen_by or ["drone-2"],
        "ts": T0 + last,
        **extra,
    }
    return json.dumps(payload).encode()


def v1(oid: str, label: str = "person") -> bytes:
    return json.dumps(
        {
            "schema": "edgerun.object/1",
            "id": oid,
            "label": label,
            "east_m": 12.5,
            "north_m": -3.0,
            "uncertainty_m": 2.0,
            "first_seen": T0,
            "last_seen": T0 + 2,
            "score": 0.7,
            "owner": "old-node",
            "seen_by": ["old-node"],
            "ts": T0 + 2,
        }
    ).encode()


PAYLOADS = [
    v2("00000000000000a1", 53.1172345, -4.1297012),
    # The owner's update of the same object (a third drone saw it): the later report is the one exported.
    v2("00000000000000a1", 53.1172349, -4.1297020, last=9.0, seen_by=["drone-2", "drone-1", "drone-3"]),
    v2("00000000000000b2", 53.1181, -4.1265, east_m=3.0, north_m=4.0, origin=[53.117, -4.13, 100.0]),
    v1("00000000000000c3"),
    v1("00000000000000d4", label="=HYPERLINK(1)"),  # text from the broker that a spreadsheet would run
    b"not json",
    json.dumps({"schema": "edgerun.object/2", "id": "00000000000000e5", "label": "face", "lat": 95.0}).encode(),
]


def exported() -> Export:
    export = Export()
    for payload in PAYLOADS:
        export.add_payload(payload)
    return export


def test_decoding_keeps_the_latest_report_and_counts_what_is_not_an_object() -> None:
    export = exported()
    assert sorted(export.objects) == ["00000000000000a1", "00000000000000b2", "00000000000000c3", "00000000000000d4"]
    assert export.bad == 2 and export.skipped_no_latlon == 2
    a1 = export.objects["00000000000000a1"]
    assert a1.seen_by == ("drone-2", "drone-1", "drone-3") and a1.lat == 53.1172349
    assert decode_object(b"x" * 20_000) == "20000 bytes, more than a fleet object (16384)"
    assert decode_object(PAYLOADS[-1]) == "lat: Expected `float` <= 90.0"
    assert iso_utc(T0 + 1.25) == "2026-01-01T00:00:01.250Z"


def test_geojson_is_rfc7946_with_lon_lat_order() -> None:
    geojson = pytest.importorskip("geojson")
    text = to_geojson(exported().sorted())
    collection = geojson.loads(text)
    assert isinstance(collection, geojson.FeatureCollection) and collection.is_valid, collection.errors()
    features = {f["id"]: f for f in collection["features"]}
    assert sorted(features) == ["00000000000000a1", "00000000000000b2"]  # the /1 objects have no place on a map
    for feature in features.values():
        assert isinstance(feature, geojson.Feature) and feature.is_valid
        assert isinstance(feature["geometry"], geojson.Point) and feature["geometry"].is_valid
    a1 = features["00000000000000a1"]
    assert a1["geometry"]["coordinates"] == [-4.129702, 53.117235]  # [lon, lat], as geojson rounds them (6 places)
    assert a1["properties"] == {
        "id": "00000000000000a1",
        "label": "face",
        "first_seen": "2026-01-01T00:00:01.250Z",
        "last_seen": "2026-01-01T00:00:09.000Z",
        "owner": "drone-2",
        "seen_by": ["drone-2", "drone-1", "drone-3"],
        "uncertainty_m": 1.8,
        "score": 0.91,
        "alt_m": 112.5,
    }
    # RFC 7946: a FeatureCollection, no "crs" member (WGS84 lon/lat is implied), positions of two numbers here.
    doc = json.loads(text)
    assert "crs" not in doc and all(len(f["geometry"]["coordinates"]) == 2 for f in doc["features"])
    assert doc["features"][0]["geometry"]["coordinates"] == [-4.129702, 53.1172349]  # the wire's 1e-7 degree kept


def test_kml_is_valid_against_the_ogc_schema_and_reads_back() -> None:
    pytest.importorskip("lxml")
    fastkml = pytest.importorskip("fastkml")
    from fastkml.validator import get_schema_parser
    from lxml import etree

    data = to_kml(exported().sorted())
    schema = get_schema_parser()  # ogckml22.xsd as fastkml ships it (with the atom and xAL schemas it imports)
    tree = etree.fromstring(data)
    assert schema.validate(tree), schema.error_log
    kml = fastkml.KML.from_string(data)
    placemarks = list(kml.features[0].features)
    assert [p.name for p in placemarks] == ["face 00000000000000a1", "face 00000000000000b2"]
    first = placemarks[0]
    assert (first.geometry.x, first.geometry.y) == (-4.129702, 53.1172349)
    assert first.times.begin.dt.isoformat() == "2026-01-01T00:00:01.250000+00:00"
    assert first.times.end.dt.isoformat() == "2026-01-01T00:00:09+00:00"
    fields = {d.name: d.value for d in first.extended_data.elements}
    assert fields["seen_by"] == "drone-2,drone-1,drone-3" and fields["uncertainty_m"] == "1.8"
    assert fields["owner"] == "drone-2" and fields["alt_m"] == "112.5"


def test_csv_has_a_header_every_object_and_no_formulas() -> None:
    rows = list(csv.DictReader(io.StringIO(to_csv(exported().sorted()))))
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == ["00000000000000a1", "00000000000000b2", "00000000000000c3", "00000000000000d4"]
    a1 = by_id["00000000000000a1"]
    assert (a1["lat"], a1["lon"], a1["alt_m"], a1["uncertainty_m"]) == ("53.1172349", "-4.129702", "112.5", "1.8")
    assert a1["seen_by"] == "drone-2;drone-1;drone-3" and a1["first_seen"] == "2026-01-01T00:00:01.250Z"
    c3 = by_id["00000000000000c3"]
    assert (c3["lat"], c3["lon"], c3["east_m"], c3["north_m"], c3["schema"]) == ("", "", "12.5", "-3.0",
                                                                                 "edgerun.object/1")  # fmt: skip
    assert by_id["00000000000000d4"]["label"] == "'=HYPERLINK(1)"
    assert by_id["00000000000000b2"]["east_m"] == "3.0"


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="format: expected one of geojson, kml, csv, got 'shp'"):
        render(Export(), "shp")


@pytest.mark.parametrize("fmt", ["geojson", "kml", "csv"])
def test_the_command_exports_what_the_broker_carries(tmp_path: Path, fmt: str) -> None:
    """Objects published on edgerun/fleet/objects while the command listens end up in the file it writes."""
    from edgerun.mqtt_client import connect_blocking, new_client

    with run_mosquitto() as broker:
        stop = threading.Event()
        publisher = new_client(id_prefix="test-fleet-objects")
        connect_blocking(publisher, "127.0.0.1", broker.port)

        def publish() -> None:
            # Over and over until the command is done: its subscription starts at a moment this test cannot see.
            while not stop.is_set():
                for payload in PAYLOADS:
                    publisher.publish("edgerun/fleet/objects", payload, qos=1)
                time.sleep(0.2)

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        out = tmp_path / f"objects.{fmt}"
        try:
            done = subprocess.run(
                [sys.executable, "-m", "edgerun", "fleet", "objects", "--mqtt", f"127.0.0.1:{broker.port}",
                 "--format", fmt, "-o", str(out), "--seconds", "2"],
                capture_output=True, text=True, timeout=60, env=python_env(),
            )  # fmt: skip
        finally:
            stop.set()
            thread.join(5)
            publisher.disconnect()
            publisher.loop_stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    summary = done.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"fleet objects: 4 from mqtt://127.0.0.1:{broker.port} edgerun/fleet/objects in 2 s")
    assert "bad messages skipped (first: JSON is malformed" in summary
    data = out.read_bytes()
    if fmt == "geojson":
        assert "2 without lat/lon (edgerun.object/1) left out of the geojson" in summary
        ids = [f["id"] for f in json.loads(data)["features"]]
        assert ids == ["00000000000000a1", "00000000000000b2"]
    elif fmt == "kml":
        assert "left out of the kml" in summary
        assert data.count(b"<Placemark ") == 2 and b"<coordinates>-4.129702,53.1172349</coordinates>" in data
    else:
        assert "without lat/lon" not in summary
        assert [r["id"] for r in csv.DictReader(io.StringIO(data.decode()))] == [
            "00000000000000c3", "00000000000000d4", "00000000000000a1", "00000000000000b2"
        ]  # fmt: skip


def test_the_command_writes_an_empty_collection_when_nothing_is_found(tmp_path: Path) -> None:
    with run_mosquitto() as broker:
        done = subprocess.run(
            [sys.executable, "-m", "edgerun", "fleet", "objects", "--mqtt", f"127.0.0.1:{broker.port}",
             "--seconds", "0.5"],
            capture_output=True, text=True, timeout=60, env=python_env(),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"type": "FeatureCollection", "features": []}
    refused = subprocess.run(
        [sys.executable, "-m", "edgerun", "fleet", "objects", "--mqtt", "127.0.0.1:1", "--seconds", "1"],
        capture_output=True, text=True, timeout=60, env=python_env(),
    )  # fmt: skip
    assert (
        refused.returncode != 0 and refused.stderr.strip() == "edgerun: error: mqtt://127.0.0.1:1: connection refused"
    )

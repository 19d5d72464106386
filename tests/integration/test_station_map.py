"""The station's geographic map, phone layout and exports in headless Chromium, fed by a real node and mosquitto.

One drone of the demo's swarm layout flies the replayed scene and reports fleet objects (lat/lon) to a real
mosquitto; ``edgerun station --tiles`` serves an offline basemap from a tiny MBTiles file this test writes with
sqlite3 around the scene. The operator logs in through the form (--users), then the page must show:
Leaflet tiles loaded from that MBTiles (the tile requests answered by the station), a marker for the drone and
every fleet object (apart or in clusters), a popup for an object; the local-metres view on request; no
horizontal scroll at 390 px; and the GeoJSON, KML and CSV exports, which need the login, parse and list the
objects the page shows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import tomli_w

from edgerun.demo_swarm import drone_configs, start_drones, stop_drones
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.station.auth import set_password
from edgerun.station.tiles import open_tiles
from swarm.geo import DEFAULT_ANCHOR
from tests.conftest import free_port
from tests.integration.brokers import wait_for
from tests.integration.station_rig import chromium, needs_chromium

OPERATOR, PASSWORD = "bob", "staple battery horse"
ZOOMS = (16, 17, 18)

pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
    needs_chromium,
]


def tile_of(lat: float, lon: float, z: int) -> tuple[int, int]:
    """The XYZ (slippy map) tile holding a point."""
    n = 1 << z
    x = int((lon + 180.0) / 360.0 * n)
    y = int((1.0 - math.asinh(math.tan(math.radians(lat))) / math.pi) / 2.0 * n)
    return x, y


def make_mbtiles(path: Path, lat: float, lon: float) -> int:
    """An MBTiles 1.3 file of 5 x 5 PNG tiles around (lat, lon) at each of ZOOMS; returns how many tiles."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE metadata (name TEXT, value TEXT)")
    db.execute("CREATE TABLE tiles (zoom_level INTEGER, tile_column INTEGER, tile_row INTEGER, tile_data BLOB)")
    span = 0.01
    db.executemany(
        "INSERT INTO metadata VALUES (?, ?)",
        [
            ("name", "test basemap"),
            ("format", "png"),
            ("minzoom", str(ZOOMS[0])),
            ("maxzoom", str(ZOOMS[-1])),
            ("bounds", f"{lon - span},{lat - span},{lon + span},{lat + span}"),
        ],
    )
    count = 0
    for z in ZOOMS:
        cx, cy = tile_of(lat, lon, z)
        for x in range(cx - 2, cx + 3):
            for y in range(cy - 2, cy + 3):
                tile = np.full((256, 256, 3), (40 + 20 * (z - ZOOMS[0]), 90, 60), np.uint8)
                cv2.putText(tile, f"{z}/{x}/{y}", (10, 128), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (255, 255, 255), 1)
                ok, png = cv2.imencode(".png", tile)
                assert ok
                row = (1 << z) - 1 - y  # MBTiles rows are TMS: counted from the south
                db.execute("INSERT INTO tiles VALUES (?, ?, ?, ?)", (z, x, row, png.tobytes()))
                count += 1
    db.commit()
    db.close()
    return count


def test_the_tiny_mbtiles_reads_back_in_the_xyz_scheme(tmp_path):
    lat, lon = DEFAULT_ANCHOR[0], DEFAULT_ANCHOR[1]
    path = tmp_path / "base.mbtiles"
    make_mbtiles(path, lat, lon)
    tiles = open_tiles(path)
    try:
        assert (tiles.info.minzoom, tiles.info.maxzoom, tiles.info.format) == (16, 18, "png")
        x, y = tile_of(lat, lon, 17)
        png = tiles.tile(17, x, y)
        assert png is not None
        image = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)
        assert image.shape == (256, 256, 3) and tuple(image[5, 5]) == (60, 90, 60)  # zoom 17's colour (BGR)
        assert tiles.tile(17, x + 40, y) is None
    finally:
        tiles.close()


@pytest.fixture
def rig(tmp_path):
    lat, lon = DEFAULT_ANCHOR[0], DEFAULT_ANCHOR[1]
    mbtiles = tmp_path / "basemap.mbtiles"
    make_mbtiles(mbtiles, lat, lon)
    users = tmp_path / "users"
    set_password(users, OPERATOR, PASSWORD)
    with run_mosquitto() as broker:
        (drone,) = drone_configs(tmp_path, 1, mqtt=f"127.0.0.1:{broker.port}")
        drone.config["source"]["fps"] = 5
        drone.config["swarm"]["timing"] = {"gossip_interval_s": 0.1}
        (drone.out_dir / "node.toml").write_text(tomli_w.dumps(drone.config))
        port = free_port()
        log = tmp_path / "station.log"
        station = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgerun",
                "station",
                "--mqtt",
                f"127.0.0.1:{broker.port}",
                "--bind",
                f"127.0.0.1:{port}",
                "--users",
                str(users),
                "--tiles",
                str(mbtiles),
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        start_drones([drone], seconds=120)
        try:
            yield {"url": f"http://127.0.0.1:{port}", "log": log, "drone": drone, "lat": lat, "lon": lon}
        finally:
            if drone.proc is not None and drone.proc.poll() is None:
                drone.proc.terminate()
            stop_drones([drone])
            station.terminate()
            try:
                station.wait(10)
            except subprocess.TimeoutExpired:
                station.kill()


@pytest.fixture
def browser():
    driver = chromium()
    try:
        yield driver
    finally:
        driver.quit()


OBJECTS_JS = "return [...document.querySelectorAll('#objects tbody tr[data-id]')].map(r => r.dataset.id);"
GEO_JS = """const m = document.getElementById('geomap');
return {shown: !m.classList.contains('hidden'), svgShown: !document.getElementById('map').classList.contains('hidden'),
  tiles: [...m.querySelectorAll('img.leaflet-tile-loaded')].filter(i => i.naturalWidth === 256).length,
  tileRequests: performance.getEntriesByType('resource').filter(e => e.name.includes('/tiles/')).length,
  drones: [...m.querySelectorAll('.geo-drone svg[data-id]')].map(s => s.dataset.id),
  objects: [...m.querySelectorAll('.geo-object span[data-id]')].map(s => s.dataset.id),
  clustered: [...m.querySelectorAll('.marker-cluster span')].reduce((n, s) => n + (+s.textContent), 0),
  footprints: m.querySelectorAll('path.geo-footprint').length};"""
POPUP_JS = "const p = document.querySelector('.leaflet-popup-content .find'); return p ? p.dataset.id : null;"
MODE_JS = "const s = document.getElementById('map-mode'); s.value = arguments[0]; s.dispatchEvent(new Event('change'));"
SCROLL_JS = "return [document.documentElement.scrollWidth, window.innerWidth];"


def until(what: str, predicate: Any, rig: dict, timeout: float = 90.0) -> None:
    if not wait_for(predicate, timeout, 0.25):
        raise AssertionError(
            f"the page never showed {what}\n--- station\n{rig['log'].read_text()[-2000:]}\n--- node\n"
            f"{(rig['drone'].out_dir / 'node.log').read_text()[-2000:]}"
        )


def log_in(driver: Any, rig: dict) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    until("the login form", lambda: _get(driver, rig["url"] + "/") and driver.current_url.endswith("/login"), rig, 30)
    form = driver.find_element(By.ID, "login")
    driver.find_element(By.ID, "user").send_keys(OPERATOR)
    driver.find_element(By.ID, "password").send_keys(PASSWORD)
    driver.find_element(By.ID, "login-submit").click()
    WebDriverWait(driver, 30).until(expected_conditions.staleness_of(form))


def _get(driver: Any, url: str) -> bool:
    try:
        driver.get(url)
        return True
    except Exception:
        return False


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the status itself is the answer (the station sends a browser without a login to /login)


def fetch(url: str, cookie: str | None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=10) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), ""


@pytest.mark.timeout(300)
def test_map_with_offline_tiles_phone_layout_and_exports(rig, browser):
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        NoSuchElementException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.common.by import By

    driver = browser
    log_in(driver, rig)
    until("fleet objects in the table", lambda: len(driver.execute_script(OBJECTS_JS)) >= 2, rig, 120)
    geo = driver.execute_script(GEO_JS)
    until("the geographic map", lambda: driver.execute_script(GEO_JS)["shown"], rig, 10)

    # -- the basemap: tiles from the operator's MBTiles, through the station ---------------------------------
    until("basemap tiles loaded", lambda: driver.execute_script(GEO_JS)["tiles"] >= 4, rig, 30)
    geo = driver.execute_script(GEO_JS)
    assert geo["tileRequests"] >= geo["tiles"] and not geo["svgShown"]

    # -- the drone (placed through its objects' frame) and every object, apart or in a cluster ----------------
    def all_objects_on_map() -> bool:
        g = driver.execute_script(GEO_JS)
        return len(g["objects"]) + g["clustered"] == len(driver.execute_script(OBJECTS_JS))

    until("every object on the map", all_objects_on_map, rig, 30)
    until("the drone on the map", lambda: driver.execute_script(GEO_JS)["drones"] == ["drone-1"], rig, 30)
    assert driver.execute_script(GEO_JS)["footprints"] == 1

    # -- an object's popup, zoomed in past clustering --------------------------------------------------------
    shown = driver.execute_script(OBJECTS_JS)
    target = shown[0]
    driver.execute_script(
        "const m = GEO.objectMarkers[arguments[0]].marker; GEO.map.setView(m.getLatLng(), 20, {animate: false});",
        target,
    )
    until("the object's marker apart", lambda: target in driver.execute_script(GEO_JS)["objects"], rig, 10)

    def click_opens_popup() -> bool:
        # found afresh each try: a marker is replaced when its object's report changes (a refined position)
        try:
            driver.find_element(By.CSS_SELECTOR, f'.geo-object span[data-id="{target}"]').click()
        except (ElementClickInterceptedException, NoSuchElementException, StaleElementReferenceException):
            return False
        return driver.execute_script(POPUP_JS) == target

    until("the object's popup", click_opens_popup, rig, 15)
    popup = driver.execute_script("return document.querySelector('.leaflet-popup-content').innerText")
    assert "face" in popup and "drone-1" in popup

    # -- the local-metres view on request ------------------------------------------------------------------------
    driver.execute_script(
        "const s = document.getElementById('map-mode'); s.value = 'local'; s.dispatchEvent(new Event('change'));"
    )
    until("the local map", lambda: driver.execute_script(GEO_JS)["svgShown"], rig, 10)
    assert not driver.execute_script(GEO_JS)["shown"]
    assert driver.execute_script("return document.querySelectorAll('#map g.object').length") >= 2
    driver.execute_script(
        "const s = document.getElementById('map-mode'); s.value = 'auto'; s.dispatchEvent(new Event('change'));"
    )

    # -- a phone: 390 px wide, no sideways scroll --------------------------------------------------------------
    driver.set_window_size(390, 844)
    until("the page at 390 px", lambda: driver.execute_script("return window.innerWidth") <= 390, rig, 10)
    until("a redraw at 390 px", lambda: driver.execute_script(GEO_JS)["shown"], rig, 10)
    driver.execute_script("window.dispatchEvent(new Event('resize'))")
    time.sleep(1.0)  # a redraw or two (every 200 ms) at the new width
    width, inner = driver.execute_script(SCROLL_JS)
    assert width <= inner, f"the page is {width} px wide in a {inner} px window"

    # -- exports: behind the login, and they parse -----------------------------------------------------------
    cookie = "; ".join(f"{c['name']}={c['value']}" for c in driver.get_cookies())
    links = {
        fmt: driver.execute_script(f"return document.getElementById('export-{fmt}').href")
        for fmt in ("geojson", "kml", "csv")
    }
    ids = set(driver.execute_script(OBJECTS_JS))
    x, y = tile_of(rig["lat"], rig["lon"], 17)
    tile_url = f"{rig['url']}/tiles/17/{x}/{y}"
    assert fetch(tile_url, None)[0] == 303  # the basemap is behind the login too: a browser is sent to /login
    status, body, kind = fetch(tile_url, cookie)
    assert status == 200 and kind == "image/png" and body.startswith(b"\x89PNG")
    for fmt, url in links.items():
        assert fetch(url, None)[0] == 401, f"{fmt} export without a login"
    status, body, kind = fetch(links["geojson"], cookie)
    assert status == 200 and kind.startswith("application/geo+json")
    collection = json.loads(body)
    assert collection["type"] == "FeatureCollection"
    geo_ids = {f["properties"]["id"] for f in collection["features"]}
    assert ids <= geo_ids  # objects that came since the table was read may be there too
    for feature in collection["features"]:
        lon, lat = feature["geometry"]["coordinates"]
        assert abs(lat - rig["lat"]) < 0.01 and abs(lon - rig["lon"]) < 0.01
    status, body, _ = fetch(links["kml"], cookie)
    assert status == 200
    ns = {"k": "http://www.opengis.net/kml/2.2"}
    placemarks = ET.fromstring(body).findall(".//k:Placemark", ns)
    assert {p.get("id") for p in placemarks} >= {f"object-{i}" for i in ids}
    assert all(p.findtext("k:name", namespaces=ns).startswith("face ") for p in placemarks)
    status, body, _ = fetch(links["csv"], cookie)
    assert status == 200
    table = list(csv.DictReader(io.StringIO(body.decode())))
    assert ids <= {row["id"] for row in table} and all(row["label"] == "face" for row in table)

"""The station's store end to end: real mosquitto, three real node processes (the demo's swarm layout), the
station as a process on a SQLite file (and two of them on one real PostgreSQL 15).

* The station is SIGKILLed and started again on the same ``--db``: its API shows the same objects, events and
  node states (a node stopped cleanly grey, a SIGKILLed node DEAD), last seen as stored.
* The restarted station's page in headless Chromium shows the same node states and objects, and its retire
  button takes a node off (on the other station too, through the retained mark).
* Messages published while the station was down reach it when it comes back (its MQTT 5 session).
* A station started after the fact on an empty store names the same states from the retained status words.
* ``edgerun fleet retire`` takes a node off both the running station and the one started after it; the node
  comes back when it speaks again.
* Two stations on one PostgreSQL database and one broker show the same objects, and the database holds each
  report and each node event once, as many as a plain subscriber heard; one of them SIGKILLed and started
  again shows the same objects. A PostgreSQL store one schema version behind is migrated and keeps its rows.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edgerun import wire
from edgerun.demo_swarm import DEMO_RADIUS_M, SIDE_STEP_M, SPACING_M, write_swarm_key
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.testing.ports import free_port, free_tcp_udp_port
from tests.integration.brokers import collecting, python_env, wait_for
from tests.integration.station_rig import (  # noqa: F401 (browser: a fixture)
    PG_BIN,
    StationProcess,
    browser,
    needs_chromium,
    needs_postgresql,
    postgres_server,
    publish,
)

NODES = ("drone-1", "drone-2", "drone-3")

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


class Swarm:
    """The demo's three drones over one replayed scene, gossiping under one key: their dedup reports objects."""

    def __init__(self, tmp: Path, broker_port: int) -> None:
        self.tmp = tmp
        key = tmp / "swarm.key"
        write_swarm_key(key)
        ports = [free_tcp_udp_port() for _ in NODES]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for index, name in enumerate(NODES):
            seeds = json.dumps([f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != index])
            (tmp / f"{name}.toml").write_text(f"""[node]
id = "{name}"
[source]
kind = "replay"
fps = 5
[source.replay]
seed = 1
path_offset_m = {-SPACING_M * index}
east_offset_m = {SIDE_STEP_M[index]}
[swarm]
enabled = true
bind = "127.0.0.1:{ports[index]}"
seeds = {seeds}
key_file = "{key}"
radius_m = {DEMO_RADIUS_M}
labels = ["face"]
share_sightings = true
[engine]
replicas = 1
num_threads = 1
[sinks.mqtt]
enabled = true
host = "127.0.0.1"
port = {broker_port}
metrics_interval_s = 1.0
keepalive_s = 2
[service]
http_port = {free_port()}
""")
            self.start(name)

    def start(self, name: str) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(self.tmp / f"{name}.toml")],
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / f"{name}.log").open("a"),
            env=python_env(),
        )

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)

    def close(self) -> None:
        for name in self.procs:
            self.stop(name, signal.SIGKILL)


def comparable(snap: dict[str, Any]) -> dict[str, Any]:
    """What an operator reads off the page: objects, node states and last seen, the events."""
    return {
        "objects": sorted(snap["objects"], key=lambda o: o["id"]),
        "nodes": {
            k: (n["state"], n["last_seen"], n["model"], n["engine"]) for k, n in snap["nodes"].items() if k in NODES
        },
        "events": [(e["ts"], e["node"], e["kind"], e["text"]) for e in snap["events"] if e["node"] in NODES],
    }


PAGE_STATES = {"drone-1": "stopped", "drone-2": "stopped", "drone-3": "dead"}


def retained_marks(port: int) -> set[str]:
    """The nodes the broker holds a retire mark for (retained messages come in one burst after subscribing)."""
    with collecting(port, [f"{wire.RETIRED_PREFIX}/#"]) as marks:
        wait_for(lambda: bool(marks.messages), timeout=3)
        time.sleep(0.3)
        return {m.topic.rsplit("/", 1)[1] for m in marks.messages if m.payload}


def page_rows(driver: Any) -> dict[str, str]:
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#nodes tbody tr[data-id]')]"
        ".map(r => [r.dataset.id, r.dataset.state]).filter(([id]) => id.startsWith('drone-')));"
    )


def click_retire(driver: Any, node: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    def press(d: Any) -> bool:
        d.find_element(By.CSS_SELECTOR, f'button[data-retire="{node}"]').click()  # found afresh: rows redraw
        return True

    WebDriverWait(driver, 10, ignored_exceptions=(StaleElementReferenceException,)).until(press)
    alert = WebDriverWait(driver, 10).until(expected_conditions.alert_is_present())
    assert f"Retire {node}?" in alert.text
    alert.accept()


@needs_chromium
@pytest.mark.timeout(400)
def test_a_killed_station_comes_back_with_the_same_mission_and_names_stops_and_deaths(tmp_path, browser):  # noqa: F811
    driver = browser
    db = str(tmp_path / "station.db")
    with run_mosquitto() as broker:
        swarm = Swarm(tmp_path, broker.port)
        stations: list[StationProcess] = []
        try:
            station = StationProcess(tmp_path, broker.port, db=db, name="station")
            stations.append(station)
            assert wait_for(
                lambda: (
                    len(station.snapshot()["objects"]) >= 2
                    and all(s == "running" for s in station.states().values())
                    and len(station.states()) == 3
                ),
                timeout=120,
            ), station.log()
            swarm.stop("drone-1")  # clean stops: they say "stopped"
            swarm.stop("drone-2")
            swarm.stop("drone-3", signal.SIGKILL)  # no goodbye: the broker's will says "lost"
            assert wait_for(
                lambda: station.states() == {"drone-1": "stopped", "drone-2": "stopped", "drone-3": "dead"},
                timeout=30,
            ), station.states()
            time.sleep(2.0)  # the store is at most flush_s (0.5 s) behind the page
            before = comparable(station.snapshot())
            assert before["objects"] and any("last will" in e[3] for e in before["events"])

            station.kill()
            # While it is down, a QoS 1 event: the broker keeps it in the station's session (same client id,
            # session expiry) and hands it over when the station comes back.
            missed = wire.event_payload("sensor-9", "note", {"text": "said while the station was down"})
            publish(broker.port, [("edgerun/sensor-9/events", json.dumps(missed).encode(), {})], retain=False)
            again = StationProcess(tmp_path, broker.port, db=db, name="station", port=station.port)
            stations.append(again)
            after = comparable(again.snapshot())
            assert after["nodes"] == before["nodes"]
            assert after["objects"] == before["objects"]
            assert after["events"][: len(before["events"])] == before["events"]
            time.sleep(1.0)  # the broker's retained messages arrive: they change no state and no last seen
            assert comparable(again.snapshot())["nodes"] == before["nodes"]
            assert wait_for(
                lambda: any("said while the station was down" in e["text"] for e in again.snapshot()["events"])
            )

            # A station started after the fact, on an empty store, has only the retained words to go by.
            late = StationProcess(tmp_path, broker.port, db=tmp_path / "late.db", name="late")
            stations.append(late)
            assert wait_for(
                lambda: late.states() == {"drone-1": "stopped", "drone-2": "stopped", "drone-3": "dead"}, timeout=10
            ), late.states()

            # The restarted station's page, in Chromium: the same nodes, states and objects; retire drone-2 there.
            driver.get(again.url + "/")
            assert wait_for(lambda: page_rows(driver) == PAGE_STATES, timeout=30), page_rows(driver)
            shown = driver.execute_script("return document.querySelectorAll('#objects tbody tr[data-id]').length")
            assert shown == len(before["objects"])
            click_retire(driver, "drone-2")
            assert wait_for(lambda: "drone-2" not in page_rows(driver), timeout=10), page_rows(driver)
            assert wait_for(lambda: "drone-2" not in late.states(), timeout=10)  # the retained mark reaches it

            # Retire the dead drone from the command line: both stations take it off, and keep it off.
            retire = subprocess.run(
                [sys.executable, "-m", "edgerun", "fleet", "retire", "drone-3", "--mqtt", f"127.0.0.1:{broker.port}",
                 "--by", "operator:ana", "--reason", "lost in the river"],
                capture_output=True, text=True, timeout=60, env=python_env(),
            )  # fmt: skip
            assert retire.returncode == 0, retire.stderr
            for s in (again, late):
                assert wait_for(lambda s=s: "drone-3" not in s.states(), timeout=10), s.states()
            assert any(e["text"] == "retired by operator:ana: lost in the river" for e in again.snapshot()["events"])
            again.kill()
            third = StationProcess(tmp_path, broker.port, db=db, name="station", port=station.port)
            stations.append(third)
            time.sleep(1.0)
            assert set(third.states()) == {"drone-1", "sensor-9"}
            swarm.start("drone-3")  # it speaks again: it is back
            assert wait_for(lambda: third.states().get("drone-3") == "running", timeout=60), third.states()
            # Its retained mark is cleared (drone-2's stays), so a station started later does not retire it again.
            assert wait_for(lambda: retained_marks(broker.port) == {"drone-2"}, timeout=10)
        finally:
            for s in stations:
                s.kill()
            swarm.close()


# -- two stations, one PostgreSQL ---------------------------------------------------------------


@needs_postgresql
def test_two_stations_on_one_postgresql_show_the_same_objects_and_count_each_once(tmp_path):
    pytest.importorskip("psycopg", reason="psycopg (the postgres extra) is not installed")
    import sqlalchemy as sa

    from edgerun.station.store import engine_for

    with postgres_server() as url, run_mosquitto() as broker:
        with collecting(broker.port, ["edgerun/fleet/objects", "edgerun/+/events"]) as heard:
            stations: list[StationProcess] = []
            swarm = None
            try:
                stations = [StationProcess(tmp_path, broker.port, db=url, name=f"station-{i}") for i in (1, 2)]
                swarm = Swarm(tmp_path, broker.port)
                assert wait_for(lambda: all(len(s.snapshot()["objects"]) >= 2 for s in stations), timeout=120)
                time.sleep(3.0)
                for name in NODES:
                    swarm.stop(name)
                time.sleep(2.0)  # both stations flush (every 0.5 s) what they heard last
                # "received" is each station's own clock; the rest is the report
                objects = [
                    {o["id"]: {k: v for k, v in o.items() if k != "received"} for o in s.snapshot()["objects"]}
                    for s in stations
                ]
                assert objects[0] == objects[1]
                reports = {
                    (doc["id"], doc["last_seen"], doc["owner"])
                    for m in heard.on("edgerun/fleet/objects")
                    for doc in (lambda d: d if isinstance(d, list) else [d])(json.loads(m.payload))
                }
                node_events = {m.payload for m in heard.messages if m.topic.endswith("/events")}
                # One of them killed and started again: it rebuilds the same view from the shared database.
                stations[0].kill()
                restarted = StationProcess(tmp_path, broker.port, db=url, name="station-1b")
                stations.append(restarted)
                again = {
                    o["id"]: {k: v for k, v in o.items() if k != "received"} for o in restarted.snapshot()["objects"]
                }
                assert again == objects[0]
            finally:
                for s in stations:
                    s.kill()
                if swarm is not None:
                    swarm.close()
        engine = engine_for(url)
        with engine.connect() as conn:
            versions = conn.execute(sa.text("SELECT count(*) FROM object_versions")).scalar()
            latest = {r[0] for r in conn.execute(sa.text("SELECT object_id FROM objects"))}
            stored_events = conn.execute(
                sa.text("SELECT count(*) FROM events WHERE kind NOT IN ('status', 'broker', 'station')")
            ).scalar()
        engine.dispose()
        assert len(reports) >= 2 and node_events  # something to count twice, had it been
        assert latest == set(objects[0])
        assert versions == len(reports)
        assert stored_events == len(node_events)


# -- pictures and the page's retire button ------------------------------------------------------


def test_object_pictures_and_retirement_are_served_behind_the_login_and_survive_a_kill(tmp_path):
    import cv2
    import numpy as np

    from edgerun.station.auth import set_password
    from tests.integration.test_station_doors import PASSWORD, StationProc, call, cookie_of, login, own

    users = tmp_path / "users"
    set_password(users, "alice", PASSWORD)
    db = str(tmp_path / "station.db")
    rng = np.random.default_rng(7)
    ok, encoded = cv2.imencode(".jpg", rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    assert ok
    jpeg = encoded.tobytes()
    object_id = "00000000000000f1"
    report = {
        "schema": "edgerun.object/1", "id": object_id, "label": "person", "east_m": 3.0, "north_m": 4.0,
        "first_seen": time.time() - 5, "last_seen": time.time(), "score": 0.9, "owner": "drone-1",
        "seen_by": ["drone-1"],
    }  # fmt: skip
    props = {"node": "drone-1", "score": "0.9", "box": "10,12,40,44", "ts": f"{time.time():.3f}"}
    stations: list[StationProc] = []
    with run_mosquitto() as broker:
        try:
            station = StationProc(tmp_path, broker.port, "--users", str(users), "--db", db)
            stations.append(station)
            publish(
                broker.port,
                [
                    (wire.FLEET_OBJECTS_TOPIC, json.dumps(report).encode(), {}),
                    (wire.object_image_topic(object_id), jpeg, props),
                    (wire.object_image_topic("00000000000000f2"), b"\x89PNG\r\n\x1a\n" + jpeg, props),  # not a JPEG
                    ("edgerun/drone-9/status", b"lost", {}),  # a node that died long ago
                ],
            )
            cookie = cookie_of(login(station))

            def snapshot(s: StationProc) -> dict[str, Any]:
                return call(s.port, "GET", "/api/snapshot", {"Cookie": cookie}).json()

            assert wait_for(lambda: "image_url" in {k for o in snapshot(station)["objects"] for k in o}, timeout=20)
            url = snapshot(station)["objects"][0]["image_url"]
            assert url == f"/api/objects/{object_id}/image"
            assert call(station.port, "GET", url).status == 401  # the same door as the rest of the API
            picture = call(station.port, "GET", url, {"Cookie": cookie})
            assert (picture.status, picture.headers["Content-Type"], picture.body) == (200, "image/jpeg", jpeg)
            assert call(station.port, "GET", "/api/objects/00000000000000f2/image", {"Cookie": cookie}).status == 404
            assert snapshot(station)["dropped"]["bad_image"] == 1

            assert wait_for(lambda: snapshot(station)["nodes"].get("drone-9", {}).get("state") == "dead")
            csrf = call(station.port, "GET", "/api/session", {"Cookie": cookie}).json()["csrf"]
            headers = {**own(station), "Cookie": cookie, "X-CSRF-Token": csrf}
            assert call(station.port, "POST", "/api/nodes/drone-9/retire", headers).status == 400  # not confirmed
            retired = call(
                station.port, "POST", "/api/nodes/drone-9/retire", {**headers, "X-Edgerun-Confirm": "drone-9"}
            )
            assert retired.status == 200, retired.body
            assert "drone-9" not in snapshot(station)["nodes"]
            assert any(e["text"] == "retired by operator:alice" for e in snapshot(station)["events"])
            time.sleep(1.5)  # one flush of the store

            station.proc.send_signal(signal.SIGKILL)
            station.proc.wait(10)
            again = StationProc(tmp_path, broker.port, "--users", str(users), "--db", db, name="again")
            stations.append(again)
            cookie = cookie_of(login(again))
            time.sleep(1.0)  # the retained status of drone-9 and the retire mark arrive again
            snap = snapshot(again)
            assert "drone-9" not in snap["nodes"]
            assert [o.get("image_url") for o in snap["objects"]] == [url]
            assert call(again.port, "GET", url, {"Cookie": cookie}).body == jpeg
        finally:
            for s in stations:
                s.stop()


@needs_postgresql
def test_a_postgresql_store_of_the_first_version_is_migrated_and_keeps_its_mission():
    pytest.importorskip("psycopg", reason="psycopg (the postgres extra) is not installed")
    import sqlalchemy as sa

    from edgerun.station.store import Batch, StationStore, engine_for, migrate

    with postgres_server() as url:
        engine = engine_for(url)
        migrate(engine, target=1)
        with engine.begin() as conn:  # a row as the first version wrote it
            conn.execute(
                sa.text(
                    "INSERT INTO events (key, ts, node, kind, text, level) "
                    "VALUES ('k', :ts, 'd1', 'status', 'online', 'info')"
                ),
                {"ts": time.time()},  # recent: older than --db-max-age-days would go at open
            )
            assert "object_images" not in sa.inspect(conn).get_table_names()
        engine.dispose()
        store = StationStore(url)
        try:
            assert store.open() == 1
            assert {"object_images", "actions", "alert_posts"} <= set(sa.inspect(store.engine).get_table_names())
            assert [e["text"] for e in store.load().events] == ["online"]
            jpeg = b"\xff\xd8\xff" + b"\0" * 100
            image = {
                "object_id": "00000000000000a1",
                "jpeg": jpeg,
                "node": "d1",
                "score": 0.5,
                "box": "",
                "ts": time.time(),
            }
            store.write(Batch(images=[image]))
            assert store.image("00000000000000a1") == jpeg
        finally:
            store.close()

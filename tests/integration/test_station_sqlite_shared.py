"""Two stations on one SQLite file (a tent whose two laptops share a disk, or an operator who starts a second
station by mistake): real mosquitto, two station processes started at the same moment on an empty file, a real
webhook receiver.

SQLite in WAL mode lets both write (one writer at a time, each waiting its turn through the busy timeout), and
the store's natural keys make every row one row whoever writes it first: both stations show every find and
event, the file holds each report and each event once, and the webhook gets each alert once.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from edgerun import wire
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.integration.brokers import wait_for
from tests.integration.station_rig import HookReceiver, StationProcess, publish_until
from tests.integration.test_station_webhook import finds

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


@pytest.mark.timeout(240)
def test_two_stations_on_one_sqlite_file_both_write_and_count_each_row_once(tmp_path):
    db = tmp_path / "shared.db"
    receiver = HookReceiver()
    stations: list[StationProcess] = []
    with run_mosquitto() as broker:
        try:
            # Both start at once on a file that does not exist yet: one creates the schema, the other waits for it.
            started: dict[int, StationProcess] = {}
            errors: list[BaseException] = []

            def start(i: int) -> None:
                try:
                    started[i] = StationProcess(
                        tmp_path, broker.port, "--alert-webhook", receiver.url, "--alert-image-wait-s", "0",
                        db=db, name=f"station-{i}",
                    )  # fmt: skip
                except BaseException as err:  # the test's thread: the failure is raised below
                    errors.append(err)

            threads = [threading.Thread(target=start, args=(i,)) for i in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            stations = list(started.values())
            assert not errors and len(stations) == 2, errors

            ids = list(range(1, 21))
            notes = [wire.event_payload("drone-1", "note", {"text": f"note {k}"}) for k in range(5)]
            events = [("edgerun/drone-1/events", json.dumps(n).encode(), {}) for n in notes]
            expected = {f"{i:016x}" for i in ids}
            for s in stations:
                s.wait_connected()

            def shows_all(s: StationProcess) -> bool:
                snap = s.snapshot()
                notes = {e["text"] for e in snap["events"] if e["node"] == "drone-1" and e["kind"] == "note"}
                return {o["id"] for o in snap["objects"]} == expected and len(notes) == 5

            shown = lambda: all(shows_all(s) for s in stations)  # noqa: E731
            assert publish_until(broker.port, finds(ids, set()) + events, shown), [s.log() for s in stations]
            assert wait_for(lambda: {b["object"] for b in receiver.delivered()} == expected, 30, 0.25)
            time.sleep(2.0)  # both flush (every 0.5 s); nothing more is posted
            assert sorted(b["object"] for b in receiver.delivered()) == sorted(expected)
            for s in stations:
                dropped = s.snapshot()["dropped"]
                assert "store_batches" not in dropped, dropped  # neither lost a batch to the other's lock
        finally:
            for s in stations:
                s.stop()
            receiver.close()
    with sqlite3.connect(db) as conn:
        versions = conn.execute("SELECT object_id, COUNT(*) FROM object_versions GROUP BY object_id").fetchall()
        stored = conn.execute("SELECT text, COUNT(*) FROM events WHERE node = 'drone-1' AND kind = 'note' GROUP BY 1")
        stored_notes = stored.fetchall()
        posts = conn.execute("SELECT state, COUNT(*) FROM alert_posts GROUP BY state").fetchall()
    assert sorted(versions) == sorted((oid, 1) for oid in expected)  # each report once, whoever wrote it
    assert sorted(stored_notes) == [(f"note text=note {k}", 1) for k in range(5)]  # the station's line for a note
    assert posts == [("sent", len(ids))]

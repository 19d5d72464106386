"""The alert webhook end to end: real mosquitto, the station as a process, a real HTTP receiver on loopback.

* Two stations on one real PostgreSQL 15 and one broker (a tent and a command post, both with the same
  ``--alert-webhook``) each learn of every find, and the receiver gets each alert once. A find whose picture
  came with it is posted with its ``image_url``; one with no picture goes after ``--alert-image-wait-s`` without
  it, and says so.
* A station on SQLite whose receiver is down is stopped with its posts pending; started again on the same store
  (and the receiver back), it posts each of them once.

The finds are published by a paho client standing in for the drones (what is tested is the station's side).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from edgerun import wire
from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from tests.integration.brokers import wait_for
from tests.integration.station_rig import (
    HookReceiver,
    StationProcess,
    needs_postgresql,
    postgres_server,
    publish_until,
)

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def find(i: int, now: float) -> bytes:
    return json.dumps(
        {
            "schema": "edgerun.object/2",
            "id": f"{i:016x}",
            "label": "person",
            "lat": 53.117 + i * 1e-5,
            "lon": -4.13,
            "first_seen": now - 2,
            "last_seen": now,
            "score": 0.9,
            "owner": "drone-1",
            "seen_by": ["drone-1"],
        }
    ).encode()


def picture() -> bytes:
    import cv2
    import numpy as np

    ok, jpeg = cv2.imencode(".jpg", np.full((48, 64, 3), 120, np.uint8))
    assert ok
    return jpeg.tobytes()


def finds(ids: list[int], with_picture: set[int]) -> list[tuple[str, bytes, dict[str, str]]]:
    now = time.time()
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for i in ids:
        oid = f"{i:016x}"
        if i in with_picture:  # the picture first: the station has it when the find's alert is raised
            props = {"node": "drone-1", "score": "0.9", "box": "1,2,30,40", "ts": repr(now)}
            out.append((wire.object_image_topic(oid), picture(), props))
        out.append(("edgerun/fleet/objects", find(i, now), {}))
    return out


def alerts_of(station: StationProcess) -> set[str]:
    return {a["id"] for a in station.snapshot()["alerts"]}


@needs_postgresql
@pytest.mark.timeout(240)
def test_two_stations_on_one_postgresql_post_each_alert_once_with_its_picture_or_saying_why_not(tmp_path):
    pytest.importorskip("psycopg", reason="psycopg (the postgres extra) is not installed")
    import sqlalchemy as sa

    from edgerun.station.store import engine_for

    receiver = HookReceiver(fail_first=2)  # the first two posts fail: retried, by whichever station claims them
    ids, pictured = list(range(1, 9)), {1, 2, 3, 4}
    stations: list[StationProcess] = []
    with postgres_server() as url, run_mosquitto() as broker:
        try:
            hook = ("--alert-webhook", receiver.url, "--alert-image-wait-s", "1")
            stations = [StationProcess(tmp_path, broker.port, *hook, db=url, name=f"station-{i}") for i in (1, 2)]
            for s in stations:
                s.wait_connected()
            expected = {f"{i:016x}" for i in ids}
            shown = lambda: all(alerts_of(s) == expected for s in stations)  # noqa: E731
            assert publish_until(broker.port, finds(ids, pictured), shown), [s.log() for s in stations]
            assert wait_for(lambda: {b["object"] for b in receiver.delivered()} == expected, 60, 0.25), (
                receiver.posts,
                [s.snapshot()["webhook"] for s in stations],
            )
            time.sleep(3.0)  # longer than a retry's backoff and the picture wait: nothing more comes
            delivered = receiver.delivered()
            assert sorted(b["object"] for b in delivered) == sorted(expected)  # each alert once
            for body in delivered:
                i = int(body["object"], 16)
                if i in pictured:
                    assert body["image_status"] == "attached"
                    assert body["image_url"].endswith(f"/api/objects/{body['object']}/image")
                else:
                    assert (body["image_url"], body["image_status"]) == (None, "no picture within 1 s")
            stats = [s.snapshot()["webhook"] for s in stations]
            assert sum(s["sent"] for s in stats) == len(ids) and sum(s["failed"] for s in stats) == 2, stats
            assert sum(s["known"] for s in stats) == len(ids), stats  # the second station found each row there
        finally:
            for s in stations:
                s.stop()
            receiver.close()
        engine = engine_for(url)
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT object_id, state, attempts FROM alert_posts")).all()
        engine.dispose()
    assert sorted(r[0] for r in rows) == sorted(expected) and {r[1] for r in rows} == {"sent"}
    assert sum(r[2] for r in rows) == len(ids) + 2  # two failed attempts, then one that went, each


@pytest.mark.timeout(180)
def test_posts_pending_when_the_station_stops_go_out_once_after_its_restart(tmp_path):
    receiver = HookReceiver(fail_first=10**6)  # down: 503 to everything
    db = tmp_path / "station.db"
    station: StationProcess | None = None
    with run_mosquitto() as broker:
        try:
            hook: tuple[str, ...] = ("--alert-webhook", receiver.url, "--alert-image-wait-s", "0")
            station = StationProcess(tmp_path, broker.port, *hook, db=db)
            station.wait_connected()
            first = station
            assert publish_until(broker.port, finds([1, 2], set()), lambda: len(first.snapshot()["alerts"]) == 2)

            def both_pending(s: StationProcess) -> dict[str, Any] | None:
                stats = s.snapshot()["webhook"]
                return stats if stats["failed"] >= 1 and stats["queued"] == 2 else None

            assert wait_for(lambda: both_pending(station) is not None, 30, 0.25), station.snapshot()["webhook"]
            station.stop()
            assert receiver.delivered() == []
            receiver.fail_first = len(receiver.posts)  # the receiver is back
            station = StationProcess(tmp_path, broker.port, *hook, db=db, port=station.port)
            assert wait_for(lambda: len(receiver.delivered()) == 2, 60, 0.25), station.snapshot()["webhook"]
            time.sleep(2.0)
            assert sorted(b["object"] for b in receiver.delivered()) == [f"{1:016x}", f"{2:016x}"]
            assert station.snapshot()["webhook"]["sent"] == 2
        finally:
            if station is not None:
                station.stop()
            receiver.close()

"""The station's store on a real SQLite file: what a restarted station gets back, migrations, retention,
stations that share a store, object pictures, retired nodes and the status words of a clean stop and a lost link."""

from __future__ import annotations

import json
import sqlite3

import msgspec
import pytest
import sqlalchemy as sa

from edgerun import wire
from edgerun.errors import ConfigError
from edgerun.station.model import FleetModel
from edgerun.station.station import rollout_progress
from edgerun.station.store import SCHEMA_VERSION, Batch, StationStore, engine_for, migrate

T0 = 1_800_000_000.0
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4 + b"\xff\xd9"
OBJECT_ID = "00000000000000a1"


def fleet_object(object_id: str = OBJECT_ID, last_seen: float = T0, owner: str = "d1", east: float = 3.0) -> bytes:
    return json.dumps(
        {
            "schema": "edgerun.object/1",
            "id": object_id,
            "label": "person",
            "east_m": east,
            "north_m": 4.0,
            "first_seen": T0 - 10,
            "last_seen": last_seen,
            "score": 0.8,
            "owner": owner,
            "seen_by": [owner],
        }
    ).encode()


def node_event(node: str, ts: float, state: str = "degraded") -> bytes:
    return json.dumps(wire.event_payload(node, "health", {"state": state, "reasons": {"engine": "slow"}}, ts)).encode()


def metrics(node: str, ts: float) -> bytes:
    summary = {"model": "blazeface", "model_version": 3, "engine": "tflite", "state": "running", "fps": 9.5}
    return json.dumps({"schema": wire.METRICS_SCHEMA, "node": node, "ts": ts, "summary": summary}).encode()


@pytest.fixture
def store(tmp_path):
    s = StationStore(str(tmp_path / "station.db"), clock=lambda: T0 + 100)
    s.open()
    yield s
    s.close()


def station_model(origin: str = "station-a") -> FleetModel:
    return FleetModel(journal=True, origin=origin, stale_s=15.0)


def persist(model: FleetModel, store: StationStore) -> None:
    model.take_delta(T0 + 100)
    batch = model.take_journal()
    if batch is not None:
        store.write(batch)


def test_a_restarted_model_shows_the_same_objects_nodes_and_events(store):
    """What one station saw is what the next start of it shows: objects (latest version), node states as they
    were (a clean stop grey, a lost link DEAD, last seen as stored) and the events, oldest first."""
    m = station_model()
    m.ingest("edgerun/fleet/objects", fleet_object(east=1.0), T0)
    m.ingest("edgerun/fleet/objects", fleet_object(last_seen=T0 + 5, east=2.0), T0 + 5)
    m.ingest("edgerun/fleet/objects", fleet_object("00000000000000b2"), T0 + 6)
    for node in ("d1", "d2", "d3"):
        m.ingest(f"edgerun/{node}/status", b"online", T0)
        m.ingest(f"edgerun/{node}/metrics", metrics(node, T0), T0 + 1)
    m.ingest("edgerun/d1/events", node_event("d1", T0 + 2), T0 + 2)
    m.ingest("edgerun/d2/status", b"stopped", T0 + 3)
    m.ingest("edgerun/d3/status", b"lost", T0 + 4)
    persist(m, store)

    again = station_model("station-a2")
    again.restore(store.load())
    snap, before = again.snapshot(T0 + 8), m.snapshot(T0 + 8)
    assert {o["id"]: o["east_m"] for o in snap["objects"]} == {OBJECT_ID: 2.0, "00000000000000b2": 3.0}
    assert {k: n["state"] for k, n in snap["nodes"].items()} == {"d1": "degraded", "d2": "stopped", "d3": "dead"}
    seen = {k: n["last_seen"] for k, n in snap["nodes"].items()}
    assert seen == {k: n["last_seen"] for k, n in before["nodes"].items()}
    assert snap["nodes"]["d1"]["model_version"] == 3 and snap["nodes"]["d1"]["engine"] == "tflite"
    assert [(e["node"], e["text"]) for e in snap["events"]] == [(e["node"], e["text"]) for e in before["events"]]
    assert ("d3", "offline (last will: connection lost)") in [(e["node"], e["text"]) for e in snap["events"]]
    assert [v["east_m"] for v in store.object_versions(OBJECT_ID)] == [1.0, 2.0]  # every version, in order


def test_retained_messages_after_a_restart_add_no_version_and_no_event(store):
    """The broker hands a restarted station its retained objects and statuses again: nothing is counted twice."""
    m = station_model()
    m.ingest("edgerun/fleet/objects/" + OBJECT_ID, fleet_object(), T0)
    m.ingest("edgerun/d2/status", b"stopped", T0)
    persist(m, store)
    counts = store.counts()
    again = station_model("station-a2")
    again.restore(store.load())
    again.ingest("edgerun/fleet/objects/" + OBJECT_ID, fleet_object(), T0 + 50, retained=True)
    again.ingest("edgerun/d2/status", b"stopped", T0 + 50, retained=True)
    persist(again, store)
    assert store.counts() == counts
    assert counts["object_versions"] == 1 and counts["events"] == 1


def test_two_stations_on_one_store_count_each_report_once(store):
    """Two stations hear the same reports and node events and write both into one store: one row each."""
    a, b = station_model("station-a"), station_model("station-b")
    for m, skew in ((a, 0.0), (b, 0.4)):  # the second hears everything 0.4 s later
        m.ingest("edgerun/fleet/objects", fleet_object(), T0 + skew)
        m.ingest("edgerun/fleet/objects", fleet_object(last_seen=T0 + 5), T0 + 5 + skew)
        m.ingest("edgerun/d1/events", node_event("d1", T0 + 1), T0 + 1 + skew)
        m.ingest("edgerun/d1/events", node_event("d1", T0 + 2, "running"), T0 + 2 + skew)
        persist(m, store)
    counts = store.counts()
    assert (counts["objects"], counts["object_versions"]) == (1, 2)
    assert counts["events"] == 2


def test_an_empty_database_is_created_at_the_current_version(tmp_path):
    engine = engine_for(str(tmp_path / "new.db"))
    assert migrate(engine) == 0
    with engine.connect() as conn:
        versions = [v for (v,) in conn.exec_driver_sql("SELECT version FROM schema_version ORDER BY version")]
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
    assert versions == list(range(1, SCHEMA_VERSION + 1)) and mode == "wal"
    assert set(sa.inspect(engine).get_table_names()) >= {"objects", "object_versions", "object_images", "actions"}
    assert migrate(engine) == SCHEMA_VERSION  # opening again changes nothing
    engine.dispose()


def test_a_database_of_the_first_version_is_migrated_through_every_step_and_keeps_its_mission(tmp_path):
    """A store written by schema version 1 (no pictures, no operator actions, no webhook outbox) opens, keeps what
    it held, and takes pictures and webhook posts afterwards."""
    path = tmp_path / "old.db"
    engine = engine_for(str(path))
    migrate(engine, target=1)
    engine.dispose()
    with sqlite3.connect(path) as conn:  # rows as the previous version wrote them
        doc = json.dumps({"id": OBJECT_ID, "label": "person", "east_m": 1.0, "north_m": 2.0, "last_seen": T0})
        conn.execute("INSERT INTO objects VALUES (?, ?, ?, ?)", (OBJECT_ID, T0, T0, doc))
        conn.execute(
            "INSERT INTO events (key, ts, node, kind, text, level) VALUES ('k1', ?, 'd1', 'status', 'online', 'info')",
            (T0,),
        )
        assert "object_images" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    store = StationStore(str(path), clock=lambda: T0 + 100)
    try:
        assert store.open() == 1
        assert {"object_images", "actions", "alert_posts"} <= set(sa.inspect(store.engine).get_table_names())
        restored = store.load()
        assert [o["id"] for o in restored.objects] == [OBJECT_ID] and restored.events[0]["text"] == "online"
        image = {"object_id": OBJECT_ID, "jpeg": JPEG, "node": "d1", "score": 0.9, "box": "", "ts": T0}
        store.write(Batch(images=[image]))
        assert store.image(OBJECT_ID) == JPEG
    finally:
        store.close()


def test_a_database_newer_than_this_code_is_refused_with_one_line(tmp_path):
    path = tmp_path / "future.db"
    engine = engine_for(str(path))
    migrate(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION + 1}, 0)")
    engine.dispose()
    with pytest.raises(ConfigError, match=f"schema version {SCHEMA_VERSION + 1}, this edgerun knows up to"):
        StationStore(str(path)).open()


def test_not_a_path_nor_a_postgresql_url_is_refused():
    with pytest.raises(ConfigError, match="expected a SQLite file path or a postgresql:// URL"):
        StationStore("mysql://somewhere/db")


def test_retention_by_age_deletes_what_is_older_and_keeps_the_rest(tmp_path):
    day = 86400.0
    store = StationStore(str(tmp_path / "s.db"), max_age_s=2 * day, clock=lambda: T0)
    store.open()
    try:
        events = [
            {"key": f"e{i}", "ts": T0 - age * day, "node": "d1", "kind": "k", "text": f"{age} days", "level": "info"}
            for i, age in enumerate((0, 1, 3, 5))
        ]
        old = json.loads(fleet_object("00000000000000c3", last_seen=T0 - 3 * day))
        old["received"] = T0 - 3 * day
        new = json.loads(fleet_object())
        new["received"] = T0
        store.write(Batch(events=events, object_versions=[old, new]))
        deleted = store.enforce_retention(T0)
        assert deleted == {"events": 2, "object_versions": 1, "objects": 1}
        restored = store.load()
        assert [e["text"] for e in restored.events] == ["1 days", "0 days"]
        assert [o["id"] for o in restored.objects] == [OBJECT_ID]
    finally:
        store.close()


def test_retention_by_size_keeps_the_newest_history_under_the_bound(tmp_path):
    bound = 200_000
    store = StationStore(str(tmp_path / "s.db"), max_bytes=bound, clock=lambda: T0)
    store.open()
    try:
        text = "x" * 400
        events = [
            {"key": f"e{i}", "ts": T0 + i, "node": "d1", "kind": "k", "text": f"{i} {text}", "level": "info"}
            for i in range(2000)
        ]
        store.write(Batch(events=events))
        assert store.stored_bytes() > 4 * bound
        deleted = store.enforce_retention(T0 + 2000)
        assert store.stored_bytes() <= bound
        kept = store.load(max_events=100_000).events
        assert deleted["events"] + len(kept) == 2000
        assert kept[-1]["text"].startswith("1999 ") and int(kept[0]["text"].split()[0]) == 2000 - len(kept)
    finally:
        store.close()


def test_retention_settings_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="must be positive"):
        StationStore(str(tmp_path / "s.db"), max_bytes=0)


def test_writes_go_through_the_writer_thread_and_flush_waits_for_them(store):
    m = station_model()
    m.ingest("edgerun/fleet/objects", fleet_object(), T0)
    batch = m.take_journal()
    assert batch is not None
    store.submit(batch)
    assert store.flush()
    assert store.counts()["object_versions"] == 1 and store.dropped_batches == 0


# -- pictures -------------------------------------------------------------------------------------


def image_props(**over: str) -> dict[str, str]:
    return {"node": "d1", "score": "0.87", "box": "10,20,110,220", "ts": str(T0), **over}


def test_an_object_picture_is_kept_and_named_in_the_object(store):
    m = station_model()
    m.ingest("edgerun/fleet/objects", fleet_object(), T0)
    m.ingest(wire.object_image_topic(OBJECT_ID), JPEG, T0, props=image_props())
    newer = JPEG + b"newer"
    m.ingest(wire.object_image_topic(OBJECT_ID), newer, T0, props=image_props(ts=str(T0 + 5)))
    m.ingest(wire.object_image_topic(OBJECT_ID), JPEG, T0, props=image_props(ts=str(T0 + 1)))  # older: ignored
    persist(m, store)
    assert m.objects[OBJECT_ID]["image_url"] == f"/api/objects/{OBJECT_ID}/image"
    assert store.image(OBJECT_ID) == newer
    again = station_model("station-a2")
    again.restore(store.load())
    assert again.snapshot(T0)["objects"][0]["image_url"] == f"/api/objects/{OBJECT_ID}/image"


@pytest.mark.parametrize(
    ("object_id", "payload", "props"),
    [
        (OBJECT_ID, b"GIF89a" + JPEG, image_props()),  # not a JPEG
        (OBJECT_ID, JPEG + b"\0" * wire.MAX_OBJECT_IMAGE, image_props()),  # over 64 KiB
        ("not an id!", JPEG, image_props()),
        (OBJECT_ID, JPEG, image_props(node="a/b")),
        (OBJECT_ID, JPEG, image_props(ts="soon")),
        (OBJECT_ID, JPEG, image_props(box="1,2,3")),
        (OBJECT_ID, JPEG, image_props(score="7")),
        (OBJECT_ID, JPEG, {k: v for k, v in image_props().items() if k != "ts"}),
    ],
)
def test_a_bad_picture_is_dropped_and_counted(object_id, payload, props):
    m = station_model()
    m.ingest(f"edgerun/fleet/objects/{object_id}/image", payload, T0, props=props)
    assert m.dropped["bad_image"] == 1 and not m.images
    assert m.take_journal() is None


# -- a clean stop and a lost link -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "state"), [(b"stopped", "stopped"), (b"lost", "dead"), (b"offline", "dead"), (b"online", "stale")]
)
def test_a_station_started_after_the_fact_names_the_retained_status(payload, state):
    """A station that starts after the node went away has only the retained status to go by (a retained
    "online" of unknown age is stale until the node speaks)."""
    m = FleetModel()
    m.ingest("edgerun/d1/status", payload, T0, retained=True)
    assert m.snapshot(T0)["nodes"]["d1"]["state"] == state


def test_status_words_decode_and_old_nodes_still_do():
    assert [wire.decode_status(w) for w in (b"online", b"stopped\n", b"lost", b"offline")] == [
        "online",
        "stopped",
        "lost",
        "offline",
    ]
    assert wire.decode_status(b"gone") is None and wire.decode_status(b"stopped" * 10) is None


# -- retiring a node ------------------------------------------------------------------------------


def retire_mark(node: str, ts: float) -> bytes:
    return msgspec.json.encode(wire.RetireNode(node=node, ts=ts, by="operator:ana", reason="crashed in a tree"))


def test_a_retired_node_leaves_the_view_and_comes_back_only_when_it_speaks(store):
    m = station_model()
    m.ingest("edgerun/d1/status", b"lost", T0)
    m.take_delta(T0)
    m.ingest(wire.retired_topic("d1"), retire_mark("d1", T0 + 1), T0 + 1)
    assert "d1" not in m.nodes and m.take_delta(T0 + 1)["removed_nodes"] == ["d1"]
    m.ingest("edgerun/d1/status", b"lost", T0 + 2, retained=True)  # the broker's memory, not the node
    assert "d1" not in m.nodes
    persist(m, store)
    actions = store.load().retired
    assert actions["d1"]["by"] == "operator:ana"

    again = station_model("station-a2")  # a restart: still retired, and the retained status does not undo it
    again.restore(store.load())
    again.ingest("edgerun/d1/status", b"lost", T0 + 50, retained=True)
    again.ingest(wire.retired_topic("d1"), retire_mark("d1", T0 + 1), T0 + 50, retained=True)
    assert "d1" not in again.nodes and again.retired["d1"]["by"] == "operator:ana"
    again.ingest("edgerun/d1/status", b"online", T0 + 60)  # it speaks again
    assert again.snapshot(T0 + 60)["nodes"]["d1"]["state"] == "online" and "d1" not in again.retired
    persist(again, store)
    assert "d1" not in store.load().retired
    assert store.counts()["actions"] == 1  # the mark heard again after the restart is the same action


def test_a_retire_mark_older_than_the_nodes_last_word_is_ignored():
    m = FleetModel()
    m.ingest("edgerun/d1/status", b"online", T0 + 10)
    m.ingest(wire.retired_topic("d1"), retire_mark("d1", T0), T0 + 11, retained=True)
    assert "d1" in m.nodes and not m.retired


def test_a_retire_mark_for_another_node_is_dropped():
    m = FleetModel()
    m.ingest(wire.retired_topic("d1"), retire_mark("d2", T0), T0)
    assert m.dropped["node_mismatch"] == 1


# -- rollouts nobody took -------------------------------------------------------------------------


def test_a_rollout_nobody_took_never_reads_complete():
    assert rollout_progress("m", "complete", 100, 0, 0, {}) == "no node runs m: nobody has taken this release"
    assert rollout_progress("m", "canary", 10, 0, 3, {"a": False, "b": False, "c": False}) == (
        "no node in the canary: none of the 3 nodes running m falls in its 10%"
    )
    assert rollout_progress("m", "complete", 100, 1, 3, {}) == "released to all, 1 of 3 nodes on it so far"
    assert rollout_progress("m", "complete", 100, 3, 3, {}) == "3 of 3 nodes on it"


def test_retained_messages_do_not_make_a_long_gone_node_look_recent(store):
    """The broker's retained status and swarm view reach a restarted station at once: "last seen" stays what
    the store says, not "0 s ago"."""
    m = station_model()
    m.ingest("edgerun/d1/metrics", metrics("d1", T0), T0)
    m.ingest("edgerun/d1/status", b"stopped", T0 + 1)
    persist(m, store)
    again = station_model("station-a2")
    again.restore(store.load())
    swarm = {"schema": wire.SWARM_SCHEMA, "node": "d1", "ts": T0, "members": [{"name": "d1", "state": "alive"}]}
    again.ingest("edgerun/d1/swarm", json.dumps(swarm).encode(), T0 + 600, retained=True)
    again.ingest("edgerun/d1/status", b"stopped", T0 + 600, retained=True)
    node = again.snapshot(T0 + 600)["nodes"]["d1"]
    assert (node["last_seen"], node["state"]) == (T0, "stopped")
    again.ingest("edgerun/d1/swarm", json.dumps(swarm).encode(), T0 + 601)  # live: it is back
    assert again.snapshot(T0 + 601)["nodes"]["d1"]["last_seen"] == T0 + 601


def test_a_nul_character_from_the_wire_does_not_fail_the_batch(store):
    """PostgreSQL text refuses NUL; SQLite would take it, so the store cleans it for both alike."""
    m = station_model()
    event = wire.event_payload("d1", "note", {"text": "bad\x00byte"}, T0)
    m.ingest("edgerun/d1/events", json.dumps(event).encode(), T0)
    persist(m, store)
    assert [e["text"] for e in store.load().events] == ["note text=bad\ufffdbyte"]


def test_a_database_that_cannot_be_reached_is_one_line_without_the_password():
    pytest.importorskip("psycopg", reason="psycopg (the postgres extra) is not installed")
    store = StationStore("postgresql://station:secret@127.0.0.1:1/mission")  # port 1: nothing listens
    with pytest.raises(ConfigError) as err:
        store.open()
    text = str(err.value)
    assert text.startswith("--db postgresql://station:***@127.0.0.1:1/mission: cannot open the database (")
    assert "secret" not in text and "\n" not in text and "refused" in text


def test_a_late_older_report_is_kept_as_a_version_but_not_shown(store):
    """Two owners' reports of one object can arrive out of order: the page (and a restart of it) shows the
    newest, the store keeps both."""
    m = station_model()
    m.ingest("edgerun/fleet/objects", fleet_object(last_seen=T0 + 5, owner="d2", east=5.0), T0)
    m.ingest("edgerun/fleet/objects", fleet_object(last_seen=T0 + 4, owner="d1", east=4.0), T0 + 1)
    persist(m, store)
    assert m.objects[OBJECT_ID]["east_m"] == 5.0
    assert [o["east_m"] for o in store.load().objects] == [5.0]
    assert [v["owner"] for v in store.object_versions(OBJECT_ID)] == ["d1", "d2"]


def test_a_station_keeps_its_mqtt_client_id_across_restarts_and_two_stations_differ(tmp_path):
    """The broker resumes a session by client id: the same station (store, page address) gets the same id."""
    from edgerun.station.station import StationOptions, station_client_id

    one = StationOptions(db=str(tmp_path / "a.db"), bind_port=8080)
    assert station_client_id(one) == station_client_id(StationOptions(db=str(tmp_path / "a.db"), bind_port=8080))
    assert station_client_id(one) != station_client_id(StationOptions(db=str(tmp_path / "a.db"), bind_port=8081))
    assert station_client_id(one) != station_client_id(StationOptions(db=str(tmp_path / "b.db"), bind_port=8080))


def test_the_default_store_is_under_the_state_directory(monkeypatch, tmp_path):
    from edgerun.station.store import default_db_path

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "edgerun" / "station.db"
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path / 'svc'}:{tmp_path / 'other'}")  # systemd's StateDirectory=
    assert default_db_path() == tmp_path / "svc" / "station.db"

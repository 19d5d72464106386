"""Alerts end to end: real mosquitto, the demo's three real drones (their dedup reports fleet objects, with
pictures), the station as a process with operator logins, a SQLite store and a webhook, and two headless Chromium
pages logged in as two operators.

* A new fleet object raises the alert on both pages (its label and owner; the picture once the owner sent it).
* Acknowledging it on one page clears it on both, and both show who acknowledged it; a second station on the
  same broker (its own store) shows it acknowledged by the same operator at the same time (the retained mark).
* The station is stopped and started again on the same store: the object is still acknowledged, by the same
  operator, on the page and in the snapshot; one nobody acknowledged is still alerting.
* The webhook receiver (a real HTTP server on loopback that fails its first requests) gets the POST for the
  object after the failures, retried, and the station counts the failed attempts and the sent alerts.
* Two stations on one real PostgreSQL 15: an ack on one shows on the other, is stored once, and is still there
  after the other is SIGKILLed and started again.
* The ack route's doors: login, CSRF token, confirmation header, unknown alert, read-only page.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from edgerun.sinks.mosquitto import find_mosquitto, run_mosquitto
from edgerun.station.auth import set_password
from edgerun.testing.ports import free_port
from tests.integration.brokers import wait_for
from tests.integration.station_rig import (
    HookReceiver,
    StationProcess,
    chromium,
    log_in,
    needs_chromium,
    needs_postgresql,
    post_ack,
    postgres_server,
)
from tests.integration.test_station_doors import users_file  # noqa: F401 (fixture)
from tests.integration.test_station_mission import Swarm

OPERATORS = {"ana": "correct horse battery", "bo": "staple battery horse"}
FAIL_FIRST = 2
ALERTING = ("--alert-labels", "face")  # the demo finds faces

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
ALERTS_JS = """return {
  open: [...document.querySelectorAll('#alert-list .alert')].map(a => ({id: a.dataset.object,
    text: a.innerText, image: (a.querySelector('img.alert-image') || {}).src || null,
    loaded: !!(a.querySelector('img.alert-image') || {}).naturalWidth})),
  acked: [...document.querySelectorAll('#alert-acked li')].map(li => ({id: li.dataset.object, by: li.dataset.by,
    text: li.textContent.replace(/\\s+/g, ' ')})),
  alerting: !!document.querySelector('#alerts.alerting'),
  focus: [...document.querySelectorAll('#alerts .alert-focus')].map(e => e.dataset.object),
  table: Object.fromEntries([...document.querySelectorAll('#objects tbody tr[data-id]')].map(r =>
    [r.dataset.id, r.querySelector('.alert-state').textContent.trim()])),
  sound: (document.getElementById('alert-sound-state') || {}).textContent || null,
};"""


def alerts_on(driver: Any) -> dict[str, Any]:
    return driver.execute_script(ALERTS_JS)


@needs_chromium
@pytest.mark.timeout(420)
def test_a_find_alerts_two_pages_until_one_operator_acknowledges_it_and_stays_acknowledged(tmp_path):
    users = tmp_path / "station-users"
    for user, password in OPERATORS.items():
        set_password(users, user, password)
    db = tmp_path / "station.db"
    receiver = HookReceiver(FAIL_FIRST)
    drivers: list[Any] = []
    station: StationProcess | None = None
    other: StationProcess | None = None
    with run_mosquitto() as broker:
        swarm = Swarm(tmp_path, broker.port)
        try:
            port = free_port()
            doors = ("--users", str(users), "--public-view", "--alert-webhook", receiver.url)
            station = StationProcess(tmp_path, broker.port, *ALERTING, *doors, db=db, port=port)
            # a second station on the same broker with its own store (a command post): no page, no webhook
            other = StationProcess(tmp_path, broker.port, *ALERTING, db=tmp_path / "other.db", name="other")
            drivers = [chromium(), chromium()]
            for driver, user in zip(drivers, OPERATORS):
                log_in(driver, station.url, user, OPERATORS[user])
            for driver in drivers:  # sound needs a user gesture: the page asks once and says whether it is on
                assert alerts_on(driver)["sound"] == "sound is off"

            # -- a find alerts both pages -----------------------------------------------------------------
            def first_alert() -> str | None:
                shown = [{a["id"] for a in alerts_on(d)["open"]} for d in drivers]
                common = shown[0] & shown[1]
                return sorted(common)[0] if common else None

            assert wait_for(lambda: first_alert() is not None, 150, 0.5), (station.log(), swarm.tmp)
            target = first_alert()
            assert target is not None
            snap = station.snapshot()
            objects = {o["id"]: o for o in snap["objects"]}
            assert target in objects and objects[target]["label"] == "face"  # every alert is a reported object
            for driver in drivers:
                (card,) = [a for a in alerts_on(driver)["open"] if a["id"] == target]
                assert "face" in card["text"] and objects[target]["owner"] in card["text"]
                assert alerts_on(driver)["alerting"]
            assert wait_for(lambda: all(alerts_on(d)["table"].get(target) == "new" for d in drivers), 10), [
                alerts_on(d)["table"] for d in drivers
            ]

            # the owner's picture reaches the alert on both pages (and loads: the route serves the JPEG)
            def picture_loaded() -> bool:
                cards = [[a for a in alerts_on(d)["open"] if a["id"] == target] for d in drivers]
                return all(c and c[0]["image"] and c[0]["loaded"] for c in cards)

            assert wait_for(picture_loaded, 60, 0.5), [alerts_on(d)["open"] for d in drivers]

            # on a phone the alert with its picture fits: no sideways scroll
            drivers[1].set_window_size(390, 844)
            assert wait_for(lambda: drivers[1].execute_script("return window.innerWidth") <= 390, 10)
            assert wait_for(lambda: alerts_on(drivers[1])["open"], 10)
            width, inner = drivers[1].execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth];"
            )
            assert width <= inner, (width, inner)
            drivers[1].save_screenshot(str(tmp_path / "alerts-390.png"))
            drivers[0].save_screenshot(str(tmp_path / "alerts.png"))

            # the webhook's link (#object=<id>) marks that alert on the page
            drivers[0].get(f"{station.url}/#object={target}")
            assert wait_for(lambda: alerts_on(drivers[0])["focus"] == [target], 10), alerts_on(drivers[0])

            # sound: the operator enables it on one page, which then says so
            drivers[1].find_element("id", "alert-sound").click()
            assert wait_for(lambda: alerts_on(drivers[1])["sound"] == "sound is on", 10), alerts_on(drivers[1])

            # -- acknowledged on one page: cleared on both, who shown on both -----------------------------------
            drivers[0].execute_script('document.querySelector(`button[data-ack="${arguments[0]}"]`).click();', target)

            def acked_everywhere() -> bool:
                for d in drivers:
                    state = alerts_on(d)
                    if target in {a["id"] for a in state["open"]}:
                        return False
                    if not any(a["id"] == target and a["by"] == "operator:ana" for a in state["acked"]):
                        return False
                    if not state["table"].get(target, "").startswith("ack operator:ana "):  # the objects table
                        return False
                return True

            assert wait_for(acked_everywhere, 20, 0.25), [alerts_on(d) for d in drivers]
            acked = {a["id"]: a for a in station.snapshot()["alerts"]}[target]
            assert acked["acked_by"] == "operator:ana" and acked["acked_ts"] is not None
            unacked = sorted(a["id"] for a in station.snapshot()["alerts"] if a["acked_by"] is None)

            # the other station hears the retained mark: acknowledged there too, by the same operator
            def acked_on_other() -> bool:
                alert = {a["id"]: a for a in other.snapshot()["alerts"]}.get(target) if other else None
                return bool(alert and alert["acked_by"] == "operator:ana" and alert["acked_ts"] == acked["acked_ts"])

            assert wait_for(acked_on_other, 20, 0.25), other.snapshot()["alerts"] if other else None

            # -- the webhook got the POST for it after failing twice ----------------------------------------------
            def delivered() -> bool:
                return any(status == 204 and body["object"] == target for status, body in receiver.posts)

            assert wait_for(delivered, 60, 0.25), (receiver.posts, station.snapshot().get("webhook"))
            assert [s for s, _ in receiver.posts[:FAIL_FIRST]] == [503] * FAIL_FIRST
            assert receiver.posts[0][1]["object"] == receiver.posts[FAIL_FIRST][1]["object"]  # the same one, retried
            body = next(b for s, b in receiver.posts if s == 204 and b["object"] == target)
            assert body["label"] == "face" and body["node"] == objects[target]["owner"]
            assert body["url"] == f"{station.url}/#object={target}"
            stats = station.snapshot()["webhook"]
            assert stats["failed"] >= FAIL_FIRST and stats["sent"] >= 1, stats

            # -- a restart keeps it acknowledged; one nobody acknowledged still alerts --------------------------
            station.stop()
            posts_before = len(receiver.posts)
            known_before = set(unacked) | {target}
            station = StationProcess(tmp_path, broker.port, *ALERTING, *doors, db=db, port=port)
            after = {a["id"]: a for a in station.snapshot()["alerts"]}
            assert (after[target]["acked_by"], after[target]["acked_ts"]) == ("operator:ana", acked["acked_ts"])
            for oid in unacked:
                assert after[oid]["acked_by"] is None, after[oid]
            for driver in drivers:  # the pages reconnect to the new process by themselves
                assert wait_for(
                    lambda d=driver: (
                        any(a["id"] == target and a["by"] == "operator:ana" for a in alerts_on(d)["acked"])
                        and target not in {a["id"] for a in alerts_on(d)["open"]}
                    ),
                    30,
                    0.5,
                ), alerts_on(driver)
            # what the store knew is not news: the restarted station posts only finds it had not seen
            assert not known_before & {b["object"] for _, b in receiver.posts[posts_before:]}, receiver.posts
        finally:
            for driver in drivers:
                driver.quit()
            for process in (station, other):
                if process is not None:
                    process.stop()
            swarm.close()
            receiver.close()


@pytest.mark.timeout(180)
def test_an_ack_needs_a_login_the_csrf_token_a_confirmation_and_a_known_alert(tmp_path, users_file):  # noqa: F811
    """The ack route behind the station's doors, against a real station process (no node: no alert exists)."""
    from tests.integration.test_station_doors import StationProc, call, cookie_of, login, own

    with run_mosquitto() as broker:
        station = StationProc(tmp_path, broker.port, "--users", str(users_file), name="a")
        read_only = StationProc(tmp_path, broker.port, "--public-view", name="b")
        try:
            confirm = {**own(station), "X-Edgerun-Confirm": "a1"}
            assert call(station.port, "POST", "/api/alerts/a1/ack", confirm, b"").status == 401
            cookie = cookie_of(login(station))
            csrf = call(station.port, "GET", "/api/session", {"Cookie": cookie}).json()["csrf"]
            no_token = call(station.port, "POST", "/api/alerts/a1/ack", {**confirm, "Cookie": cookie}, b"")
            assert no_token.status == 403 and "X-CSRF-Token" in no_token.json()["error"]
            logged_in = {**own(station), "Cookie": cookie, "X-CSRF-Token": csrf}
            unconfirmed = call(station.port, "POST", "/api/alerts/a1/ack", logged_in, b"")
            assert unconfirmed.status == 400
            assert unconfirmed.json()["error"] == "confirm the action: send X-Edgerun-Confirm: a1"
            unknown = call(station.port, "POST", "/api/alerts/a1/ack", {**logged_in, "X-Edgerun-Confirm": "a1"}, b"")
            assert unknown.status == 404 and unknown.json()["error"] == "ack: no alert for object 'a1'"
            refused = call(
                read_only.port, "POST", "/api/alerts/a1/ack", {**own(read_only), "X-Edgerun-Confirm": "a1"}, b""
            )
            assert refused.status == 403 and "read-only" in refused.json()["error"]
        finally:
            station.stop()
            read_only.stop()


@needs_postgresql
@pytest.mark.timeout(300)
def test_two_stations_on_one_postgresql_share_an_ack_and_store_it_once(tmp_path):
    """A tent and a command post on one PostgreSQL database: an ack on one shows on the other (live, through the
    retained mark), the database holds one ack row, and the other station killed and started again still shows
    it acknowledged (from the shared store)."""
    pytest.importorskip("psycopg", reason="psycopg (the postgres extra) is not installed")
    import sqlalchemy as sa

    from edgerun.station.store import engine_for

    with postgres_server() as url, run_mosquitto() as broker:
        stations: list[StationProcess] = []
        swarm = None
        try:
            stations = [StationProcess(tmp_path, broker.port, db=url, name=f"station-{i}") for i in (1, 2)]
            swarm = Swarm(tmp_path, broker.port)

            def common_alert() -> str | None:
                ids = [{a["id"] for a in s.snapshot()["alerts"] if a["acked_by"] is None} for s in stations]
                return min(ids[0] & ids[1], default=None)

            assert wait_for(lambda: common_alert() is not None, 120, 0.5), [s.log() for s in stations]
            target = common_alert()
            assert target is not None
            answer = post_ack(stations[0].url, target)
            assert answer["ok"] and answer["acked_by"] == "operator"
            again = post_ack(stations[0].url, target)  # a second press changes nothing
            assert again["acked_ts"] == answer["acked_ts"]

            def acked_on(station: StationProcess) -> dict[str, Any] | None:
                alert = {a["id"]: a for a in station.snapshot()["alerts"]}.get(target)
                return alert if alert and alert["acked_by"] else None

            assert wait_for(lambda: acked_on(stations[1]) is not None, 20, 0.25)
            assert acked_on(stations[1])["acked_ts"] == answer["acked_ts"]  # type: ignore[index]
            time.sleep(1.5)  # both stations flush (every 0.5 s) what they journalled
            stations[1].kill()
            restarted = StationProcess(tmp_path, broker.port, db=url, name="station-2b", port=stations[1].port)
            stations.append(restarted)
            restored = {a["id"]: a for a in restarted.snapshot()["alerts"]}[target]
            assert (restored["acked_by"], restored["acked_ts"]) == ("operator", answer["acked_ts"])
        finally:
            for s in stations:
                s.kill()
            if swarm is not None:
                swarm.close()
        engine = engine_for(url)
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT target, by FROM actions WHERE kind = 'ack' AND target = :t"), {"t": target}
            ).all()
        engine.dispose()
        assert [tuple(r) for r in rows] == [(target, "operator")]

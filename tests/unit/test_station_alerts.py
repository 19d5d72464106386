"""Alerts: a new fleet object alerts until an operator acknowledges it, the acknowledgement is stored and shared
(the store, the retained mark), and the webhook posts each new alert to a real HTTP server on loopback, retried."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from aiohttp import web

from edgerun import wire
from edgerun.errors import ConfigError
from edgerun.station.alerts import AlertBook
from edgerun.station.model import FleetModel
from edgerun.station.store import StationStore
from edgerun.station.webhook import AlertWebhook, alert_body, check_webhook_url
from edgerun.testing.ports import free_port
from tests.unit.test_station_store import JPEG, T0, image_props, persist, station_model


def found(object_id: str, label: str = "person", last_seen: float = T0, **extra: object) -> bytes:
    doc = {
        "schema": "edgerun.object/2",
        "id": object_id,
        "label": label,
        "lat": 47.3971,
        "lon": 8.5461,
        "first_seen": T0 - 5,
        "last_seen": last_seen,
        "score": 0.91,
        "owner": "drone-2",
        "seen_by": ["drone-2"],
        **extra,
    }
    return json.dumps(doc).encode()


def ack_mark(object_id: str, by: str = "operator:ana", ts: float = T0 + 30) -> bytes:
    return msgspec.json.encode(wire.AlertAck(object=object_id, ts=ts, by=by))


@pytest.fixture
def store(tmp_path):
    s = StationStore(str(tmp_path / "station.db"), clock=lambda: T0 + 100)
    s.open()
    yield s
    s.close()


def test_a_new_object_alerts_once_with_its_picture_and_position_until_acknowledged():
    m = station_model()
    m.ingest("edgerun/fleet/objects", found("a1"), T0)
    m.ingest("edgerun/fleet/objects", found("a1", last_seen=T0 + 2), T0 + 2)  # a later report: not a new alert
    assert [a["id"] for a in m.alerts.take_raised()] == ["a1"]
    m.ingest(wire.object_image_topic("a1"), JPEG, T0 + 3, props=image_props())
    (alert,) = m.snapshot(T0 + 3)["alerts"]
    assert (alert["label"], alert["score"], alert["lat"], alert["lon"], alert["owner"]) == (
        "person",
        0.91,
        47.3971,
        8.5461,
        "drone-2",
    )
    assert alert["image_url"] == "/api/objects/a1/image" and alert["found"] == T0 - 5
    assert alert["acked_by"] is None and m.alerts.take_raised() == []
    assert m.ack("a1", "operator:ana", T0 + 10)
    assert not m.ack("a1", "operator:bo", T0 + 11)  # the first acknowledgement stands
    delta = m.take_delta(T0 + 11)
    assert delta is not None
    assert [(a["id"], a["acked_by"], a["acked_ts"]) for a in delta["alerts"]] == [("a1", "operator:ana", T0 + 10)]
    assert any(e["kind"] == "alert" and "acknowledged by operator:ana" in e["text"] for e in delta["events"])
    assert m.alerts.unacknowledged() == []


def test_only_the_chosen_labels_alert():
    m = FleetModel(alert_labels=frozenset({"person"}))
    m.ingest("edgerun/fleet/objects", found("c1", label="car"), T0)
    m.ingest("edgerun/fleet/objects", found("p1", label="person"), T0)
    assert [a["id"] for a in m.alerts.take_raised()] == ["p1"]
    assert [a["id"] for a in m.snapshot(T0)["alerts"]] == ["p1"]


def test_another_stations_retained_ack_clears_the_alert_and_a_bad_one_is_dropped_and_counted():
    m = station_model()
    m.ingest("edgerun/fleet/objects", found("a1"), T0)
    m.ingest(wire.ack_topic("a1"), ack_mark("a2"), T0)  # names another object
    m.ingest(wire.ack_topic("a1"), b"{not json", T0)
    m.ingest(wire.ack_topic("bad id!"), ack_mark("bad id!"), T0)
    assert m.dropped["bad_ack"] == 2 and m.dropped["malformed"] == 1
    assert m.alerts.alerts["a1"]["acked_by"] is None
    m.ingest(wire.ack_topic("a1"), ack_mark("a1"), T0 + 31, retained=True)
    assert (m.alerts.alerts["a1"]["acked_by"], m.alerts.alerts["a1"]["acked_ts"]) == ("operator:ana", T0 + 30)


def test_an_ack_that_arrives_before_its_object_means_no_alert_and_no_webhook():
    m = station_model()
    m.ingest(wire.ack_topic("a1"), ack_mark("a1"), T0, retained=True)  # retained marks can come first
    m.ingest("edgerun/fleet/objects", found("a1"), T0 + 1)
    assert m.alerts.take_raised() == [] and m.alerts.alerts["a1"]["acked_by"] == "operator:ana"
    m.ingest("edgerun/fleet/objects", found("a2"), T0 + 2)  # the mark right behind its object, before the tick
    m.ingest(wire.ack_topic("a2"), ack_mark("a2"), T0 + 2, retained=True)
    assert m.alerts.take_raised() == []


def test_a_restart_keeps_acknowledged_finds_quiet_and_unacknowledged_ones_alerting(store):
    m = station_model()
    for oid in ("a1", "a2"):
        m.ingest("edgerun/fleet/objects", found(oid), T0)
    m.ack("a1", "operator:ana", T0 + 10)
    persist(m, store)
    again = station_model("station-a2")
    again.restore(store.load())
    alerts = {a["id"]: a for a in again.snapshot(T0 + 20)["alerts"]}
    assert (alerts["a1"]["acked_by"], alerts["a1"]["acked_ts"]) == ("operator:ana", T0 + 10)
    assert alerts["a2"]["acked_by"] is None  # still alerting
    assert again.alerts.take_raised() == []  # known before the restart: the webhook is not called again
    again.ingest("edgerun/fleet/objects", found("a2", last_seen=T0 + 30), T0 + 30)  # its owner reports it again
    assert again.alerts.take_raised() == []


def test_two_stations_on_one_store_keep_one_ack_row_for_one_retained_mark(store):
    """Station A acks and publishes the mark; station B hears it: both journal the action, the store keeps one."""
    a, b = station_model("station-a"), station_model("station-b")
    for m in (a, b):
        m.ingest("edgerun/fleet/objects", found("a1"), T0)
    payload = ack_mark("a1", ts=T0 + 10)
    a.ack("a1", "operator:ana", T0 + 10, key=wire_key(payload))
    b.ingest(wire.ack_topic("a1"), payload, T0 + 10)
    persist(a, store)
    persist(b, store)
    assert store.counts()["actions"] == 1
    assert store.load().acks == {"a1": {"by": "operator:ana", "ts": T0 + 10}}


def wire_key(payload: bytes) -> str:
    from edgerun.station.model import payload_key

    return payload_key(payload)


def test_the_book_is_bounded_and_forgets_acknowledged_alerts_first():
    book = AlertBook(max_alerts=3, max_raised=2)
    for i in range(3):
        book.observe({"id": f"o{i}", "label": "person", "first_seen": T0 + i}, T0 + i)
    book.ack("o0", "ana", T0 + 5)
    book.observe({"id": "o3", "label": "person"}, T0 + 6)
    assert sorted(book.alerts) == ["o1", "o2", "o3"]  # o0 (acknowledged) went, not o1 (older unacknowledged)
    assert [a["id"] for a in book.take_raised()] == ["o2", "o3"] and book.counts["raised_dropped"] == 2


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "ftp://example.org/hook",
            "--alert-webhook: expected an http:// or https:// URL, got 'ftp://example.org/hook'",
        ),
        ("http:///hook", "--alert-webhook: the URL names no host: 'http:///hook'"),
    ],
)
def test_a_webhook_url_that_is_not_http_is_refused_with_one_line(url, message):
    with pytest.raises(ConfigError) as err:
        check_webhook_url(url)
    assert str(err.value) == message


class Receiver:
    """A real HTTP server on loopback that answers 503 to the first ``fail_first`` requests, then 204."""

    def __init__(self, fail_first: int) -> None:
        self.fail_first = fail_first
        self.requests: list[tuple[int, dict]] = []
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        status = 503 if len(self.requests) < self.fail_first else 204
        self.requests.append((status, body))
        return web.Response(status=status)

    async def moved(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/hook")

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        app.router.add_post("/moved", self.moved)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


async def drain(hook: AlertWebhook, done, timeout: float = 20.0) -> None:
    task = asyncio.create_task(hook.run())
    try:
        for _ in range(int(timeout / 0.02)):
            if done():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"webhook never finished: {hook.stats()}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_webhook_retries_with_backoff_until_the_receiver_takes_it():
    async def main() -> None:
        async with Receiver(fail_first=2) as rx:
            hook = AlertWebhook(f"http://127.0.0.1:{rx.port}/hook", backoff_s=0.05, attempts=4)
            m = station_model()
            m.ingest("edgerun/fleet/objects", found("a1"), T0)
            m.ingest(wire.object_image_topic("a1"), JPEG, T0, props=image_props())
            for alert in m.alerts.take_raised():
                assert hook.submit(alert_body(alert, "http://station.local:8080"))
            await drain(hook, lambda: hook.sent == 1)
            assert [status for status, _ in rx.requests] == [503, 503, 204]
            assert hook.stats() | {"last_error": ""} == {
                "sent": 1,
                "failed": 2,
                "dropped": 0,
                "dropped_by": {},
                "known": 0,
                "queued": 0,
                "last_error": "",
            }
            body = rx.requests[-1][1]
            assert body == {
                "schema": "edgerun.alert/1",
                "object": "a1",
                "label": "person",
                "score": 0.91,
                "lat": 47.3971,
                "lon": 8.5461,
                "node": "drone-2",
                "ts": T0 - 5,
                "url": "http://station.local:8080/#object=a1",
                "image_url": "http://station.local:8080/api/objects/a1/image",
            }

    asyncio.run(main())


def test_the_webhook_gives_up_after_its_attempts_drops_past_its_queue_and_follows_no_redirect():
    async def main() -> None:
        async with Receiver(fail_first=100) as rx:
            hook = AlertWebhook(f"http://127.0.0.1:{rx.port}/hook", backoff_s=0.01, attempts=3, queue_limit=2)
            assert hook.submit({"object": "x1"}) and hook.submit({"object": "x2"})
            assert not hook.submit({"object": "x3"})  # the queue is full: dropped at once, never blocks
            await drain(hook, lambda: hook.dropped == 3)
            assert [body["object"] for _, body in rx.requests] == ["x1"] * 3 + ["x2"] * 3
            assert (hook.sent, hook.failed, hook.last_error) == (0, 6, "HTTP 503")
            moved = AlertWebhook(f"http://127.0.0.1:{rx.port}/moved", backoff_s=0.01, attempts=1)
            moved.submit({"object": "x4"})
            await drain(moved, lambda: moved.dropped == 1)
            assert moved.last_error == "HTTP 302" and len(rx.requests) == 6  # the redirect was not followed

    asyncio.run(main())


def test_an_unreachable_webhook_is_counted_not_raised():
    async def main() -> None:
        hook = AlertWebhook(f"http://127.0.0.1:{free_port()}/hook", backoff_s=0.01, attempts=2, timeout_s=2.0)
        hook.submit({"object": "x1"})
        await drain(hook, lambda: hook.dropped == 1)
        assert hook.failed == 2 and hook.last_error.startswith("ClientConnectorError")

    asyncio.run(main())


def test_the_benchmark_runs_in_a_short_form_and_acknowledges_every_find():
    from edgerun.bench.station_alerts import run

    result = run(objects=20, versions=2, runs=1)
    assert result["us_per_object_message_with_alerts"] > 0 and result["us_per_object_message_without_alerts"] > 0
    assert result["alerts"] == result["acknowledged"] == 20 and result["snapshot_alerts_bytes"] > 0

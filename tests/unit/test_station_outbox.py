"""The alert webhook's outbox: pending posts live in the station's SQLite store (a real file) and survive a
restart, two webhooks on one database post each alert once, a post waits a bounded time for its picture, and
the age and count bounds drop (and count) what they must. A real HTTP receiver on loopback takes the posts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from edgerun.station.store import StationStore
from edgerun.station.webhook import AlertWebhook
from tests.unit.test_station_alerts import Receiver

T0 = 1_800_000_000.0


def body(object_id: str) -> dict[str, Any]:
    return {"schema": "edgerun.alert/1", "object": object_id, "label": "person", "image_url": None}


async def run_until(hooks: list[AlertWebhook], done: Callable[[], bool], timeout: float = 20.0) -> None:
    tasks = [asyncio.create_task(h.run()) for h in hooks]
    try:
        for _ in range(int(timeout / 0.02)):
            if done():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the webhooks never finished: {[h.stats() for h in hooks]}")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def open_store(path: str) -> StationStore:
    store = StationStore(path)
    store.open()
    return store


def test_a_pending_post_survives_a_restart_and_goes_once_the_receiver_answers(tmp_path):
    """The receiver fails every POST while the first station runs; the station stops with the post pending; a
    second run on the same store (same claimer: the station restarted) posts it once the receiver answers."""

    async def main() -> None:
        db = str(tmp_path / "station.db")
        async with Receiver(fail_first=10**6) as rx:
            store = open_store(db)
            first = AlertWebhook(f"http://127.0.0.1:{rx.port}/hook", engine=store.engine, claimer="tent",
                                 backoff_s=0.05, poll_s=0.02)  # fmt: skip
            assert first.submit(body("a1"))
            await run_until([first], lambda: first.failed >= 2)
            assert first.sent == 0 and first.outbox.states() == {"a1": "pending"}
            store.close()
            rx.fail_first = len(rx.requests)  # the receiver is back: 204 from now on
            store = open_store(db)
            again = AlertWebhook(f"http://127.0.0.1:{rx.port}/hook", engine=store.engine, claimer="tent",
                                 backoff_s=0.05, poll_s=0.02)  # fmt: skip
            assert again.stats()["queued"] == 0  # nothing submitted to this run: the post comes from the store
            await run_until([again], lambda: again.sent == 1)
            assert [b["object"] for s, b in rx.requests if s == 204] == ["a1"]
            assert again.outbox.states() == {"a1": "sent"}
            store.close()

    asyncio.run(main())


def test_two_stations_on_one_database_post_each_alert_once(tmp_path):
    """Both raise the same 20 alerts (each learns of every find itself) and run at once against one receiver."""

    async def main() -> None:
        async with Receiver(fail_first=3) as rx:
            store = open_store(str(tmp_path / "station.db"))
            url = f"http://127.0.0.1:{rx.port}/hook"
            hooks = [
                AlertWebhook(url, engine=store.engine, claimer=name, backoff_s=0.02, poll_s=0.02)
                for name in ("tent", "command-post")
            ]
            ids = [f"{i:016x}" for i in range(20)]
            for hook in hooks:
                for object_id in ids:
                    assert hook.submit(body(object_id))
            await run_until(hooks, lambda: sum(h.sent for h in hooks) == len(ids))
            delivered = [b["object"] for s, b in rx.requests if s == 204]
            assert sorted(delivered) == ids  # each once
            assert sum(h.known for h in hooks) == len(ids)  # the second to queue each found its row there
            await asyncio.sleep(0.2)  # neither posts anything more
            assert [b["object"] for s, b in rx.requests if s == 204] == delivered
            store.close()

    asyncio.run(main())


def test_a_post_carries_its_picture_when_it_comes_in_time_and_says_so_when_not(tmp_path):
    async def main() -> None:
        pictures: dict[str, str] = {}
        async with Receiver(fail_first=0) as rx:
            url = f"http://127.0.0.1:{rx.port}/hook"
            # A long wait: the post for "p1" goes as soon as its picture is there, not after the wait.
            hook = AlertWebhook(url, image_url_of=pictures.get, image_wait_s=600.0, poll_s=0.02)
            hook.submit(body("p1"))
            task = asyncio.create_task(hook.run())
            await asyncio.sleep(0.3)
            assert rx.requests == []  # waiting for the picture
            pictures["p1"] = "http://station:8080/api/objects/p1/image"
            for _ in range(500):
                if rx.requests:
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ((status, sent),) = rx.requests
            assert (sent["image_url"], sent["image_status"]) == (pictures["p1"], "attached")

            # A short wait and no picture: the post goes without it, and says so.
            quick = AlertWebhook(url, image_url_of=pictures.get, image_wait_s=0.2, poll_s=0.02)
            quick.submit(body("q1"))
            await run_until([quick], lambda: quick.sent == 1)
            sent = rx.requests[-1][1]
            assert (sent["object"], sent["image_url"], sent["image_status"]) == ("q1", None, "no picture within 0.2 s")

    asyncio.run(main())


def test_posts_past_the_age_and_the_count_bounds_are_dropped_and_counted(tmp_path):
    """A clock passed in: the receiver is down for longer than the age bound."""

    async def main() -> None:
        now = [T0]
        async with Receiver(fail_first=10**6) as rx:  # down for the whole test: 503 to everything
            hook = AlertWebhook(f"http://127.0.0.1:{rx.port}/hook", queue_limit=2, max_age_s=60.0, attempts=100,
                                backoff_s=1.0, poll_s=0.02, clock=lambda: now[0])  # fmt: skip
            assert hook.submit(body("o1")) and hook.submit(body("o2"))
            assert not hook.submit(body("o3"))  # two wait already: dropped at once, never blocks
            await run_until([hook], lambda: hook.failed >= 1)
            assert hook.outbox.states() == {"o1": "pending", "o2": "pending"}
            now[0] += 61.0
            await run_until([hook], lambda: hook.dropped == 3)
            assert hook.stats()["dropped_by"] == {"full": 1, "too_old": 2}
            assert hook.outbox.states() == {"o1": "dropped", "o2": "dropped"}
            now[0] += 86400.0 + 1  # the finished rows are kept a day, then deleted
            await run_until([hook], lambda: hook.outbox.states() == {})

    asyncio.run(main())

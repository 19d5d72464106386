"""The alert webhook (``edgerun station --alert-webhook URL``): one JSON POST per new alert, for teams that page
someone.

Never blocks the station's loop: ``submit`` hands the body to one task, which keeps it in the outbox
(``edgerun/station/outbox.py``: the station's database, so pending posts survive a restart and two stations on
one database post each alert once) and posts them in the order found with the aiohttp client. A post waits up to
``image_wait_s`` for its find's picture: it carries ``image_url`` when the picture came, else it goes without and
says so (``image_status``). A failed POST (no answer within ``timeout_s``, a connection error, any status but 2xx)
is retried after a backoff that doubles up to ``backoff_max_s``, at most ``attempts`` times, then dropped
(counted); so is a post still pending after ``max_age_s``, and a new one while ``queue_limit`` wait. Only the
configured URL is ever contacted: redirects are not followed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import ClientSession, ClientTimeout
from sqlalchemy.engine import Engine

from edgerun.errors import ConfigError
from edgerun.station.outbox import AlertOutbox, Post, memory_engine

log = logging.getLogger(__name__)

ALERT_SCHEMA = "edgerun.alert/1"
EXPIRE_EVERY_S = 5.0  # how often pending posts are checked against the age bound


def check_webhook_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host; a ConfigError naming what is wrong otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"--alert-webhook: expected an http:// or https:// URL, got {url[:200]!r}")
    if not parts.hostname:
        raise ConfigError(f"--alert-webhook: the URL names no host: {url[:200]!r}")
    return url


def alert_body(alert: dict[str, Any], page_url: str) -> dict[str, Any]:
    """What the webhook receives for one alert; URLs are absolute, on this station's page."""
    base = page_url.rstrip("/")
    image = alert.get("image_url")
    return {
        "schema": ALERT_SCHEMA,
        "object": alert["id"],
        "label": alert.get("label"),
        "score": alert.get("score"),
        "lat": alert.get("lat"),
        "lon": alert.get("lon"),
        "node": alert.get("owner"),
        "ts": alert.get("found"),
        "url": f"{base}/#object={alert['id']}" if base else None,
        "image_url": f"{base}{image}" if base and image else None,
    }


class AlertWebhook:
    def __init__(
        self,
        url: str,
        *,
        engine: Engine | None = None,
        claimer: str = "station",
        image_url_of: Callable[[str], str | None] | None = None,
        image_wait_s: float = 3.0,
        queue_limit: int = 256,
        max_age_s: float = 3600.0,
        attempts: int = 6,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``engine``: the station's database (None: a private in-memory one); ``claimer``: this station's name in
        its claims (the same at each start of this station, different between stations); ``image_url_of``: the
        absolute picture URL of an object, or None while the station has none (None: the body is sent as
        submitted)."""
        self.url = check_webhook_url(url)
        self.attempts, self.timeout_s = attempts, timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.image_url_of, self.image_wait_s = image_url_of, image_wait_s
        self.queue_limit, self.poll_s, self.clock = queue_limit, poll_s, clock
        self.outbox = AlertOutbox(
            engine if engine is not None else memory_engine(),
            claimer,
            max_pending=queue_limit,
            max_age_s=max_age_s,
            lease_s=timeout_s + 10.0,  # longer than one attempt: a live station's claim never lapses mid-post
        )
        # Submitted, not yet in the outbox: kept there at the next poll, or after the post in flight.
        self._incoming: list[dict[str, Any]] = []
        self._pending = 0  # the outbox's pending rows at the last look
        self._wake = asyncio.Event()
        self._last_expire = float("-inf")
        self.sent = 0  # delivered (a 2xx answer)
        self.failed = 0  # attempts that failed (each retry of one alert counts)
        self.dropped_by: Counter[str] = Counter()  # alerts given up: full, too_old, attempts
        self.known = 0  # alerts another station (or an earlier run) had queued already: not posted twice
        self.last_error = ""

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by.values())

    def submit(self, body: dict[str, Any]) -> bool:
        """Queue one alert's body; False (and counted as dropped) when ``queue_limit`` posts wait already."""
        if self._pending + len(self._incoming) >= self.queue_limit:
            self.dropped_by["full"] += 1
            return False
        self._incoming.append(body)
        self._wake.set()
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "dropped_by": dict(self.dropped_by),
            "known": self.known,
            "queued": self._pending + len(self._incoming),
            "last_error": self.last_error,
        }

    async def run(self) -> None:
        """Post what is queued (and what an earlier run left in the outbox) until cancelled."""
        outbox = self.outbox
        await asyncio.to_thread(outbox.release_mine)
        async with ClientSession(timeout=ClientTimeout(total=self.timeout_s)) as session:
            while True:
                await self._take_incoming()
                dropped = await self._expire()
                if dropped:
                    self.dropped_by["too_old"] += dropped
                    log.error("station: alert webhook gave up on %d alerts older than %g s", dropped, outbox.max_age_s)
                post = await asyncio.to_thread(outbox.claim_next, self.clock(), self._ready)
                if post is not None:
                    await self._attempt(session, post)
                self._pending = await asyncio.to_thread(outbox.pending)
                if post is None:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.poll_s)
                    except asyncio.TimeoutError:
                        pass

    async def _expire(self) -> int:
        """The outbox's age bound, checked every EXPIRE_EVERY_S (it writes: not on every poll)."""
        now = self.clock()
        if now - self._last_expire < EXPIRE_EVERY_S:
            return 0
        self._last_expire = now
        return await asyncio.to_thread(self.outbox.expire, now)

    async def _take_incoming(self) -> None:
        while self._incoming:
            body = self._incoming.pop(0)
            now = self.clock()
            wait = self.image_wait_s if self.image_url_of is not None else 0.0
            result = await asyncio.to_thread(self.outbox.add, str(body.get("object")), body, now, now + wait)
            if result == "full":
                self.dropped_by["full"] += 1
            elif result == "known":
                self.known += 1

    def _ready(self, object_id: str, due: float, attempts: int) -> bool:
        """A post may go when it is due; a first attempt goes before that as soon as its picture is there."""
        if due <= self.clock():
            return True
        return attempts == 0 and self.image_url_of is not None and self.image_url_of(object_id) is not None

    async def _attempt(self, session: ClientSession, post: Post) -> None:
        body = post.body
        if self.image_url_of is not None:
            image = self.image_url_of(post.object_id)
            body["image_url"] = image
            body["image_status"] = "attached" if image else f"no picture within {self.image_wait_s:g} s"
        error = await self._post(session, body)
        now = self.clock()
        attempt = post.attempts + 1
        backoff = min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)
        retry_at = now + backoff if attempt < self.attempts else None
        # The outbox first, the counters after: whoever reads them sees the row in its new state.
        await asyncio.to_thread(self.outbox.finish, post, now, sent=not error, error=error, retry_at=retry_at)
        self._pending = await asyncio.to_thread(self.outbox.pending)
        if not error:
            self.sent += 1
            return
        self.failed += 1
        self.last_error = error
        log.warning("station: alert webhook attempt %d/%d failed: %s", attempt, self.attempts, error)
        if retry_at is None:
            self.dropped_by["attempts"] += 1
            log.error("station: alert webhook gave up on %s after %d attempts", post.object_id, self.attempts)

    async def _post(self, session: ClientSession, body: dict[str, Any]) -> str:
        """'' when delivered, else why not."""
        try:
            async with session.post(self.url, json=body, allow_redirects=False) as response:
                if 200 <= response.status < 300:
                    return ""
                return f"HTTP {response.status}"
        except asyncio.TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except Exception as err:  # aiohttp's client errors and OSError: the receiver is not reachable
            return f"{type(err).__name__}: {err}"[:300]

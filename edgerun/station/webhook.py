"""The alert webhook (``edgerun station --alert-webhook URL``): one JSON POST per new alert, for teams that page
someone.

Never blocks the station's loop: ``submit`` puts the body on a bounded queue (a full queue drops it, counted)
and one task posts them in order with the aiohttp client. A failed POST (no answer within ``timeout_s``, a
connection error, any status but 2xx) is retried after a backoff that doubles up to ``backoff_max_s``, at most
``attempts`` times, then dropped (counted). Only the configured URL is ever contacted: redirects are not followed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from aiohttp import ClientSession, ClientTimeout

from edgerun.errors import ConfigError

log = logging.getLogger(__name__)

ALERT_SCHEMA = "edgerun.alert/1"


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
        queue_limit: int = 256,
        attempts: int = 6,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.url = check_webhook_url(url)
        self.attempts, self.timeout_s = attempts, timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(queue_limit)
        self.sent = 0  # delivered (a 2xx answer)
        self.failed = 0  # attempts that failed (each retry of one alert counts)
        self.dropped = 0  # alerts given up: the queue was full, or every attempt failed
        self.last_error = ""

    def submit(self, body: dict[str, Any]) -> bool:
        """Queue one alert's body; False (and counted as dropped) when the queue is full."""
        try:
            self.queue.put_nowait(body)
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            return False

    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "queued": self.queue.qsize(),
            "last_error": self.last_error,
        }

    async def run(self) -> None:
        """Post what is queued until cancelled."""
        async with ClientSession(timeout=ClientTimeout(total=self.timeout_s)) as session:
            while True:
                body = await self.queue.get()
                await self._deliver(session, body)

    async def _deliver(self, session: ClientSession, body: dict[str, Any]) -> None:
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            error = await self._post(session, body)
            if not error:
                self.sent += 1
                return
            self.failed += 1
            self.last_error = error
            log.warning("station: alert webhook attempt %d/%d failed: %s", attempt, self.attempts, error)
            if attempt < self.attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
        self.dropped += 1
        log.error("station: alert webhook gave up on %s after %d attempts", body.get("object"), self.attempts)

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

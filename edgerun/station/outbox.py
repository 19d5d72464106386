"""The alert webhook's outbox: the posts still to make, in the station's database, so they survive a restart and
two stations on one database post each alert once.

One row per alert (``alert_posts``, keyed by the object id): a station that raises an alert inserts its row with
``ON CONFLICT DO NOTHING``, so the second station that raises the same find adds nothing. A station takes a row
by *claiming* it, ``UPDATE ... SET claimed_by = me WHERE state = 'pending' AND (claimed_by IS NULL OR the claim
expired)``: the database lets one UPDATE win (PostgreSQL re-checks the WHERE of the row it waited for; SQLite
runs one writer at a time), so one station posts it. A claim is a lease (``lease_s``): a station that dies while
posting holds the row no longer than that, then any station (itself restarted, or the other) takes it again.
A post that reached the receiver just before the station died is posted again after the lease: at least once.

Bounded: at most ``max_pending`` pending rows (a new alert past that is dropped, counted), none older than
``max_age_s`` (dropped, counted), and the finished rows (sent or given up, kept so the other station does not post
the alert again) are deleted ``keep_s`` after they finished.

Blocking (SQLAlchemy Core): the webhook's task calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.pool import StaticPool

from edgerun.station.store import alert_posts, metadata

PENDING, SENT, DROPPED = "pending", "sent", "dropped"


@dataclass
class Post:
    """One claimed row: what to send, and how often it was tried already."""

    object_id: str
    created: float
    attempts: int
    body: dict[str, Any]


def memory_engine() -> Engine:
    """A private in-memory database for a station without a store (``--db none``): the same code, nothing kept."""
    engine = sa.create_engine("sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False})
    metadata.create_all(engine, tables=[alert_posts])
    return engine


class AlertOutbox:
    def __init__(
        self,
        engine: Engine,
        claimer: str,
        *,
        max_pending: int = 256,
        max_age_s: float = 3600.0,
        keep_s: float = 86400.0,
        lease_s: float = 15.0,
    ) -> None:
        self.engine, self.claimer = engine, claimer[:64]
        self.max_pending, self.max_age_s, self.keep_s, self.lease_s = max_pending, max_age_s, keep_s, lease_s
        self.dialect = engine.dialect.name

    def _insert(self) -> Any:
        from sqlalchemy.dialects import postgresql, sqlite

        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(alert_posts)

    def add(self, object_id: str, body: dict[str, Any], now: float, due: float) -> str:
        """Queue one alert's post: "queued", "known" (this database has its row already: another station raised
        it, or it was posted) or "full" (``max_pending`` rows wait: not queued)."""
        with self.engine.begin() as conn:
            if self.pending(conn) >= self.max_pending:
                return "full"
            row = {
                "object_id": object_id,
                "created": now,
                "due": due,
                "attempts": 0,
                "state": PENDING,
                "last_error": "",
                "body": json.dumps(body, separators=(",", ":")),
            }
            # RETURNING, not rowcount: psycopg counts a conflicting row that was not inserted.
            ins = self._insert().on_conflict_do_nothing().returning(alert_posts.c.object_id)
            inserted = conn.execute(ins, row).first()
        return "queued" if inserted is not None else "known"

    def pending(self, conn: sa.Connection | None = None) -> int:
        if conn is None:
            with self.engine.connect() as c:
                return self.pending(c)
        query = sa.select(sa.func.count()).select_from(alert_posts).where(alert_posts.c.state == PENDING)
        return int(conn.execute(query).scalar() or 0)

    def release_mine(self) -> int:
        """Claims this station held when it stopped (a restart under the same claimer id) go back at once."""
        with self.engine.begin() as conn:
            return conn.execute(
                sa.update(alert_posts)
                .where(alert_posts.c.claimed_by == self.claimer, alert_posts.c.state == PENDING)
                .values(claimed_by=None, claimed_until=None)
            ).rowcount

    def expire(self, now: float) -> int:
        """Pending rows older than ``max_age_s`` are given up (returned: how many); finished rows older than
        ``keep_s`` are deleted."""
        with self.engine.begin() as conn:
            old = conn.execute(
                sa.update(alert_posts)
                .where(alert_posts.c.state == PENDING, alert_posts.c.created < now - self.max_age_s)
                .values(state=DROPPED, done=now, claimed_by=None, last_error=f"older than {self.max_age_s:g} s")
            ).rowcount
            conn.execute(
                sa.delete(alert_posts).where(alert_posts.c.state != PENDING, alert_posts.c.done < now - self.keep_s)
            )
        return int(old)

    def claim_next(self, now: float, ready: Callable[[str, float, int], bool]) -> Post | None:
        """The oldest pending row nobody holds, claimed for this station, if ``ready(object_id, due, attempts)``
        says it may go now; None when there is none or the oldest must wait (posts go out in the order found)."""
        free = sa.or_(alert_posts.c.claimed_by.is_(None), alert_posts.c.claimed_until < now)
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(alert_posts.c.object_id, alert_posts.c.created, alert_posts.c.due, alert_posts.c.attempts)
                .where(alert_posts.c.state == PENDING, free)
                .order_by(alert_posts.c.created, alert_posts.c.object_id)
                .limit(16)
            ).all()
        for object_id, created, due, attempts in rows:
            if not ready(object_id, due, attempts):
                return None
            with self.engine.begin() as conn:
                won = conn.execute(
                    sa.update(alert_posts)
                    .where(alert_posts.c.object_id == object_id, alert_posts.c.state == PENDING, free)
                    .values(claimed_by=self.claimer, claimed_until=now + self.lease_s)
                ).rowcount
                if not won:
                    continue  # another station took it between the two statements: the next one
                body = conn.execute(sa.select(alert_posts.c.body).where(alert_posts.c.object_id == object_id)).scalar()
            return Post(object_id, created, attempts, json.loads(body or "{}"))
        return None

    def finish(self, post: Post, now: float, *, sent: bool, error: str = "", retry_at: float | None = None) -> None:
        """After one attempt: sent, tried again at ``retry_at``, or (``retry_at`` None) given up."""
        values: dict[str, Any] = {"attempts": post.attempts + 1, "claimed_by": None, "claimed_until": None}
        if sent:
            values.update(state=SENT, done=now, last_error="")
        elif retry_at is None:
            values.update(state=DROPPED, done=now, last_error=error[:300])
        else:
            values.update(due=retry_at, last_error=error[:300])
        with self.engine.begin() as conn:
            conn.execute(
                sa.update(alert_posts)
                .where(alert_posts.c.object_id == post.object_id, alert_posts.c.claimed_by == self.claimer)
                .values(**values)
            )

    def states(self) -> dict[str, str]:
        """object id -> state, every row (for tests and the CLI)."""
        with self.engine.connect() as conn:
            return {oid: state for oid, state in conn.execute(sa.select(alert_posts.c.object_id, alert_posts.c.state))}

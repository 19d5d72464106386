"""The station's store: the mission (fleet objects and every version of each, their images, events, nodes,
rollouts, operator actions) in SQLite by default, in PostgreSQL when several stations share one fleet.

One schema for both, written with SQLAlchemy Core; a ``schema_version`` table and the ``MIGRATIONS`` list take
any older database to the current shape on open (each step in its own transaction). SQLite runs in WAL mode so
the page's reads never wait for the writer.

Writes never run on the event loop: ``submit`` puts a ``Batch`` (what the fleet model journalled since the
last flush) on a bounded queue and one writer thread writes each batch in one transaction. Rows that two
stations would both write (an object version, a node's event, a retire action) carry a natural key and are
inserted with ``ON CONFLICT DO NOTHING``, so stations on one database never double-count.

Retention: rows older than ``max_age_s`` go, then, while the stored bytes (the JSON and JPEG the rows hold)
exceed ``max_bytes``, the oldest events, object versions and images go first. Checked at open and every
``retention_every_s``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from edgerun.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
DEFAULT_MAX_AGE_S = 30 * 86400.0  # a month of missions: a search rarely lasts longer
DEFAULT_MAX_BYTES = 2 * 1024**3  # stored bytes; the demo swarm writes far less a day (docs/station.md)
ROW_OVERHEAD = 48  # bytes a row costs beyond its text and blobs (keys, numbers, index entries), for the size bound

metadata = sa.MetaData()

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("applied", sa.Float, nullable=False),
)
objects = sa.Table(  # the latest version of each fleet object
    "objects",
    metadata,
    sa.Column("object_id", sa.String(128), primary_key=True),
    sa.Column("last_seen", sa.Float, nullable=False),
    sa.Column("received", sa.Float, nullable=False),
    sa.Column("doc", sa.Text, nullable=False),
)
object_versions = sa.Table(
    "object_versions",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("object_id", sa.String(128), nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("received", sa.Float, nullable=False, index=True),
    sa.Column("doc", sa.Text, nullable=False),
    # The same report heard by two stations (or again as the broker's retained copy) is one version.
    sa.UniqueConstraint("object_id", "last_seen", "owner", name="object_versions_report"),
)
events = sa.Table(
    "events",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(64), nullable=False, unique=True),
    sa.Column("ts", sa.Float, nullable=False, index=True),
    sa.Column("node", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(200), nullable=False),
    sa.Column("text", sa.Text, nullable=False),
    sa.Column("level", sa.String(16), nullable=False),
)
nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("node_id", sa.String(128), primary_key=True),
    sa.Column("first_seen", sa.Float, nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False, index=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("doc", sa.Text, nullable=False),  # the node's last state and metadata (NodeView.to_record)
)
rollouts = sa.Table(  # the broker's retained release and rollout state of each model, as received (signed bytes)
    "rollouts",
    metadata,
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("release", sa.LargeBinary, nullable=True),
    sa.Column("rollout", sa.LargeBinary, nullable=True),
    sa.Column("updated", sa.Float, nullable=False),
)
# -- version 2 --
object_images = sa.Table(  # the latest picture of each object (edgerun/fleet/objects/<id>/image)
    "object_images",
    metadata,
    sa.Column("object_id", sa.String(128), primary_key=True),
    sa.Column("jpeg", sa.LargeBinary, nullable=False),
    sa.Column("node", sa.String(128), nullable=False),
    sa.Column("score", sa.Float, nullable=True),
    sa.Column("box", sa.String(200), nullable=False),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("received", sa.Float, nullable=False, index=True),
)
actions = sa.Table(  # what operators did: retire a node, acknowledge an alert (who and when)
    "actions",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(64), nullable=False, unique=True),
    sa.Column("ts", sa.Float, nullable=False, index=True),
    sa.Column("kind", sa.String(40), nullable=False),
    sa.Column("target", sa.String(200), nullable=False),
    sa.Column("by", sa.String(128), nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)

# -- version 3 --
alert_posts = sa.Table(  # the alert webhook's posts (edgerun/station/outbox.py): pending ones survive a restart
    "alert_posts",
    metadata,
    # One row per alert in the database: two stations that both raise it insert one row, and one of them posts it.
    sa.Column("object_id", sa.String(128), primary_key=True),
    sa.Column("created", sa.Float, nullable=False, index=True),
    sa.Column("due", sa.Float, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("state", sa.String(8), nullable=False, index=True),  # pending, sent, dropped
    sa.Column("claimed_by", sa.String(64), nullable=True),
    sa.Column("claimed_until", sa.Float, nullable=True),
    sa.Column("done", sa.Float, nullable=True),
    sa.Column("last_error", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
)

V1_TABLES = [objects, object_versions, events, nodes, rollouts]
V2_TABLES = [object_images, actions]
V3_TABLES = [alert_posts]


def _create(tables: list[sa.Table]) -> Callable[[Connection], None]:
    return lambda conn: metadata.create_all(conn, tables=tables)


# MIGRATIONS[n] takes a database from version n to n + 1 (version 0: empty).
MIGRATIONS: list[Callable[[Connection], None]] = [_create(V1_TABLES), _create(V2_TABLES), _create(V3_TABLES)]
assert len(MIGRATIONS) == SCHEMA_VERSION


def event_key(*parts: object) -> str:
    """A natural key for a row two stations may both write: the same parts, the same key."""
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()[:40]


@dataclass
class Batch:
    """What the fleet model journalled since the last flush, in the store's terms."""

    object_versions: list[dict[str, Any]] = field(default_factory=list)  # normalised objects (model.parse_object)
    nodes: list[dict[str, Any]] = field(default_factory=list)  # NodeView.to_record()
    events: list[dict[str, Any]] = field(default_factory=list)  # {"key", "ts", "node", "kind", "text", "level"}
    rollouts: dict[str, tuple[bytes | None, bytes | None]] = field(default_factory=dict)  # model -> release, state
    images: list[dict[str, Any]] = field(default_factory=list)  # {"object_id", "jpeg", "node", "score", "box", "ts"}
    actions: list[dict[str, Any]] = field(default_factory=list)  # {"key", "ts", "kind", "target", "by", "detail"}

    def __bool__(self) -> bool:
        return bool(self.object_versions or self.nodes or self.events or self.rollouts or self.images or self.actions)


@dataclass
class Restored:
    """What a station starts from: the mission as the store keeps it."""

    objects: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    events: list[dict[str, Any]]  # oldest first
    rollouts: dict[str, tuple[bytes | None, bytes | None]]
    retired: dict[str, dict[str, Any]]  # node -> the retire action still in force (no word from the node since)
    images: dict[str, dict[str, Any]]  # object id -> the image's metadata (not the JPEG)
    acks: dict[str, dict[str, Any]] = field(default_factory=dict)  # object id -> its alert's first ack {"by", "ts"}


def default_db_path() -> Path:
    """systemd's $STATE_DIRECTORY (first entry)/station.db for a station run as a service; else
    $XDG_STATE_HOME/edgerun/station.db, else ~/.local/state/edgerun/station.db (the XDG base directory spec)."""
    service = os.environ.get("STATE_DIRECTORY")
    if service:
        return Path(service.split(":")[0]) / "station.db"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edgerun" / "station.db"


def engine_for(db: str) -> Engine:
    """An engine for ``--db``: a PostgreSQL URL (psycopg 3), or a SQLite file path (WAL); bad ones: ConfigError."""
    if db.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
        url = "postgresql+psycopg://" + db.split("://", 1)[1]
        try:
            import psycopg  # noqa: F401  # the one PostgreSQL driver we support
        except ImportError:
            raise ConfigError(
                "--db postgresql://...: the PostgreSQL driver is not installed (pip install 'edgerun[postgres]')"
            ) from None
        return sa.create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=2)
    if "://" in db:
        raise ConfigError(f"--db {db}: expected a SQLite file path or a postgresql:// URL")
    path = Path(db).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--db {db}: cannot create {path.parent} ({err.strerror or err})") from None
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False, "timeout": 30})

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers (the page's restore) never block the writer thread
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut loses at most the last commits
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    return engine


def current_version(conn: Connection) -> int:
    if not sa.inspect(conn).has_table("schema_version"):
        return 0
    return int(conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar() or 0)


def migrate(engine: Engine, target: int = SCHEMA_VERSION) -> int:
    """Take the database to ``target``; returns the version it was at. A newer database than this code: refused."""
    with engine.begin() as conn:
        # Two stations starting at once on an empty database must not both create the tables: the migration
        # runs holding the database's write lock (PostgreSQL: an advisory lock; SQLite: BEGIN IMMEDIATE, as
        # Python's sqlite3 would otherwise run each CREATE on its own, outside any transaction).
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(7467318)"))
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        metadata.create_all(conn, tables=[schema_version])
        found = current_version(conn)
        if found > SCHEMA_VERSION:
            raise ConfigError(
                f"--db: the database is at schema version {found}, this edgerun knows up to {SCHEMA_VERSION}: "
                "upgrade edgerun"
            )
        for version in range(found, target):
            MIGRATIONS[version](conn)
            conn.execute(sa.insert(schema_version).values(version=version + 1, applied=time.time()))
            log.info("station store: migrated to schema version %d", version + 1)
    return found


class StationStore:
    """One database, one writer thread. ``submit`` never blocks the caller; ``flush`` waits for what was submitted."""

    def __init__(
        self,
        db: str,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        retention_every_s: float = 300.0,  # the size check reads every row's length: not too often
        queue_batches: int = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_age_s <= 0 or max_bytes <= 0:
            raise ConfigError("--db-max-age-days and --db-max-mb must be positive")
        self.db = db
        self.engine = engine_for(db)
        self.max_age_s, self.max_bytes = max_age_s, max_bytes
        self.retention_every_s = retention_every_s
        self.clock = clock
        self.dialect = self.engine.dialect.name
        self.dropped_batches = 0  # batches the writer could not keep up with (queue full) or failed to write
        self.write_errors = 0
        self.written_rows = 0
        self._queue: queue.Queue[Batch | threading.Event | None] = queue.Queue(maxsize=queue_batches)
        self._thread: threading.Thread | None = None
        self._last_retention = 0.0

    # -- lifecycle ------------------------------------------------------------------------

    def open(self) -> int:
        """Create or migrate the schema, apply retention, start the writer; returns the version found."""
        try:
            found = migrate(self.engine)
        except sa.exc.OperationalError as err:
            why = str(err.orig).strip().splitlines()[0] if str(err.orig).strip() else type(err.orig).__name__
            raise ConfigError(f"--db {self.redacted}: cannot open the database ({why})") from None
        self.enforce_retention()
        self._thread = threading.Thread(target=self._run, name="station-store", daemon=True)
        self._thread.start()
        return found

    @property
    def redacted(self) -> str:
        """``--db`` as given, its password hidden (for logs and errors)."""
        return sa.engine.make_url(self.db).render_as_string(hide_password=True) if "://" in self.db else self.db

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.dispose()

    def submit(self, batch: Batch) -> None:
        if not batch:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1  # the database is far behind: the live view goes on, this batch is lost

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is written (for a clean stop, and tests)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.write(item)
            except sa.exc.SQLAlchemyError as err:
                self.write_errors += 1
                self.dropped_batches += 1
                log.error("station store: writing a batch failed (%s)", err.__class__.__name__)
            if self.clock() - self._last_retention >= self.retention_every_s:
                try:
                    self.enforce_retention()
                except sa.exc.SQLAlchemyError as err:
                    log.error("station store: retention failed (%s)", err.__class__.__name__)

    # -- writing --------------------------------------------------------------------------

    def _insert(self, table: sa.Table) -> Any:
        """An INSERT with ON CONFLICT (the same clauses in both dialects, each in its own class)."""
        from sqlalchemy.dialects import postgresql, sqlite

        return postgresql.insert(table) if self.dialect == "postgresql" else sqlite.insert(table)

    def write(self, batch: Batch) -> None:
        """One batch in one transaction (the writer thread calls this; tests may too)."""
        now = self.clock()
        rows = 0
        with self.engine.begin() as conn:
            if batch.object_versions:
                versions = [
                    {
                        "object_id": o["id"],
                        "last_seen": float(o.get("last_seen") or 0.0),
                        "owner": o.get("owner") or "",
                        "received": float(o.get("received") or now),
                        "doc": json.dumps(o, separators=(",", ":")),
                    }
                    for o in batch.object_versions
                ]
                ins = self._insert(object_versions)
                conn.execute(ins.on_conflict_do_nothing(), versions)
                latest: dict[str, dict[str, Any]] = {}
                for row in versions:
                    if row["object_id"] not in latest or row["last_seen"] >= latest[row["object_id"]]["last_seen"]:
                        latest[row["object_id"]] = row
                ins = self._insert(objects)
                conn.execute(
                    ins.on_conflict_do_update(
                        index_elements=[objects.c.object_id],
                        set_={c: getattr(ins.excluded, c) for c in ("last_seen", "received", "doc")},
                        where=ins.excluded.last_seen >= objects.c.last_seen,
                    ),
                    [{k: r[k] for k in ("object_id", "last_seen", "received", "doc")} for r in latest.values()],
                )
                rows += len(versions)
            if batch.nodes:
                ins = self._insert(nodes)
                conn.execute(
                    ins.on_conflict_do_update(
                        index_elements=[nodes.c.node_id],
                        set_={
                            "first_seen": sa.case(
                                (nodes.c.first_seen < ins.excluded.first_seen, nodes.c.first_seen),
                                else_=ins.excluded.first_seen,
                            ),
                            "last_seen": ins.excluded.last_seen,
                            "status": ins.excluded.status,
                            "doc": ins.excluded.doc,
                        },
                        # Another station's fresher word on the node wins over this one's older view.
                        where=ins.excluded.last_seen >= nodes.c.last_seen,
                    ),
                    [
                        {
                            "node_id": n["id"],
                            "first_seen": float(n.get("first_seen") or n.get("last_seen") or now),
                            "last_seen": float(n.get("last_seen") or 0.0),
                            "status": str(n.get("status") or "")[:16],
                            "doc": json.dumps(n, separators=(",", ":")),
                        }
                        for n in batch.nodes
                    ],
                )
                rows += len(batch.nodes)
            if batch.events:
                conn.execute(self._insert(events).on_conflict_do_nothing(), [_clean(e) for e in batch.events])
                rows += len(batch.events)
            for model, (release, rollout) in batch.rollouts.items():
                ins = self._insert(rollouts)
                conn.execute(
                    ins.on_conflict_do_update(
                        index_elements=[rollouts.c.model],
                        set_={"release": ins.excluded.release, "rollout": ins.excluded.rollout, "updated": now},
                    ),
                    {"model": model, "release": release, "rollout": rollout, "updated": now},
                )
                rows += 1
            if batch.images:
                ins = self._insert(object_images)
                conn.execute(
                    ins.on_conflict_do_update(
                        index_elements=[object_images.c.object_id],
                        set_={c: getattr(ins.excluded, c) for c in ("jpeg", "node", "score", "box", "ts", "received")},
                        where=ins.excluded.ts >= object_images.c.ts,
                    ),
                    [_clean({**img, "received": img.get("received", now)}) for img in batch.images],
                )
                rows += len(batch.images)
            if batch.actions:
                conn.execute(self._insert(actions).on_conflict_do_nothing(), [_clean(a) for a in batch.actions])
                rows += len(batch.actions)
        self.written_rows += rows

    # -- reading --------------------------------------------------------------------------

    def load(self, *, max_objects: int = 5000, max_events: int = 500, max_nodes: int = 1000) -> Restored:
        """The mission to rebuild the live view from (the newest of each kind, up to the view's bounds)."""
        with self.engine.connect() as conn:
            obj_rows = conn.execute(
                sa.select(objects.c.doc).order_by(objects.c.last_seen.desc()).limit(max_objects)
            ).all()
            node_rows = conn.execute(
                sa.select(nodes.c.node_id, nodes.c.first_seen, nodes.c.doc)
                .order_by(nodes.c.last_seen.desc())
                .limit(max_nodes)
            ).all()
            event_rows = conn.execute(
                sa.select(events.c.key, events.c.ts, events.c.node, events.c.kind, events.c.text, events.c.level)
                .order_by(events.c.ts.desc(), events.c.seq.desc())
                .limit(max_events)
            ).all()
            rollout_rows = conn.execute(sa.select(rollouts.c.model, rollouts.c.release, rollouts.c.rollout)).all()
            retire_rows = conn.execute(
                sa.select(actions.c.target, actions.c.ts, actions.c.by, actions.c.detail)
                .where(actions.c.kind == "retire")
                .order_by(actions.c.ts)
            ).all()
            ack_rows = conn.execute(
                sa.select(actions.c.target, actions.c.ts, actions.c.by)
                .where(actions.c.kind == "ack")
                .order_by(actions.c.ts.desc())
                .limit(max_objects * 2)
            ).all()
            image_rows = conn.execute(
                sa.select(object_images.c.object_id, object_images.c.node, object_images.c.score, object_images.c.ts)
            ).all()
        node_docs = []
        for node_id, first_seen, doc in node_rows:
            record = json.loads(doc)
            record["id"], record["first_seen"] = node_id, first_seen
            node_docs.append(record)
        last_seen = {n["id"]: float(n.get("last_seen") or 0.0) for n in node_docs}
        retired = {}
        for target, ts, by, detail in retire_rows:
            if ts >= last_seen.get(target, 0.0):  # the node has not spoken since
                retired[target] = {"ts": ts, "by": by, "detail": detail}
            else:
                retired.pop(target, None)
        return Restored(
            objects=[json.loads(doc) for (doc,) in reversed(obj_rows)],
            nodes=node_docs,
            events=[
                {"key": k, "ts": ts, "node": n, "kind": kind, "text": text, "level": level}
                for k, ts, n, kind, text, level in reversed(event_rows)
            ],
            rollouts={model: (release, rollout) for model, release, rollout in rollout_rows},
            retired=retired,
            images={oid: {"node": n, "score": s, "ts": ts} for oid, n, s, ts in image_rows},
            acks={target: {"by": by, "ts": ts} for target, ts, by in ack_rows},  # newest first: the oldest wins
        )

    def image(self, object_id: str) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(
                sa.select(object_images.c.jpeg).where(object_images.c.object_id == object_id)
            ).scalar_one_or_none()

    def counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {
                t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0)
                for t in (objects, object_versions, events, nodes, rollouts, object_images, actions)
            }

    def object_versions(self, object_id: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(object_versions.c.doc)
                .where(object_versions.c.object_id == object_id)
                .order_by(object_versions.c.last_seen)
            ).all()
        return [json.loads(doc) for (doc,) in rows]

    # -- retention ------------------------------------------------------------------------

    def stored_bytes(self, conn: Connection | None = None) -> int:
        """What the rows hold (text and blobs, plus ROW_OVERHEAD each): the quantity ``max_bytes`` bounds.

        The same measure on SQLite and PostgreSQL (whose files do not shrink when rows go until a VACUUM).
        """
        if conn is None:
            with self.engine.connect() as c:
                return self.stored_bytes(c)
        total = 0
        for table, cols in _SIZED.items():
            length = sa.func.coalesce(sa.func.sum(sum(sa.func.coalesce(sa.func.length(c), 0) for c in cols)), 0)
            count = sa.func.count()
            size, n = conn.execute(sa.select(length, count).select_from(table)).one()
            total += int(size) + ROW_OVERHEAD * int(n)
        return total

    def file_bytes(self) -> int | None:
        """SQLite: the bytes the database's pages take (WAL checkpointed); PostgreSQL: None."""
        if self.dialect != "sqlite":
            return None
        with self.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            pages = conn.exec_driver_sql("PRAGMA page_count").scalar() or 0
            free = conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0
            size = conn.exec_driver_sql("PRAGMA page_size").scalar() or 0
        return int((pages - free) * size)

    def enforce_retention(self, now: float | None = None) -> dict[str, int]:
        """Delete what is older than ``max_age_s``, then the oldest rows until the stored bytes fit ``max_bytes``.

        Returns the rows deleted per table.
        """
        now = self.clock() if now is None else now
        self._last_retention = now
        cutoff = now - self.max_age_s
        deleted: dict[str, int] = {}
        with self.engine.begin() as conn:
            for table, column in (
                (events, events.c.ts),
                (object_versions, object_versions.c.received),
                (objects, objects.c.received),
                (object_images, object_images.c.received),
                (nodes, nodes.c.last_seen),
                (actions, actions.c.ts),
            ):
                n = conn.execute(sa.delete(table).where(column < cutoff)).rowcount
                if n:
                    deleted[table.name] = n
            for _ in range(20):  # each pass removes a share of the oldest rows, sized by how far over we are
                size = self.stored_bytes(conn)
                if size <= self.max_bytes:
                    break
                share = min(1.0, 1.0 - 0.9 * self.max_bytes / size)
                for table, order in _TRIM_ORDER:
                    count = int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() or 0)
                    take = max(1, int(count * share + 0.999)) if count else 0
                    if not take:
                        continue
                    key = table.c.seq if "seq" in table.c else table.c.object_id
                    oldest = sa.select(key).order_by(order).limit(take).scalar_subquery()
                    n = conn.execute(sa.delete(table).where(key.in_(oldest))).rowcount
                    deleted[table.name] = deleted.get(table.name, 0) + n
                # Latest objects whose every version went are gone from the mission too.
                kept = sa.select(object_versions.c.object_id)
                n = conn.execute(sa.delete(objects).where(objects.c.object_id.not_in(kept))).rowcount
                if n:
                    deleted["objects"] = deleted.get("objects", 0) + n
        if deleted:
            log.info("station store: retention deleted %s", ", ".join(f"{k}={v}" for k, v in sorted(deleted.items())))
        return deleted


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    """PostgreSQL text holds no NUL character: one in an untrusted string would fail the whole batch."""
    return {k: v.replace("\x00", "\ufffd") if isinstance(v, str) else v for k, v in row.items()}


_SIZED: dict[sa.Table, Iterable[sa.Column[Any]]] = {
    objects: [objects.c.doc],
    object_versions: [object_versions.c.doc],
    events: [events.c.text, events.c.kind, events.c.node],
    nodes: [nodes.c.doc],
    rollouts: [rollouts.c.release, rollouts.c.rollout],
    object_images: [object_images.c.jpeg],
    actions: [actions.c.detail],
}
# What goes first when the store is over its size: the bulk (history), oldest first; never the nodes or rollouts.
_TRIM_ORDER = [
    (events, events.c.ts),
    (object_versions, object_versions.c.received),
    (object_images, object_images.c.received),
]

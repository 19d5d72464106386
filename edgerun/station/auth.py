"""Operator accounts of the ground station: the password file, server-side sessions, CSRF tokens, login throttling.

The password file has one ``user:HASH`` line per operator, HASH an Argon2id string (PyNaCl,
libsodium's ``$argon2id$v=19$m=...`` format), mode 0600. ``edgerun station passwd USER`` writes it;
the station rereads it when it changes, so adding an operator needs no restart.

A session is a random 32-byte token in an ``HttpOnly; SameSite=Strict`` cookie (``Secure`` under TLS);
the station keeps only its SHA-256, with the user, a CSRF token and an expiry. Every POST of a
logged-in page carries the CSRF token in ``X-CSRF-Token``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import ConfigError

log = logging.getLogger(__name__)

USER_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
MIN_PASSWORD = 8
OPSLIMIT = 3  # Argon2id passes
MEMLIMIT = 64 * 1024 * 1024  # Argon2id memory (bytes): ~0.1 s a login on a small station
SESSION_TTL_S = 12 * 3600.0  # one shift
SESSION_IDLE_S = 2 * 3600.0  # a page left open keeps its session alive through its stream and polls
MAX_SESSIONS = 256
LOGIN_ATTEMPTS = 5  # per client address ...
LOGIN_WINDOW_S = 60.0  # ... per this many seconds


def check_user(name: str) -> str:
    if not USER_RE.match(name):
        raise ConfigError(f"user {name!r}: use 1-64 letters, digits or . _ @ -")
    return name


def hash_password(password: str) -> str:
    import nacl.pwhash.argon2id

    if len(password) < MIN_PASSWORD:
        raise ConfigError(f"password: at least {MIN_PASSWORD} characters")
    return nacl.pwhash.argon2id.str(password.encode(), opslimit=OPSLIMIT, memlimit=MEMLIMIT).decode()


def verify_password(hashed: str, password: str) -> bool:
    import nacl.exceptions
    import nacl.pwhash.argon2id

    try:
        return bool(nacl.pwhash.argon2id.verify(hashed.encode(), password.encode()))
    except (nacl.exceptions.InvalidkeyError, nacl.exceptions.CryptoError, ValueError):
        return False


# A hash to verify against when the user is unknown, so a wrong user name costs as long as a wrong password.
_DUMMY_HASH: str | None = None


def dummy_hash() -> str:
    global _DUMMY_HASH
    if _DUMMY_HASH is None:
        _DUMMY_HASH = hash_password(secrets.token_urlsafe(16))
    return _DUMMY_HASH


def parse_users(text: str, where: str) -> dict[str, str]:
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, hashed = line.partition(":")
        if not sep or not USER_RE.match(name) or not hashed.startswith("$argon2id$"):
            raise ConfigError(f"{where}:{number}: expected USER:$argon2id$... (write it with `edgerun station passwd`)")
        users[name] = hashed
    return users


def read_users(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"--users {path}: {err.strerror or err}") from None
    return parse_users(text, str(path))


def set_password(path: Path, user: str, password: str) -> bool:
    """Add or replace ``user``'s line; the file is rewritten atomically with mode 0600. True when it was new."""
    check_user(user)
    hashed = hash_password(password)
    users = read_users(path) if path.exists() else {}
    created = user not in users
    users[user] = hashed
    body = "".join(f"{name}:{value}\n" for name, value in sorted(users.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return created


class UserFile:
    """The password file, reread when its modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self.users: dict[str, str] = {}
        self.reload()
        if not self.users:
            raise ConfigError(
                f"--users {path}: no operator in it (add one with `edgerun station passwd USER --file {path}`)"
            )

    def reload(self) -> None:
        try:
            st = self.path.stat()
        except OSError as err:
            if self._stamp is None:
                raise ConfigError(f"--users {self.path}: {err.strerror or err}") from None
            return  # replaced right now: keep the accounts we know
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("station: %s is readable by others than its owner (chmod 600 it)", self.path)
        try:
            self.users = read_users(self.path)
        except ConfigError:
            if self._stamp is None:
                raise
            log.exception("station: %s is unreadable now; keeping the accounts read before", self.path)
            return
        self._stamp = stamp

    def lookup(self, user: str) -> str | None:
        self.reload()
        return self.users.get(user)


@dataclass
class Session:
    user: str
    csrf: str
    created: float
    seen: float


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Sessions:
    """Server-side sessions: the cookie holds a random token, the station its hash and what it stands for."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, idle_s: float = SESSION_IDLE_S) -> None:
        self.ttl_s, self.idle_s = ttl_s, idle_s
        self._by_digest: dict[str, Session] = {}

    def create(self, user: str, now: float | None = None) -> tuple[str, Session]:
        now = time.time() if now is None else now
        self._expire(now)
        while len(self._by_digest) >= MAX_SESSIONS:  # the oldest goes first
            oldest = min(self._by_digest, key=lambda d: self._by_digest[d].created)
            del self._by_digest[oldest]
        token = secrets.token_urlsafe(32)  # 32 random bytes
        session = Session(user=user, csrf=secrets.token_urlsafe(32), created=now, seen=now)
        self._by_digest[_digest(token)] = session
        return token, session

    def get(self, token: str | None, now: float | None = None) -> Session | None:
        if not token or len(token) > 128:
            return None
        now = time.time() if now is None else now
        digest = _digest(token)
        session = self._by_digest.get(digest)
        if session is None:
            return None
        if now - session.created > self.ttl_s or now - session.seen > self.idle_s:
            del self._by_digest[digest]
            return None
        session.seen = now
        return session

    def drop(self, token: str | None) -> None:
        if token:
            self._by_digest.pop(_digest(token), None)

    def _expire(self, now: float) -> None:
        for digest, s in list(self._by_digest.items()):
            if now - s.created > self.ttl_s or now - s.seen > self.idle_s:
                del self._by_digest[digest]


def csrf_ok(session: Session, sent: str | None) -> bool:
    return bool(sent) and hmac.compare_digest(session.csrf.encode(), (sent or "").encode())


class LoginThrottle:
    """At most ``attempts`` logins per client address per ``window_s`` (a sliding window)."""

    def __init__(self, attempts: int = LOGIN_ATTEMPTS, window_s: float = LOGIN_WINDOW_S) -> None:
        self.attempts, self.window_s = attempts, window_s
        self._seen: dict[str, deque[float]] = {}

    def allow(self, client: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if len(self._seen) > 4096:  # bounded: forget addresses whose window has passed
            for key in [k for k, q in self._seen.items() if not q or now - q[-1] > self.window_s]:
                del self._seen[key]
        times = self._seen.setdefault(client, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.attempts:
            return False
        times.append(now)
        return True

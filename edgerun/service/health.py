"""The node's health: one derived state plus the reasons behind it.

Parts of the node report problems by key ("source", "sink.mqtt", "engine",
"pipeline") from whatever thread sees them; the state is derived from those, so
no part can overwrite another's problem and recovery of one part does not hide
a problem in another. Listeners (event publishing) run on the event loop
through the ``notify`` hook, because the capture thread is a common caller.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Literal

log = logging.getLogger(__name__)

State = Literal["starting", "running", "degraded", "stopping"]
Listener = Callable[[str, dict[str, str]], None]
# loop.call_soon_threadsafe fits: notify(callback, *args) schedules callback(*args) on the loop.
Notify = Callable[..., Any]


class Health:
    """Thread-safe node state: ``stopping > degraded (any problem) > starting > running``.

    A problem makes the node ``degraded`` even before its first inference: a node whose
    camera is missing at boot is up and retrying, and must say why rather than look as
    if it were still loading. ``ready`` needs a first inference as well as no stop.
    """

    def __init__(self, notify: Notify | None = None) -> None:
        self._lock = threading.Lock()
        self._notify = notify
        self._running = False
        self._stopping = False
        self._problems: dict[str, str] = {}
        self._state: State = "starting"
        self._since = time.monotonic()
        self._announced_reasons: dict[str, str] = {}
        # Called with (state, reasons) when either changes; on the loop when ``notify`` is given,
        # otherwise synchronously in the thread that made the change.
        self.on_change: list[Listener] = []

    # -- changes, from any thread ----------------------------------------------

    def mark_running(self) -> None:
        """The first inference went through: the node is doing its job."""
        with self._lock:
            self._running = True
            pending = self._commit()
        self._deliver_now(pending)

    def mark_stopping(self) -> None:
        """Shutdown began; this state is final."""
        with self._lock:
            self._stopping = True
            pending = self._commit()
        self._deliver_now(pending)

    def set_problem(self, key: str, reason: str) -> None:
        """Record (or re-word) the problem of one part; the node is degraded while any is set."""
        with self._lock:
            self._problems[key] = reason
            pending = self._commit()
        self._deliver_now(pending)

    def clear_problem(self, key: str) -> None:
        """The part under ``key`` recovered; clearing an unknown key is a no-op."""
        with self._lock:
            self._problems.pop(key, None)
            pending = self._commit()
        self._deliver_now(pending)

    # -- reads -----------------------------------------------------------------

    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    @property
    def reasons(self) -> dict[str, str]:
        """A copy of the current problems, key -> reason."""
        with self._lock:
            return dict(self._problems)

    @property
    def ready(self) -> bool:
        """Has inferred and is not stopping (running, or degraded after the first inference)."""
        with self._lock:
            return self._running and not self._stopping

    @property
    def since(self) -> float:
        """``time.monotonic()`` of the last change of the derived state."""
        with self._lock:
            return self._since

    def to_json(self) -> dict[str, Any]:
        """The probe body: state, readiness, reasons and seconds spent in this state."""
        with self._lock:
            state, reasons, since = self._state, dict(self._problems), self._since
            ready = self._running and not self._stopping
        return {
            "state": state,
            "ready": ready,
            "reasons": reasons,
            "since_s": round(time.monotonic() - since, 3),
        }

    # -- internals -------------------------------------------------------------

    def _derive(self) -> State:
        if self._stopping:
            return "stopping"
        if self._problems:
            return "degraded"
        return "running" if self._running else "starting"

    def _commit(self) -> tuple[str, dict[str, str]] | None:
        """Under the lock: derive the state; return what to deliver synchronously, if anything."""
        state = self._derive()
        if state == self._state and self._problems == self._announced_reasons:
            return None
        if state != self._state:
            self._state, self._since = state, time.monotonic()
            log.info("health: %s%s", state, _describe(self._problems))
        self._announced_reasons = dict(self._problems)
        reasons = dict(self._problems)
        if self._notify is None:
            return state, reasons
        # Scheduled under the lock so listeners see changes in the order they happened.
        try:
            self._notify(self._deliver, state, reasons)
        except RuntimeError:
            log.debug("health change to %s not delivered: the loop is closed", state)
        return None

    def _deliver_now(self, pending: tuple[str, dict[str, str]] | None) -> None:
        if pending is not None:
            self._deliver(*pending)

    def _deliver(self, state: str, reasons: dict[str, str]) -> None:
        for listener in list(self.on_change):
            try:
                listener(state, dict(reasons))
            except Exception:
                # one broken listener must not starve the others of health events
                log.exception("health listener %r failed", listener)


def _describe(problems: dict[str, str]) -> str:
    if not problems:
        return ""
    return " (" + "; ".join(f"{key}: {reason}" for key, reason in sorted(problems.items())) + ")"

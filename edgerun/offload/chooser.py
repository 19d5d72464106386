"""Which neighbour this node offloads to: the lowest estimated latency, with hysteresis and per-helper backoff.

Sans-I/O: the caller passes the candidates (``capabilities.candidates_from_members``) and the time, and reports
how each helper did (``failed``/``succeeded``); nothing here reads a clock or a socket, so the same code runs in
the node, in the simulator and in deterministic tests.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["HelperCandidate", "HelperChooser", "estimated_latency_ms"]


@dataclass
class HelperCandidate:
    """A live member that serves this node's model (by hash), as its metadata and our probes describe it."""

    name: str
    addr: tuple[str, int]  # the member's gossip host, its offload port
    spare_fps: float
    infer_ms: float
    queue: int
    rtt_ms: float | None


def estimated_latency_ms(candidate: HelperCandidate) -> float:
    """Round trip, then the frames queued ahead of ours, then ours (the helper's engine time each); no rtt: inf."""
    if candidate.rtt_ms is None:
        return float("inf")
    return candidate.rtt_ms + candidate.infer_ms + candidate.queue * candidate.infer_ms


@dataclass
class _Backoff:
    delay_s: float
    until: float


class HelperChooser:
    """``choose`` the helper to send to now; ``failed``/``succeeded`` after each attempt.

    * a new helper must have spare capacity (spare_fps > 0) and a measured round trip;
    * the current one is kept while it is still a candidate (its spare capacity may be zero: that is our own
      frames using it; when it is really full it answers "busy", which the caller reports as a failure) unless
      another's estimate is lower by more than ``better_by`` of the current one's and the current one has
      been held ``hold_s``: two helpers whose estimates cross back and forth within that margin do not flap;
    * a failed helper is dropped at once and skipped for ``backoff_s``, doubled on each further failure up to
      ``backoff_max_s``; failures during its backoff are the same outage (a connection lost with four frames in
      flight fails four requests at once), a success resets it.
    """

    def __init__(
        self, *, hold_s: float = 10.0, better_by: float = 0.3, backoff_s: float = 2.0, backoff_max_s: float = 60.0
    ) -> None:
        if hold_s < 0 or not 0 <= better_by < 1:
            raise ValueError(f"hold_s must be >= 0 and better_by within [0, 1), got {hold_s}, {better_by}")
        if not 0 < backoff_s <= backoff_max_s:
            raise ValueError(f"need 0 < backoff_s <= backoff_max_s, got {backoff_s}, {backoff_max_s}")
        self.hold_s = hold_s
        self.better_by = better_by
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.current: str | None = None
        self.stats: dict[str, int] = {"switches": 0, "failures": 0}
        self.failures: Counter[str] = Counter()  # by reason
        self._since = 0.0
        self._backoff: dict[str, _Backoff] = {}

    def choose(self, candidates: list[HelperCandidate], now: float) -> HelperCandidate | None:
        """The helper to send the next frame to, or None (serve locally)."""
        usable = [c for c in candidates if c.rtt_ms is not None and not self._backed_off(c.name, now)]
        current = next((c for c in usable if c.name == self.current), None)
        fresh = [c for c in usable if c.spare_fps > 0]
        # ties go to the name, so every node of a swarm breaks them the same way whatever the gossip order
        best = min(fresh, key=lambda c: (estimated_latency_ms(c), c.name), default=None)
        if current is not None:
            if best is None or best.name == current.name or now - self._since < self.hold_s:
                return current
            if estimated_latency_ms(best) >= (1.0 - self.better_by) * estimated_latency_ms(current):
                return current
        if best is None:
            self.current = None
            return None
        if best.name != self.current:
            self.stats["switches"] += 1
            self.current, self._since = best.name, now
        return best

    def failed(self, name: str, now: float, reason: str) -> None:
        """A request to ``name`` failed (lost, refused, late, busy, ...): skip it until its backoff ends."""
        self.stats["failures"] += 1
        self.failures[reason] += 1
        if self.current == name:
            self.current = None  # dropped at once: the next choose() serves locally or picks another
        backoff = self._backoff.get(name)
        if backoff is not None and now < backoff.until:
            return
        delay = self.backoff_s if backoff is None else min(backoff.delay_s * 2.0, self.backoff_max_s)
        self._backoff[name] = _Backoff(delay, now + delay)

    def succeeded(self, name: str) -> None:
        """A reply came back from ``name``: its next failure starts from the first backoff again."""
        self._backoff.pop(name, None)

    def backoff_until(self, name: str) -> float | None:
        """When ``name`` may be chosen again after a failure, None when it is not backed off (for the status)."""
        backoff = self._backoff.get(name)
        return None if backoff is None else backoff.until

    def _backed_off(self, name: str, now: float) -> bool:
        backoff = self._backoff.get(name)
        return backoff is not None and now < backoff.until

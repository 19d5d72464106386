"""Lifeguard's suspicion timer as memberlist implements it (suspicion.go, util.go): a suspicion starts at its
maximum timeout and shrinks towards the minimum as independent members confirm it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Suspicion:
    """One suspicion timer: starts at ``max_s`` and shrinks towards ``min_s`` with independent confirmations."""

    k: int
    min_s: float
    max_s: float
    start: float
    deadline: float
    confirmations: set[str]
    n: int = 0
    tell_at: float = math.inf  # when to tell the suspect (again) that we suspect it (Membership._suspicion_timeouts)

    def confirm(self, source: str, now: float) -> bool:
        if self.n >= self.k or source in self.confirmations:
            return False
        self.confirmations.add(source)
        self.n += 1
        # Already past the shrunken deadline: fire now (memberlist calls the timeout function directly).
        self.deadline = max(self.start + remaining_suspicion_time(self.n, self.k, self.min_s, self.max_s), now)
        return True


def remaining_suspicion_time(n: int, k: int, min_s: float, max_s: float) -> float:
    """Total suspicion timeout after ``n`` of the ``k`` wanted confirmations (memberlist suspicion.go)."""
    frac = math.log(n + 1.0) / math.log(k + 1.0)
    raw = max_s - frac * (max_s - min_s)
    return max(math.floor(1000.0 * raw) / 1000.0, min_s)


def suspicion_timeout(suspicion_mult: int, n: int, interval_s: float) -> float:
    """The minimum suspicion timeout: ``mult * max(1, log10(n)) * probe interval`` (memberlist util.go)."""
    return suspicion_mult * max(1.0, math.log10(max(1.0, float(n)))) * interval_s

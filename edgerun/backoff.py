"""Retry delays: exponential, capped and jittered, shared by everything that reconnects (MQTT, cameras).

Full jitter (AWS architecture blog, "Exponential Backoff And Jitter"): many nodes that lost the same broker
or camera server at once do not come back in lockstep.
"""

from __future__ import annotations

from typing import Callable


def backoff_delay(attempt: int, base_s: float, cap_s: float, rand: Callable[[float, float], float]) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return rand(0.0, min(cap_s, base_s * (2.0 ** min(attempt, 30))))

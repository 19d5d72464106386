"""Swarm: gossip membership (SWIM + Lifeguard), transport and keyring, ground geometry, detection dedup.

Stands alone: nothing here imports ``edgerun``, so a ground station or another runtime can use it.
Protocol logic is sans-I/O with the clock passed in (``now``, seconds, monotonic).
"""

from __future__ import annotations

"""Claims are bound to their gossip sender: two real FleetMembers over UDP/TCP on 127.0.0.1.

A member that gossips a claim naming another node (speaking for it) has the claim dropped and
counted as ``forged`` by the receiver; its own claims are accepted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from edgerun.config import SwarmConfig, SwarmTimingConfig
from edgerun.fleet.member_meta import MemberMeta
from edgerun.fleet.service import FleetMember
from swarm.dedup import Claim, encode_claim
from swarm.keyring import Keyring, generate_key

pytestmark = pytest.mark.timeout(120)

# memberlist's LAN timers shrunk so the two members meet and gossip within a second or two.
FAST = SwarmTimingConfig(probe_interval_s=0.2, probe_timeout_s=0.1, gossip_interval_s=0.05, push_pull_interval_s=2.0)


def _claim(node: str, track: int) -> bytes:
    now_ms = int(time.time() * 1000)
    return encode_claim(Claim(node, track, "person", 531170000, -41300000, 1000, 8, now_ms, 500, 900, False))


async def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def _member(name: str, key_file: Path, seeds: list[str]) -> FleetMember:
    cfg = SwarmConfig(enabled=True, bind="127.0.0.1:0", seeds=seeds, key_file=str(key_file), timing=FAST)

    def ignore(*_: Any) -> None:
        return None

    return FleetMember(cfg, name, publish_object=ignore, publish_event=ignore, meta=lambda: MemberMeta())


async def _run(key_file: Path) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    honest = _member("alpha", key_file, [])
    await honest.start()
    liar: FleetMember | None = None
    try:
        host, port = honest.agent.address
        liar = _member("bravo", key_file, [f"{host}:{port}"])
        await liar.start()
        assert await _until(lambda: len(honest.members()) == 2 and len(liar.members()) == 2)
        # bravo speaks for a third node, then for alpha itself, then for itself
        liar.agent.queue_broadcast(b"forged-1", _claim("charlie", 1))
        liar.agent.queue_broadcast(b"forged-2", _claim("alpha", 2))
        liar.agent.queue_broadcast(b"genuine", _claim("bravo", 3))
        stats = honest.dedup.stats
        assert await _until(lambda: stats.claims_received >= 1 and stats.dropped.get("forged", 0) >= 2)
        await asyncio.sleep(0.5)  # anything more that was going to arrive has arrived
        held = sorted(honest.dedup._peers.get("bravo", {}))
        return stats.as_dict(), [("bravo", t) for t in held]
    finally:
        if liar is not None:
            await liar.stop()
        await honest.stop()


def test_a_claim_naming_another_node_is_dropped_and_counted(tmp_path: Path) -> None:
    key_file = tmp_path / "swarm.key"
    Keyring([generate_key()]).save(key_file)
    stats, held = asyncio.run(_run(key_file))
    assert stats["dropped"].get("forged") == 2, stats
    assert "own" not in stats["dropped"], stats  # a claim naming the receiver is forged too, not "own"
    assert stats["claims_received"] == 1, stats
    assert held == [("bravo", 3)]

"""Helper candidates from a real swarm: SwarmAgents on loopback (UDP/TCP, sealed with a keyring) gossip their
offload capabilities in member metadata; the origin reads them with its probe round trips and chooses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from edgerun.fleet.member_meta import MemberMeta, encode_meta
from edgerun.offload.capabilities import candidates_from_members
from edgerun.offload.chooser import HelperChooser
from swarm.agent import SwarmAgent
from swarm.config import SwarmTiming
from swarm.keyring import Keyring, generate_key

HASH = "0123456789abcdef"
# memberlist's LAN timing scaled down about 5x, as the swarm's agent tests run it
FAST = SwarmTiming(
    probe_interval_s=0.2,
    probe_timeout_s=0.1,
    gossip_interval_s=0.05,
    suspicion_mult=3,
    push_pull_interval_s=2.0,
    join_retry_s=0.3,
    tcp_timeout_s=1.0,
    gossip_to_the_dead_s=5.0,
)

pytestmark = pytest.mark.timeout(120)


async def until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def serving(model_hash: str, port: int, spare: float) -> bytes:
    meta = MemberMeta(model="pose_detector", serve_hash=model_hash, serve_port=port, spare_fps=spare, infer_ms=30.0)
    return encode_meta(meta)


def test_an_origin_finds_the_neighbour_serving_its_model_and_loses_it_when_it_stops(no_thread_left_behind):
    async def scenario() -> None:
        key = generate_key()
        origin = SwarmAgent("origin", ("127.0.0.1", 0), FAST, Keyring([key]), meta=encode_meta(MemberMeta()))
        seed = await origin.start()
        helper = SwarmAgent(
            "helper", ("127.0.0.1", 0), FAST, Keyring([key]), meta=serving(HASH, 7950, 12.0), seeds=[seed]
        )
        other = SwarmAgent(
            "other", ("127.0.0.1", 0), FAST, Keyring([key]), meta=serving("fedcba9876543210", 7951, 50.0), seeds=[seed]
        )
        chooser = HelperChooser()

        def candidates() -> list:
            return candidates_from_members(origin.members(), "origin", HASH, origin.rtt_ms)

        try:
            await helper.start()
            await other.start()
            # the helper is a candidate once its metadata arrived and one direct probe of it was answered
            await until(lambda: [(c.name, c.rtt_ms is not None) for c in candidates()] == [("helper", True)], 20)
            (found,) = candidates()
            assert found.addr == ("127.0.0.1", 7950) and found.spare_fps == 12.0 and found.infer_ms == 30.0
            chosen = chooser.choose(candidates(), time.monotonic())
            assert chosen is not None and chosen.name == "helper"

            helper.set_meta(serving("", 0, 0.0))  # stops serving (the node gossips that at once): no candidate left
            await until(lambda: candidates() == [], 20)
            assert chooser.choose(candidates(), time.monotonic()) is None

            helper.set_meta(serving(HASH, 7950, 12.0))
            await until(lambda: [c.name for c in candidates()] == ["helper"], 20)
            await helper.stop(leave=True)
            await until(lambda: candidates() == [] and origin.rtt_ms("helper") is None, 20)
        finally:
            for agent in (origin, helper, other):
                await agent.stop(leave=False)

    asyncio.run(scenario())

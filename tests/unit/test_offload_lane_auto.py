"""``offload.mode = "auto"``: when the lane engages a helper, from the source's rate against the local engine's.

The lane is driven through ``update`` as the node's loop drives it once a second; no helper is offered, so only
the decision to want one (``engaged``) is looked at.
"""

from __future__ import annotations

import asyncio

import pytest

from edgerun.config import OffloadConfig
from edgerun.offload.client import OffloadClient
from edgerun.offload.lane import OffloadLane
from edgerun.pipeline.admission import EngineSlots
from swarm.keyring import Keyring, generate_key


@pytest.fixture
def lane():
    loop = asyncio.new_event_loop()
    client = OffloadClient(Keyring([generate_key()]), "weak")
    try:
        yield OffloadLane(OffloadConfig(mode="auto"), client, loop, EngineSlots(1, 5), model_hash=lambda: "0" * 16)
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def test_auto_engages_above_engage_load_and_lets_go_below_release_load(lane):
    lane.update([], 1.0, local_capacity_fps=10.0, source_fps=8.0)  # 0.8: between release (0.7) and engage (0.9)
    assert not lane.engaged
    lane.update([], 2.0, local_capacity_fps=10.0, source_fps=9.5)
    assert lane.engaged and lane.load == pytest.approx(0.95)
    lane.update([], 3.0, local_capacity_fps=10.0, source_fps=8.0)  # hysteresis: still above release_load
    assert lane.engaged
    lane.update([], 4.0, local_capacity_fps=10.0, source_fps=6.0)
    assert not lane.engaged


def test_auto_does_not_engage_for_a_source_that_delivers_nothing(lane):
    """The module docstring: auto uses a helper "while the source delivers more than engage_load of what the
    local engine can do". A source that delivered no frame yet (start-up, a camera gone) delivers no more than
    anything; every node in auto mode logs the opposite in its first second (seen in the offload bench)."""
    lane.update([], 1.0, local_capacity_fps=0.0, source_fps=0.0)
    assert not lane.engaged

"""The node's metadata rule drives the real gossip: two FleetMembers over UDP/TCP on 127.0.0.1.

A far move of alpha's camera goes out as a quiet update (a new incarnation, no broadcast): bravo learns it
from a push-pull; a model change goes out urgent (broadcast). Timers shrunk so push-pull runs every 2 s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from edgerun.config import SwarmConfig, SwarmTimingConfig
from edgerun.fleet.member_meta import MemberMeta, decode_meta
from edgerun.fleet.service import META_FAR_M, FleetMember
from edgerun.testing.ports import free_tcp_udp_port
from swarm.keyring import Keyring, generate_key

pytestmark = pytest.mark.timeout(120)

FAST = SwarmTimingConfig(probe_interval_s=0.2, probe_timeout_s=0.1, gossip_interval_s=0.05, push_pull_interval_s=2.0)


async def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def _member(name: str, key_file: Path, seeds: list[str], meta: Callable[[], MemberMeta]) -> FleetMember:
    cfg = SwarmConfig(
        enabled=True,
        bind=f"127.0.0.1:{free_tcp_udp_port()}",
        seeds=seeds,
        key_file=str(key_file),
        timing=FAST,
        meta_interval_s=0.1,
    )

    def ignore(*_: Any) -> None:
        return None

    return FleetMember(cfg, name, publish_object=ignore, publish_event=ignore, meta=meta)


def _seen_by(member: FleetMember, name: str) -> tuple[int, MemberMeta | None]:
    found = next((m for m in member.members() if m.name == name), None)
    return (0, None) if found is None else (found.incarnation, decode_meta(found.meta))


async def _run(key_file: Path) -> dict[str, Any]:
    pose = MemberMeta(model="pose_detector", version=1, engine="tflite", health="ok", east=0.0, north=0.0, yaw=0.0)
    alpha = _member("alpha", key_file, [], lambda: pose)
    await alpha.start()
    bravo: FleetMember | None = None
    out: dict[str, Any] = {}
    try:
        host, port = alpha.agent.address
        bravo = _member("bravo", key_file, [f"{host}:{port}"], lambda: MemberMeta(model="pose_detector"))
        await bravo.start()
        assert await _until(lambda: (_seen_by(bravo, "alpha")[1] or MemberMeta()).model == "pose_detector")
        stats = alpha.agent.membership.stats
        merges_before = bravo.agent.membership.stats["quiet_merges"]

        pose = MemberMeta(**{**pose.to_json(), "east": META_FAR_M + 5.0})  # far: quiet, at once
        assert await _until(lambda: stats["quiet_updates"] == 1)
        quiet_incarnation = alpha.agent.membership.incarnation
        assert await _until(lambda: _seen_by(bravo, "alpha")[0] == quiet_incarnation)
        out["quiet_seen"] = _seen_by(bravo, "alpha")[1]
        out["quiet_merges"] = bravo.agent.membership.stats["quiet_merges"] - merges_before

        pose = MemberMeta(**{**pose.to_json(), "model": "other_model"})  # urgent
        assert await _until(lambda: (_seen_by(bravo, "alpha")[1] or MemberMeta()).model == "other_model")
        out["quiet_updates"] = stats["quiet_updates"]
        return out
    finally:
        if bravo is not None:
            await bravo.stop()
        await alpha.stop()


def test_a_far_move_goes_out_quietly_and_a_model_change_urgently(tmp_path: Path) -> None:
    key_file = tmp_path / "swarm.key"
    Keyring([generate_key()]).save(key_file)
    out = asyncio.run(_run(key_file))
    seen = out["quiet_seen"]
    assert seen is not None and seen.east == META_FAR_M + 5.0 and seen.model == "pose_detector"
    assert out["quiet_merges"] >= 1  # bravo had it from a push-pull: nothing gossiped it
    assert out["quiet_updates"] == 1  # the model change was no quiet update

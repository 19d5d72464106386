"""Rollout cohorts, re-signed steps a node would accept or refuse, the signed rollout state, and the canary judge."""

from __future__ import annotations

import base64
import json
import time

import pytest

from edgerun.fleet.rollout import (
    RolloutState,
    check_signing_key,
    decode_state,
    encode_state,
    resign,
)
from edgerun.ota.errors import OtaError, Rejected
from edgerun.ota.manifest import Rollout, cohort_position, in_rollout, parse_manifest
from edgerun.ota.minisign import SecretKey
from edgerun.ota.transport import Offer
from edgerun.ota.trust import TrustStore
from edgerun.station.canary import CanaryPolicy, judge
from edgerun.station.model import NodeView
from tests.unit.test_ota_release import Fleet

NODES = [f"drone-{i}" for i in range(1000)]


def _in(percent: float, salt: str, node: str) -> bool:
    return in_rollout(Rollout(percent=percent, salt=salt), node)


def test_cohorts_are_nested_as_the_percentage_grows():
    salt = "blazeface_short-v2"
    previous: set[str] = set()
    for percent in (1, 10, 25, 50, 90, 100):
        cohort = {n for n in NODES if _in(percent, salt, n)}
        assert previous <= cohort, f"a node left the cohort going to {percent}%"
        previous = cohort
    assert previous == set(NODES)
    assert not any(_in(0, salt, n) for n in NODES)  # a halt takes nobody


def test_cohort_sizes_follow_the_percentage_and_salts_reshuffle():
    ten_a = {n for n in NODES if _in(10, "a", n)}
    ten_b = {n for n in NODES if _in(10, "b", n)}
    assert 60 <= len(ten_a) <= 140 and 60 <= len(ten_b) <= 140
    assert len(ten_a & ten_b) < 40  # another release, another canary


def test_the_cohort_hash_is_stable_across_versions():
    """Nodes and stations of different releases must agree on who is in a cohort: the hash is pinned."""
    ten = [n for n in NODES[:100] if cohort_position("s", n) < 10]
    assert ten == [
        "drone-13",
        "drone-21",
        "drone-23",
        "drone-24",
        "drone-25",
        "drone-39",
        "drone-44",
        "drone-52",
        "drone-55",
        "drone-56",
        "drone-64",
        "drone-68",
        "drone-86",
        "drone-98",
    ]
    assert [n for n in NODES[:100] if _in(10, "s", n)] == ten


def _verify(fleet: Fleet, offer: Offer):
    store = TrustStore([k.public_key for k in fleet.root_keys])
    keyring = store.verify_keys(offer.keys, offer.keys_sig, time.time(), None)
    return store.verify_manifest(offer.manifest, offer.manifest_sig, keyring)


def test_promote_and_halt_are_signed_manifests_a_node_verifies(released):
    fleet, offer = released
    key = fleet.release_keys[0]
    promoted = _verify(fleet, resign(offer, 50.0, key))
    assert (promoted.version, promoted.rollout.percent, promoted.rollout.salt) == (2, 50.0, "canary-salt")
    original = parse_manifest(offer.manifest)
    assert promoted.target == original.target and promoted.expires == original.expires
    halted = _verify(fleet, resign(offer, 0.0, key))
    assert halted.rollout.percent == 0.0
    assert not any(in_rollout(halted.rollout, n) for n in NODES)


def test_a_step_signed_by_another_key_is_refused_by_nodes_and_by_the_station(released):
    fleet, offer = released
    stranger = SecretKey.generate()
    forged = resign(offer, 100.0, stranger)
    with pytest.raises(Rejected) as err:
        _verify(fleet, forged)
    assert err.value.code == "unknown_key"
    with pytest.raises(Rejected, match="is not a release key in keys.json"):
        check_signing_key(offer, stranger)
    check_signing_key(offer, fleet.release_keys[0])
    # a percent edited into the signed manifest breaks its signature
    tampered = Offer(
        offer.source,
        offer.manifest.replace(b'"percent":10.0', b'"percent":100.0'),
        offer.manifest_sig,
        offer.keys,
        offer.keys_sig,
    )
    assert tampered.manifest != offer.manifest
    with pytest.raises(Rejected) as err:
        _verify(fleet, tampered)
    assert err.value.code == "bad_signature"


def test_resign_refuses_a_bad_percent(released):
    fleet, offer = released
    with pytest.raises(OtaError, match="within 0..100"):
        resign(offer, 150.0, fleet.release_keys[0])


def test_rollout_state_round_trips_and_a_forgery_is_not_verified():
    key, other = SecretKey.generate(), SecretKey.generate()
    state = RolloutState(
        model="m",
        version=3,
        percent=10.0,
        salt="s",
        phase="halted",
        reason="fps regression",
        by="auto",
        ts=time.time(),
        base_version=2,
    )
    payload = encode_state(state, key)
    trusted = {key.public_key.id_hex: key.public_key}
    signed = decode_state(payload, trusted)
    assert signed.state == state and signed.verified and signed.key_id == key.public_key.id_hex
    assert not decode_state(encode_state(state, other), trusted).verified
    env = json.loads(payload)
    doc = json.loads(base64.b64decode(env["state"]))
    doc["phase"] = "complete"
    env["state"] = base64.b64encode(json.dumps(doc).encode()).decode()
    assert not decode_state(json.dumps(env).encode(), trusted).verified
    for bad in (b"{}", b"x" * 20000, b"not json", json.dumps({"schema": "edgerun.rollout/1", "state": "@@"}).encode()):
        with pytest.raises(ValueError):
            decode_state(bad, trusted)


# -- the canary judge -----------------------------------------------------------------------------------------

NOW = 1_800_000_000.0


def node(
    name: str,
    version: int,
    fps: float | None = 10.0,
    rate: float | None = 0.5,
    outcome: str | None = None,
    status: str = "online",
) -> NodeView:
    n = NodeView(
        name,
        status=status,
        health="running",
        model="m",
        model_version=version,
        fps=fps,
        detection_rate=rate,
        last_seen=NOW,
    )
    if outcome:
        n.ota_outcomes[2] = outcome
    return n


def test_a_healthy_canary_is_not_halted():
    nodes = [node("a", 2, outcome="committed"), node("b", 1), node("c", 1, fps=11.0)]
    verdict = judge("m", 2, nodes, NOW, 15.0)
    assert not verdict.halt and verdict.figures["canary_fps"] == 10.0 and verdict.figures["baseline_fps"] == 10.5


def test_rollbacks_above_the_rate_halt():
    nodes = [node("a", 1, outcome="rolled_back"), node("b", 2, outcome="committed"), node("c", 1), node("d", 1)]
    verdict = judge("m", 2, nodes, NOW, 15.0, CanaryPolicy(max_failure_rate=0.34))
    assert verdict.halt and verdict.reason.startswith("1 of 2 canary nodes rolled back or could not run v2")
    assert not judge("m", 2, nodes, NOW, 15.0, CanaryPolicy(max_failure_rate=0.5)).halt


def test_fps_regression_against_nodes_not_updated_halts():
    nodes = [node("a", 2, fps=4.0), node("b", 1, fps=10.0), node("c", 1, fps=9.0)]
    verdict = judge("m", 2, nodes, NOW, 15.0)
    assert verdict.halt and "fps 4.0 on v2 against 9.5" in verdict.reason


def test_detection_rate_regression_halts_only_when_the_baseline_sees_enough():
    nodes = [node("a", 2, rate=0.1), node("b", 1, rate=0.6)]
    assert judge("m", 2, nodes, NOW, 15.0).halt
    quiet = [node("a", 2, rate=0.0), node("b", 1, rate=0.01)]
    assert not judge("m", 2, quiet, NOW, 15.0).halt


def test_dead_nodes_other_models_and_missing_rates_do_not_count():
    nodes = [node("a", 2, fps=1.0, status="offline"), node("b", 1), node("c", 2, fps=None, rate=None)]
    other = NodeView("x", status="online", model="other", model_version=1, fps=50.0, last_seen=NOW)
    verdict = judge("m", 2, [*nodes, other], NOW, 15.0)
    assert not verdict.halt and verdict.figures["canary_nodes"] == 0 and verdict.figures["baseline_nodes"] == 1


# -- the node's gate between chunks ---------------------------------------------------------------------------


def test_the_download_gate_stops_only_for_a_signed_step_that_drops_this_node(released):
    from edgerun.ota.rollout_gate import halted_for

    fleet, offer = released
    key = fleet.release_keys[0]
    inside = next(n for n in NODES if cohort_position("canary-salt", n) < 10)
    outside_at_5 = next(n for n in NODES if 5 <= cohort_position("canary-salt", n) < 10)
    halted = resign(offer, 0.0, key)
    assert "no longer this node" in halted_for(inside, offer, halted)
    assert halted_for(inside, offer, resign(offer, 50.0, key)) is None  # promoted: still in
    assert "5%" in halted_for(outside_at_5, offer, resign(offer, 5.0, key))  # narrowed below it
    assert halted_for(inside, offer, resign(offer, 0.0, SecretKey.generate())) is None  # forged
    assert halted_for(inside, offer, offer) is None
    unsigned = Offer("x", halted.manifest, offer.manifest_sig, offer.keys, offer.keys_sig)
    assert halted_for(inside, offer, unsigned) is None
    assert halted_for("", offer, halted) is None  # no node id: no gate


def test_a_release_that_will_not_warm_up_counts_and_a_dropped_download_does_not():
    from edgerun.station.model import FleetModel

    m = FleetModel()
    for name, step, code in (("a", "rejected", "warmup_failed"), ("b", "failed", None), ("c", "committed", None)):
        m.ingest(
            f"edgerun/{name}/metrics",
            json.dumps(
                {
                    "schema": "edgerun.metrics/1",
                    "node": name,
                    "ts": NOW,
                    "summary": {"model": "m", "model_version": 2 if step == "committed" else 1},
                }
            ).encode(),
            NOW,
        )
        event = {"schema": "edgerun.event/1", "node": name, "kind": "ota", "step": step, "version": 2}
        if code:
            event["code"] = code
        m.ingest(f"edgerun/{name}/events", json.dumps(event).encode(), NOW)
    assert m.nodes["a"].ota_outcomes == {2: "rejected:warmup_failed"} and m.nodes["b"].ota_outcomes == {}
    verdict = judge("m", 2, m.nodes.values(), NOW, 15.0)
    assert verdict.figures["attempted"] == 2 and verdict.figures["failed"] == 1 and verdict.halt


def test_a_deeply_nested_rollout_message_is_a_value_error():
    deep = b"[" * 5000 + b"]" * 5000
    env = json.dumps(
        {
            "schema": "edgerun.rollout/1",
            "state": base64.b64encode(deep).decode(),
            "sig": SecretKey.generate().sign(deep).to_text(),
        }
    ).encode()
    with pytest.raises(ValueError):
        decode_state(env)
    with pytest.raises(ValueError):
        decode_state(b"[" * 8000 + b"]" * 8000)


def test_a_deeply_nested_release_message_is_a_transport_error_on_the_node():
    from edgerun.ota.transport import TransportError
    from edgerun.ota.transport_mqtt import decode_release

    with pytest.raises(TransportError, match="malformed release message"):
        decode_release(b"[" * 100_000 + b"]" * 100_000, "edgerun/fleet/releases/m")

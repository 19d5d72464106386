"""The station's release check (edgerun.fleet.trusted_release) and the step ledger (edgerun.ota.steps).

Each case is a retained release message an attacker on the broker could send; the verifier must call it what
a node would, and ``RolloutControl.step`` must refuse to sign anything but a verified release.
"""

from __future__ import annotations

import time

import pytest

from edgerun.fleet.rollout import RolloutControl, RolloutState, encode_state, resign
from edgerun.fleet.trusted_release import ReleaseVerifier, UnverifiedRelease
from edgerun.ota.errors import Rejected
from edgerun.ota.manifest import parse_manifest
from edgerun.ota.minisign import SecretKey
from edgerun.ota.release import ReleaseSpec
from edgerun.ota.steps import StepLedger
from edgerun.ota.transport import Offer
from edgerun.ota.transport_mqtt import encode_release
from tests.unit.test_ota_release import Fleet, head_variant

MODEL = "blazeface_short"


def message(offer: Offer) -> bytes:
    return encode_release(offer.manifest, offer.manifest_sig, offer.keys, offer.keys_sig)


def verifier(fleet: Fleet) -> ReleaseVerifier:
    return ReleaseVerifier([k.public_key for k in fleet.root_keys])


def test_a_real_release_verifies_and_its_signed_state_is_believed(released):
    fleet, offer = released
    key = fleet.release_keys[0]
    state = RolloutState(model=MODEL, version=2, percent=10.0, salt="s", phase="canary", ts=time.time())
    checked = verifier(fleet).check(MODEL, message(offer), encode_state(state, key))
    assert checked.trust == "verified" and checked.manifest.version == 2
    assert checked.state is not None and checked.state.state.phase == "canary"
    # A state signed by anyone else is ignored, with the reason.
    forged_state = encode_state(state, SecretKey.generate())
    checked = verifier(fleet).check(MODEL, message(offer), forged_state)
    assert checked.verified and checked.state is None and "not a release key of keys.json" in checked.state_error


@pytest.mark.parametrize("case", ["stranger's key", "tampered percent", "wrong topic", "no keys", "foreign roots"])
def test_what_a_node_refuses_the_station_calls_forged(released, case):
    fleet, offer = released
    model, v = MODEL, verifier(fleet)
    if case == "stranger's key":
        offer = resign(offer, 100.0, SecretKey.generate())
        code = "unknown_key"
    elif case == "tampered percent":
        offer = Offer(
            offer.source,
            offer.manifest.replace(b'"percent":10.0', b'"percent":100.0'),
            offer.manifest_sig,
            offer.keys,
            offer.keys_sig,
        )
        code = "bad_signature"
    elif case == "wrong topic":
        model, code = "other_model", "wrong_model"
    elif case == "no keys":
        offer = Offer(offer.source, offer.manifest, offer.manifest_sig)
        code = "no_keys"
    else:  # a keys.json signed by roots this station does not trust, listing the attacker's release key
        v = ReleaseVerifier([SecretKey.generate().public_key])
        code = "unknown_key"
    checked = v.check(model, message(offer))
    assert (checked.trust, checked.code) == ("forged", code), checked.reason
    assert checked.manifest is not None  # still shown, for the operator to see what was tried
    with pytest.raises(UnverifiedRelease, match="is forged"):
        checked.require_verified()


def test_the_station_never_signs_an_unverified_release(released):
    fleet, offer = released
    control = RolloutControl("127.0.0.1", 1, fleet.release_keys[0])  # port 1: nothing may be published
    forged = verifier(fleet).check(MODEL, message(resign(offer, 10.0, SecretKey.generate())))
    with pytest.raises(UnverifiedRelease) as err:
        control.step(forged, 100.0, "complete")
    assert err.value.exit_code == 2
    unverified = ReleaseVerifier([]).check(MODEL, message(offer))
    assert unverified.trust == "unverified"
    with pytest.raises(UnverifiedRelease, match="--root-key"):
        control.step(unverified, 100.0, "complete")
    unreadable = verifier(fleet).check(MODEL, b'{"schema": "nope"}')
    assert unreadable.trust == "unreadable" and unreadable.manifest is None


def test_an_older_step_after_a_newer_one_is_replayed(released):
    fleet, offer = released
    key = fleet.release_keys[0]
    v = verifier(fleet)
    promote = resign(offer, 50.0, key)  # step 1
    halt = resign(promote, 0.0, key)  # step 2
    assert [parse_manifest(o.manifest).rollout.step for o in (offer, promote, halt)] == [0, 1, 2]
    assert v.check(MODEL, message(promote)).verified
    assert v.check(MODEL, message(halt)).verified
    for old in (offer, promote):
        checked = v.check(MODEL, message(old))
        assert (checked.trust, checked.code) == ("replayed", "replayed"), checked.reason
    # A station that restarted after the replay still sees it against the signed rollout state.
    state = RolloutState(model=MODEL, version=2, percent=0.0, salt="s", phase="halted", ts=time.time(), step=2)
    fresh = verifier(fleet).check(MODEL, message(promote), encode_state(state, key))
    assert fresh.trust == "replayed" and "the signed rollout state is step 2 (halted)" in fresh.reason


def test_an_older_keys_json_is_not_accepted_after_a_newer_one(tmp_path, released, blazeface_bundle):
    fleet, offer = released
    v = verifier(fleet)
    assert v.check(MODEL, message(offer)).verified  # keys.json v1
    newer = tmp_path / "newer"
    newer.mkdir()
    fleet.write_keys(version=2, out=newer)
    bumped = Offer(
        "t",
        offer.manifest,
        offer.manifest_sig,
        (newer / "keys.json").read_bytes(),
        (newer / "keys.json.minisig").read_text(),
    )
    assert v.check(MODEL, message(bumped)).verified and v.keyring.version == 2
    checked = v.check(MODEL, message(offer))  # keys.json v1 again
    assert (checked.trust, checked.code) == ("forged", "rollback")


def test_the_ledger_keeps_a_halt_across_restarts(tmp_path, released):
    fleet, offer = released
    key = fleet.release_keys[0]
    path = tmp_path / "steps.json"
    ledger = StepLedger(path)
    halt = parse_manifest(resign(offer, 0.0, key).manifest)
    assert ledger.record(halt) and not ledger.record(halt)  # unchanged the second time
    again = StepLedger(path)
    assert again.newest(MODEL, 2) == (1, True)
    with pytest.raises(Rejected) as err:
        again.check(parse_manifest(offer.manifest))
    assert err.value.code == "replayed"
    # Even a newer step of a halted version is refused: a halt is final for it.
    repromote = parse_manifest(resign(resign(offer, 0.0, key), 50.0, key).manifest)
    with pytest.raises(Rejected) as err:
        again.check(repromote)
    assert err.value.code == "halted" and "publish a new version" in str(err.value)
    # A damaged ledger file is a warning and a fresh ledger, not a crash.
    path.write_text("{not json")
    assert StepLedger(path).newest(MODEL, 2) is None


def test_a_station_with_a_signing_key_and_no_root_key_refuses_to_start(tmp_path, capsys):
    from edgerun.cli import main

    key = tmp_path / "release.key"
    key.write_text(SecretKey.generate().to_text())
    argv = ["station", "--mqtt", "127.0.0.1:1", "--bind", "127.0.0.1:0", "--signing-key", str(key)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--signing-key needs --root-key" in err and err.count("\n") == 1
    assert main([*argv, "--root-key", str(tmp_path / "missing.pub")]) == 2
    err = capsys.readouterr().err
    assert "--root-key" in err and "missing.pub" in err and err.count("\n") == 1


def test_a_promote_replayed_into_a_watch_directory_after_a_halt_is_refused(tmp_path, blazeface_bundle):
    """The same attack as over MQTT, through a USB stick: the node kept the halt and refuses the older step."""
    from tests.unit.test_ota_rejections import Rig

    rig = Rig(tmp_path, blazeface_bundle)
    rig.trust_keys()
    rig.fleet.publish(head_variant(blazeface_bundle, tmp_path / "v2", 2), spec=ReleaseSpec(rollout_percent=100.0))
    folder = rig.fleet.release_dir / MODEL
    promote = {name: (folder / name).read_bytes() for name in ("manifest.json", "manifest.json.minisig")}
    offer = Offer("dir", promote["manifest.json"], promote["manifest.json.minisig"].decode())
    halt = resign(offer, 0.0, rig.fleet.release_keys[0])
    (folder / "manifest.json").write_bytes(halt.manifest)
    (folder / "manifest.json.minisig").write_text(halt.manifest_sig)
    assert rig.poll() == "rejected:not_in_rollout"  # the node was offline for the promote, sees the halt
    for name, data in promote.items():  # the recorded promote, copied back onto the stick
        (folder / name).write_bytes(data)
    assert rig.poll() == "rejected:replayed"
    assert "rollout step 0 is older than step 1 already verified" in rig.last["reason"]
    assert rig.updater.store.installed().version == 1


def test_a_release_without_keys_is_checked_against_the_trusted_keys_expiry_as_a_node_does(released):
    """Once the keys.json the station trusts has expired, a release that brings none is refused (``expired``),
    as the node's updater refuses it; before, the station kept trusting an expired keyring."""
    fleet, offer = released
    v = verifier(fleet)
    assert v.check(MODEL, message(offer)).trust == "verified"  # the station now trusts this keys.json
    bare = Offer(offer.source, offer.manifest, offer.manifest_sig)
    assert v.check(MODEL, message(bare)).trust == "verified"  # ... and checks a bare release with it
    after_expiry = time.time() + 400 * 86400  # fleet keys.json expires in 365 days
    checked = v.check(MODEL, message(bare), now=after_expiry)
    assert (checked.trust, checked.code) == ("forged", "expired"), checked.reason


def test_a_release_past_its_signed_expiry_is_refused_as_the_node_refuses_it(released):
    """The node's updater refuses a manifest past its ``expires`` (``expired``); the station's check must too, with
    the expiry in the reason, so the page and ``fleet status`` never show a lapsed release as one to install and
    ``RolloutControl.step`` refuses to re-sign it. The keys.json (365 days) is still valid then: only the manifest
    (30 days) has lapsed."""
    fleet, offer = released
    manifest = parse_manifest(offer.manifest)
    v = verifier(fleet)
    assert v.check(MODEL, message(offer), now=manifest.expires_ts - 60).verified
    checked = v.check(MODEL, message(offer), now=manifest.expires_ts + 60)
    assert (checked.trust, checked.code) == ("forged", "expired"), checked.reason
    assert f"manifest v2 expired at {manifest.expires}" in checked.reason
    assert checked.manifest is not None and checked.manifest.version == 2  # still shown, with why it is refused
    control = RolloutControl("127.0.0.1", 1, fleet.release_keys[0])  # port 1: nothing may be published
    with pytest.raises(UnverifiedRelease, match="expired at"):
        control.step(checked, 100.0, "complete")

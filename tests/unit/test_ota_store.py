"""Deltas, and the A/B store's journal recovery from every step an update can be interrupted at."""

from __future__ import annotations

import os

import pytest

from edgerun.ota.delta import apply_delta, make_best, make_delta
from edgerun.ota.errors import Rejected
from edgerun.ota.payload import pack_bundle, sha256_bytes
from edgerun.ota.store import ModelStore
from tests.unit.test_ota_release import head_variant


@pytest.fixture(scope="module")
def payloads(tmp_path_factory, blazeface_bundle):
    v2 = head_variant(blazeface_bundle, tmp_path_factory.mktemp("v") / "v2", 2)
    return blazeface_bundle, v2, pack_bundle(blazeface_bundle.root), pack_bundle(v2.root)


@pytest.mark.parametrize("algorithm", ["bsdiff4", "zstd"])
def test_delta_round_trip_and_caps(algorithm, payloads):
    _, _, old, new = payloads
    patch = make_delta(old, new, algorithm)
    assert len(patch) < len(new) * 0.15
    assert apply_delta(old, patch, algorithm, len(new)) == new
    with pytest.raises(Rejected, match="declares|produced|failed") as info:
        apply_delta(old, patch, algorithm, len(new) - 1)  # output above the signed size is refused
    assert info.value.code == "bad_delta"
    with pytest.raises(Rejected) as info:
        apply_delta(old, patch[: len(patch) // 2] + bytes(16), algorithm, len(new))
    assert info.value.code == "bad_delta"


def test_make_best_keeps_the_smaller_and_says_when_full_wins(payloads):
    _, _, old, new = payloads
    choice = make_best(old, new)
    assert choice.algorithm in ("bsdiff4", "zstd")
    assert len(choice.patch) == min(choice.sizes["bsdiff4"], choice.sizes["zstd"])
    noise = os.urandom(50_000)
    assert make_best(os.urandom(50_000), noise).full_is_smaller


def test_pack_bundle_is_reproducible(payloads):
    bundle, _, old, _ = payloads
    assert pack_bundle(bundle.root) == old


def _store_with_update(tmp_path, payloads, steps):
    """A store provisioned with v1, with an update to v2 journalled up to ``steps``."""
    v1, v2, old, new = payloads
    store = ModelStore(tmp_path / "state")
    store.provision(v1, old)
    txn, slot, _ = store.begin(v2.name, v2.version, sha256_bytes(new), 1.0)
    if "staged" in steps:
        store.write_slot(slot, new, sha256_bytes(new))
        store.journal(txn, "staged")
    else:
        (store.slots / f"{slot}.tmp").mkdir()  # a slot write cut short
        (store.slots / f"{slot}.tmp" / "payload.tar").write_bytes(new[:100])
    for step in steps:
        if step not in ("begin", "staged"):
            store.journal(txn, step, **({"reason": "test"} if step == "rollback" else {}))
    return store


@pytest.mark.parametrize(
    ("steps", "version", "rejected"),
    [
        (["begin"], 1, []),
        (["begin", "staged"], 1, []),
        (["begin", "staged", "warmed"], 1, []),
        (["begin", "staged", "warmed", "trial"], 1, [2]),
        (["begin", "staged", "warmed", "trial", "commit"], 2, []),
        (["begin", "staged", "warmed", "trial", "rollback"], 1, [2]),
    ],
)
def test_recovery_brings_the_store_to_old_or_new(steps, version, rejected, tmp_path, payloads):
    store = _store_with_update(tmp_path, payloads, steps)
    assert store.check()  # an update is in flight
    actions = store.recover()
    assert actions
    assert store.check() == []
    inst = store.installed()
    assert (inst.version, inst.rejected) == (version, rejected)
    assert store.slot_bundle(inst.active).version == version
    assert not list(store.slots.glob("*.tmp"))
    if version == 2:
        assert inst.previous.version == 1 and inst.counter == 2
    assert store.recover() == []  # idempotent


def test_a_torn_journal_line_is_ignored(tmp_path, payloads):
    store = _store_with_update(tmp_path, payloads, ["begin", "staged", "warmed", "trial", "commit"])
    with open(store.journal_path, "ab") as f:
        f.write(b'{"txn":1,"step":"roll')  # power cut mid-write
    store.recover()
    assert store.installed().version == 2 and store.check() == []


def test_damaged_active_slot_falls_back_to_the_previous(tmp_path, payloads):
    store = _store_with_update(tmp_path, payloads, ["begin", "staged", "warmed", "trial", "commit"])
    store.recover()
    inst = store.installed()
    (store.slot_dir(inst.active) / "payload.tar").write_bytes(b"bit rot")
    actions = store.ensure_bootable()
    assert "switched to slot" in actions[0]
    assert store.installed().version == 1 and store.check() == []


def test_write_slot_refuses_unsafe_tars(tmp_path, payloads):
    import io
    import tarfile

    v1, _, old, _ = payloads
    store = ModelStore(tmp_path / "state")
    store.provision(v1, old)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../x")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    data = buf.getvalue()
    with pytest.raises(Rejected, match="points outside the bundle"):
        store.write_slot("b", data, sha256_bytes(data))
    assert not (store.slots / "b").exists() and not (store.slots / "x").exists()


def test_clock_is_trusted_from_timesyncd_where_adjtimex_is_denied(tmp_path, monkeypatch):
    """Under the unit's seccomp filter adjtimex fails (stood in for here); timesyncd's flag file then decides."""
    from edgerun.ota import clock

    flag = tmp_path / "synchronized"
    monkeypatch.setattr(clock, "TIMESYNC_FLAG", flag)
    monkeypatch.setattr(clock, "kernel_clock_synchronised", lambda: None)
    assert clock.clock_synchronised() is None  # nothing can tell: an untrusted clock
    flag.touch()
    assert clock.clock_synchronised() is True
    monkeypatch.setattr(clock, "kernel_clock_synchronised", lambda: False)
    assert clock.clock_synchronised() is False  # the kernel's own word wins where it can be read

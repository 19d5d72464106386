"""Every way a release can be refused: a clear error, and nothing in the model store changes.

The updater runs against a real store, real signed release directories, the
real demo model and a real ``Node`` that is never built (no pipeline is needed
to refuse a release).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgerun.config import parse_config
from edgerun.node import Node
from edgerun.ota.clock import Clock
from edgerun.ota.manifest import Manifest, Target, encode_manifest, format_time
from edgerun.ota.minisign import PublicKey, SecretKey
from edgerun.ota.release import ReleaseSpec
from edgerun.ota.transport_dir import DirectoryTransport
from edgerun.ota.updater import Updater, judge_window
from edgerun.pipeline.serving import Served
from tests.unit.test_ota_release import Fleet, head_variant


def snapshot(state: Path) -> dict[str, bytes]:
    """Every file of the store except the status report."""
    return {
        str(p.relative_to(state)): p.read_bytes()
        for p in sorted(state.rglob("*"))
        if p.is_file() and p.name != "status.json"
    }


class Rig:
    def __init__(
        self,
        tmp: Path,
        installed,
        roots: int = 1,
        releases: int = 2,
        root_threshold: int = 1,
        wall_clock: Clock | None = None,
        **ota,
    ):
        self.fleet = Fleet(tmp / "fleet", roots=roots, releases=releases)
        self.state = tmp / "state"
        cfg = parse_config(
            {
                "node": {"id": "node-7"},
                "ota": {
                    "enabled": True,
                    "state_dir": str(self.state),
                    "root_keys": self.fleet.root_pub_paths,
                    "root_threshold": root_threshold,
                    "watch_dir": str(self.fleet.release_dir),
                    **ota,
                },
            }
        )
        self.node = Node(cfg)  # never built: judging an offer needs no source, engine or pipeline
        self.updater = Updater(self.node, cfg.ota, clock=wall_clock)
        self.updater.boot_bundle(lambda: installed)
        self.transport = DirectoryTransport(self.fleet.release_dir)

    def trust_keys(self, **kwargs) -> None:
        """Have the node trust a keys.json (as if seen with an earlier release)."""
        self.fleet.write_keys(**kwargs)
        rel = self.fleet.release_dir
        keys, keys_sig = (rel / "keys.json").read_bytes(), (rel / "keys.json.minisig").read_text()
        offer = SimpleNamespace(source="trust_keys", keys=keys, keys_sig=keys_sig)
        self.updater._keyring(offer, time.time())

    def poll(self) -> str | None:
        return asyncio.run(self.updater.poll_once(self.transport))

    @property
    def last(self) -> dict:
        return self.updater.status["last"]


def raw_release(rig: Rig, name: str, version: int, payload: bytes, key: SecretKey | None = None) -> None:
    """A validly signed release around arbitrary payload bytes."""
    now = time.time()
    file = f"{name}-{version}.tar"
    manifest = Manifest(
        name=name,
        version=version,
        created=format_time(now),
        expires=format_time(now + 86400),
        target=Target(sha256=hashlib.sha256(payload).hexdigest(), size=len(payload), file=file),
    )
    data = encode_manifest(manifest)
    out = rig.fleet.release_dir / name
    out.mkdir(parents=True, exist_ok=True)
    (out / file).write_bytes(payload)
    (out / "manifest.json").write_bytes(data)
    sig = (key or rig.fleet.release_keys[0]).sign(data, manifest.trusted_comment(int(now)))
    (out / "manifest.json.minisig").write_text(sig.to_text())


def evil_tar(bundle, member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path in sorted(bundle.root.iterdir()):
            tar.add(path, arcname=path.name)
        tar.addfile(member, io.BytesIO(data) if data else None)
    return out.getvalue()


@pytest.fixture(scope="module")
def variants(tmp_path_factory, blazeface_bundle):
    tmp = tmp_path_factory.mktemp("variants")
    return {
        "v2": head_variant(blazeface_bundle, tmp / "v2", 2),
        "v3": head_variant(blazeface_bundle, tmp / "v3", 3, seed=3),
        "v1b": head_variant(blazeface_bundle, tmp / "v1b", 1, seed=9),  # a different v1: another base
    }


def _bad_signature(rig, v):
    rig.fleet.publish(v["v2"])
    path = rig.fleet.release_dir / "blazeface_short" / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"percent":100.0', b'"percent":100.00'))


def _unknown_key(rig, v):
    rig.fleet.publish(v["v2"], key=SecretKey.generate())


def _revoked_key(rig, v):
    revoked = rig.fleet.release_keys[0].public_key.id_hex
    rig.trust_keys(version=2, revoked=(revoked,))
    rig.fleet.publish(v["v2"], key=rig.fleet.release_keys[0])


def _below_threshold(rig, v):
    rig.trust_keys(version=2, threshold=2)
    rig.fleet.publish(v["v2"], key=rig.fleet.release_keys[0])


def _version_equal(rig, v):
    rig.fleet.publish(rig.installed)


def _version_lower(rig, v):
    rig.fleet.publish(v["v2"])


def _replayed(rig, v):
    # A release that was valid when it was signed, ten days ago, for a version this node is past.
    rig.fleet.publish(v["v2"], now=time.time() - 10 * 86400)


def _expired(rig, v):
    rig.fleet.publish(v["v2"], now=time.time() - 40 * 86400, spec=ReleaseSpec(expires_days=30))


def _wrong_board(rig, v):
    rig.fleet.publish(v["v2"], spec=ReleaseSpec(boards=["jetson-orin-nano", "rpi5"]))


def _base_mismatch(rig, v):
    rig.fleet.publish(v["v2"], base=v["v1b"], spec=ReleaseSpec(full=False))


def _truncated(rig, v):
    release = rig.fleet.publish(v["v2"])
    path = release.directory / release.manifest.target.file
    path.write_bytes(path.read_bytes()[:1000])


def _oversized(rig, v):
    release = rig.fleet.publish(v["v2"])
    path = release.directory / release.manifest.target.file
    path.write_bytes(path.read_bytes() + b"\0" * 4096)


def _hash_mismatch(rig, v):
    release = rig.fleet.publish(v["v2"])
    path = release.directory / release.manifest.target.file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _tar_dotdot(rig, v):
    member = tarfile.TarInfo("../../escape.txt")
    member.size = 4
    raw_release(rig, "blazeface_short", 2, evil_tar(v["v2"], member, b"evil"))


def _tar_link(rig, v):
    member = tarfile.TarInfo("model_link.tflite")
    member.type = tarfile.SYMTYPE
    member.linkname = "/etc/passwd"
    raw_release(rig, "blazeface_short", 2, evil_tar(v["v2"], member))


CASES = {
    "bad signature": (_bad_signature, "bad_signature", "manifest.json: bad signature"),
    "unknown key": (_unknown_key, "unknown_key", "manifest.json: signed by unknown key"),
    "revoked key": (_revoked_key, "revoked_key", "which is revoked"),
    "below threshold": (_below_threshold, "below_threshold", "1 valid signature(s) from trusted keys, 2 needed"),
    "version equal": (_version_equal, "rollback", "blazeface_short v1 is not above the installed v1"),
    "version lower": (_version_lower, "rollback", "blazeface_short v2 is not above the installed v3"),
    "older manifest replayed": (_replayed, "rollback", "v2 is not above the installed v3"),
    "expired": (_expired, "expired", "manifest v2 expired at"),
    "wrong board": (_wrong_board, "incompatible", "v2 is for boards jetson-orin-nano, rpi5; this is"),
    "base mismatch, no full payload": (_base_mismatch, "base_mismatch", "the release has no full payload"),
    "truncated payload": (_truncated, "truncated", "the source ended after"),
    "oversized payload": (_oversized, "oversized", "the manifest signed"),
    "hash mismatch": (_hash_mismatch, "hash_mismatch", "is not the signed"),
    "tar with ../ paths": (_tar_dotdot, "bad_bundle", "points outside the bundle"),
    "tar with a link": (_tar_link, "bad_bundle", "is a link or device"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_is_clear_and_changes_nothing(case, tmp_path, blazeface_bundle, variants):
    build, code, message = CASES[case]
    installed = variants["v3"] if case in ("version lower", "older manifest replayed") else blazeface_bundle
    rig = Rig(tmp_path, installed)
    rig.installed = installed
    rig.trust_keys()
    build(rig, variants)
    before = snapshot(rig.state)
    assert rig.poll() == f"rejected:{code}"
    assert rig.last["step"] == "rejected" and rig.last["code"] == code
    assert message in rig.last["reason"], rig.last["reason"]
    assert snapshot(rig.state) == before
    assert not any(rig.updater.store.staging.iterdir())
    assert not (tmp_path / "escape.txt").exists() and not (rig.state / "escape.txt").exists()
    inst = rig.updater.store.installed()
    assert inst.version == installed.version and inst.rejected == []


def test_root_threshold_on_keys_json(tmp_path, blazeface_bundle, variants):
    rig = Rig(tmp_path, blazeface_bundle, roots=2, root_threshold=2)
    rig.fleet.write_keys(signers=rig.fleet.root_keys[:1])
    rig.fleet.publish(variants["v2"])
    before = snapshot(rig.state)
    assert rig.poll() == "rejected:below_threshold"
    assert "keys.json: 1 valid signature(s) from trusted keys, 2 needed" in rig.last["reason"]
    assert snapshot(rig.state) == before


def test_replayed_older_keys_json_is_refused(tmp_path, blazeface_bundle, variants):
    rig = Rig(tmp_path, blazeface_bundle)
    rig.trust_keys(version=5)
    rig.fleet.write_keys(version=4)  # an old but validly signed key list, replayed
    rig.fleet.publish(variants["v2"])
    assert rig.poll() == "rejected:rollback"
    assert "keys.json: version 4 is older than the trusted version 5" in rig.last["reason"]


def test_untrusted_clock_policy_refuse_waits(tmp_path, blazeface_bundle, variants):
    rig = Rig(tmp_path, blazeface_bundle, clock="untrusted", untrusted_clock="refuse")
    rig.trust_keys()
    rig.fleet.publish(variants["v2"])
    assert rig.poll() == "rejected:clock_untrusted"
    assert rig.last["final"] is False


def test_a_trusted_clock_past_the_expiry_refuses_a_fresh_release(tmp_path, blazeface_bundle, variants):
    later = time.time() + 400 * 86400  # past any default expiry
    rig = Rig(tmp_path, blazeface_bundle, wall_clock=lambda: (later, True))
    rig.trust_keys()
    before = snapshot(rig.state)
    rig.fleet.publish(variants["v2"])
    assert rig.poll() == "rejected:expired"
    assert rig.updater.status["clock"] == "trusted"
    assert snapshot(rig.state) == before


def test_rollout_cohort_is_stable(tmp_path, blazeface_bundle, variants):
    from edgerun.ota.manifest import Rollout, in_rollout

    rig = Rig(tmp_path, blazeface_bundle)
    rig.trust_keys()
    salt = next(f"s{i}" for i in range(1000) if not in_rollout(Rollout(percent=10, salt=f"s{i}"), "node-7"))
    rig.fleet.publish(variants["v2"], spec=ReleaseSpec(rollout_percent=10, rollout_salt=salt))
    assert rig.poll() == "rejected:not_in_rollout"
    inside = sum(in_rollout(Rollout(percent=10, salt="x"), f"n{i}") for i in range(4000))
    assert 300 < inside < 500  # about 10% of a fleet


def test_the_same_rejected_release_is_not_examined_again(tmp_path, blazeface_bundle, variants):
    rig = Rig(tmp_path, blazeface_bundle)
    rig.trust_keys()
    rig.fleet.publish(variants["v2"], key=SecretKey.generate())
    assert rig.poll() == "rejected:unknown_key"
    assert rig.poll() is None


@pytest.mark.skipif(shutil.which("minisign") is None, reason="minisign not installed (make system-deps)")
def test_a_release_signed_with_the_minisign_tool_passes_the_node_checks(tmp_path, blazeface_bundle, variants):
    rig = Rig(tmp_path, blazeface_bundle)
    pub, sec = tmp_path / "release.pub", tmp_path / "release.key"
    subprocess.run(["minisign", "-G", "-W", "-p", str(pub), "-s", str(sec)], check=True, capture_output=True)
    key = PublicKey.load(pub)
    rig.trust_keys(release_keys=[SimpleNamespace(public_key=key)])
    release = rig.fleet.publish(variants["v2"], key=SecretKey.generate())  # signature replaced below
    manifest = release.directory / "manifest.json"
    comment = release.manifest.trusted_comment(int(time.time()))
    subprocess.run(
        ["minisign", "-S", "-s", str(sec), "-m", str(manifest), "-t", comment], check=True, capture_output=True
    )
    offer = asyncio.run(rig.transport.poll("blazeface_short"))
    checked = rig.updater.check(offer)
    assert (checked.name, checked.version) == ("blazeface_short", 2)


def test_judge_window():
    ms = 0.001
    assert judge_window([10 * ms] * 50, [11 * ms] * 50, 0, 0, 3.0) is None
    assert "inference error" in judge_window([10 * ms], [10 * ms], 2, 0, 3.0)
    assert "no batches" in judge_window([10 * ms], [], 0, 0, 3.0)
    assert "above 3 x the previous model's 10.0 ms" in judge_window([10 * ms] * 50, [40 * ms] * 50, 0, 0, 3.0)


def test_a_stop_while_warmed_is_written_closes_the_update(tmp_path, blazeface_bundle, variants, monkeypatch):
    """The node stopping just as "warmed" reaches the journal must not leave the update open.

    The updater task is cancelled from inside the journal write (a stand-in for SIGTERM at that
    instant), and the warmed-up model is a stand-in: no pipeline is needed to reach that step.
    """
    rig = Rig(tmp_path, blazeface_bundle)
    rig.trust_keys()
    rig.fleet.publish(variants["v2"])
    updater, store = rig.updater, rig.updater.store
    closed: list = []
    monkeypatch.setattr(updater, "_open_runtime", lambda bundle: Served("new runtime", "new failover"))

    async def close(serving) -> None:
        closed.append(serving)

    monkeypatch.setattr(updater, "_close", close)

    async def main() -> None:
        task = asyncio.ensure_future(updater.poll_once(rig.transport))
        loop = asyncio.get_running_loop()
        journal = store.journal

        def journal_then_stop(txn, step, **fields):
            journal(txn, step, **fields)
            if step == "warmed":
                loop.call_soon_threadsafe(task.cancel)

        monkeypatch.setattr(store, "journal", journal_then_stop)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    steps = [r["step"] for r in store.journal_records()]
    assert steps[-4:] == ["staged", "warmed", "aborted", "done"], steps
    assert store.check() == []
    assert store.installed().version == blazeface_bundle.version  # the running model stays
    assert closed == [("new runtime", "new failover")]  # the model warmed beside it is closed

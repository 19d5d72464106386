"""The A/B model store on the node, with a journal so a power cut at any instant leaves a working model.

Layout under ``ota.state_dir``::

    installed.json   the committed state: active slot, its version and payload hash,
                     the anti-rollback counter, versions never to retry, the previous slot
    journal          append-only JSON lines, one per step of an update, each fsynced
    slots/a, slots/b a payload tar (payload.tar) and the bundle extracted from it
    staging/         downloads in progress (resumable); never read as a model
    trust/           the newest verified keys.json and its signatures
    status.json      the last update's progress, for ``edgerun ota status`` (a report, not state)

``installed.json`` is only ever replaced whole (temp file, fsync, rename,
fsync of the directory), so it always reads as either the old or the new
state. A slot is written as ``slots/<x>.tmp`` and renamed into place. The
journal says which update was in flight; ``recover`` finishes or undoes it:

    begin, staged, warmed -> abort: keep running the installed model
    trial                 -> the node died while trying the new model: roll back, never retry it
    commit                -> make the new slot active (installed.json), then done
    rollback              -> record the version as rejected, then done
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Literal

import msgspec

from edgerun.errors import ModelError
from edgerun.models.bundle import ModelBundle, load_bundle
from edgerun.ota.errors import OtaError, Rejected
from edgerun.ota.payload import DEFAULT_MAX_UNPACKED, check_unpacked_size, sha256_bytes, sha256_file

log = logging.getLogger(__name__)

PAYLOAD = "payload.tar"
INSTALLED_SCHEMA = "edgerun.ota.installed/1"
STEPS = ("begin", "staged", "warmed", "trial", "commit", "rollback", "aborted", "done")
JOURNAL_KEEP = 400  # lines kept when the journal is compacted at the start of an update


class SlotState(msgspec.Struct, kw_only=True):
    slot: Literal["a", "b"]
    version: int
    sha256: str


class Installed(msgspec.Struct, kw_only=True):
    schema: str = INSTALLED_SCHEMA
    name: str
    active: Literal["a", "b"]
    version: int
    sha256: str
    counter: int  # anti-rollback: the highest version ever committed; only goes up
    rejected: list[int] = msgspec.field(default_factory=list)  # rolled back: never retried
    previous: SlotState | None = None  # the slot to roll back to
    time_floor: float = 0.0  # newest signed "created" time seen: time cannot be earlier than this

    @property
    def inactive(self) -> Literal["a", "b"]:
        return "b" if self.active == "a" else "a"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader (or a reboot) sees the old or the new file, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def default_state_dir() -> Path:
    """systemd's $STATE_DIRECTORY (first entry), else ./.cache/state."""
    value = os.environ.get("STATE_DIRECTORY")
    if value:
        return Path(value.split(":")[0])
    return Path.cwd() / ".cache" / "state"


class ModelStore:
    def __init__(self, root: str | Path, max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED) -> None:
        self.root = Path(root)
        self.max_unpacked_bytes = max_unpacked_bytes  # ota.max_unpacked_bytes: a payload unpacking past it is refused
        self.installed_path = self.root / "installed.json"
        self.journal_path = self.root / "journal"
        self.slots = self.root / "slots"
        self.staging = self.root / "staging"
        self.trust = self.root / "trust"
        self.status_path = self.root / "status.json"
        self._decoder = msgspec.json.Decoder(Installed)
        # Called with each step once it is on disk; set only by the test-control layer (edgerun.testing.control).
        self.after_journal: Callable[[str], None] | None = None

    def ensure_dirs(self) -> None:
        for path in (self.root, self.slots, self.staging, self.trust):
            path.mkdir(parents=True, exist_ok=True)

    # -- committed state -------------------------------------------------------

    def installed(self) -> Installed | None:
        try:
            data = self.installed_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return self._decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise OtaError(f"{self.installed_path}: unreadable ({err})") from None

    def write_installed(self, inst: Installed) -> None:
        atomic_write(self.installed_path, msgspec.json.encode(inst) + b"\n")

    # -- journal ---------------------------------------------------------------

    def journal(self, txn: int, step: str, **data: Any) -> None:
        """Append one step and fsync it, then tell ``after_journal`` (a test's power cut may strike there)."""
        record = {"txn": txn, "step": step, "t": round(time.time(), 3), **data}
        line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
        with open(self.journal_path, "a+b") as f:
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line  # end a line torn by a power cut, so this record parses
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
        if self.after_journal is not None:
            self.after_journal(step)

    def journal_records(self) -> list[dict[str, Any]]:
        try:
            text = self.journal_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        records = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn by a power cut: the step it names never completed
            if isinstance(record, dict) and isinstance(record.get("txn"), int) and record.get("step") in STEPS:
                records.append(record)
        return records

    def open_transaction(self) -> list[dict[str, Any]]:
        """The records of the last update if it has no ``done`` yet, else []."""
        records = self.journal_records()
        if not records:
            return []
        txn = records[-1]["txn"]
        mine = [r for r in records if r["txn"] == txn]
        if any(r["step"] == "done" for r in mine) or mine[0]["step"] != "begin":
            return []
        return mine

    def next_txn(self) -> int:
        records = self.journal_records()
        return records[-1]["txn"] + 1 if records else 1

    def compact_journal(self) -> None:
        records = self.journal_records()
        if len(records) > JOURNAL_KEEP:
            keep = records[-JOURNAL_KEEP:]
            data = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in keep)
            atomic_write(self.journal_path, data.encode())

    # -- slots -----------------------------------------------------------------

    def slot_dir(self, slot: str) -> Path:
        return self.slots / slot

    def slot_bundle(self, slot: str) -> ModelBundle:
        return load_bundle(self.slot_dir(slot) / PAYLOAD, extract_dir=self.slot_dir(slot))

    def slot_ok(self, slot: str, sha256: str) -> bool:
        """The slot holds the payload with this hash, and its bundle loads."""
        payload = self.slot_dir(slot) / PAYLOAD
        if not payload.is_file() or sha256_file(payload) != sha256:
            return False
        try:
            self.slot_bundle(slot)
        except ModelError:
            return False
        return True

    def check_unpacked(self, payload: bytes) -> None:
        """Rejected('oversized') when ``payload`` unpacks past ``max_unpacked_bytes`` (streamed; writes nothing)."""
        check_unpacked_size(payload, self.max_unpacked_bytes)

    def write_slot(self, slot: str, payload: bytes, sha256: str) -> ModelBundle:
        """Write ``payload`` into ``slot`` (temp dir, fsync, rename); checks the tar is a safe, valid bundle."""
        if sha256_bytes(payload) != sha256:
            raise Rejected("hash_mismatch", f"payload does not hash to {sha256}")
        self.check_unpacked(payload)  # before anything is written: a tar bomb never reaches the slot
        final = self.slot_dir(slot)
        tmp = self.slots / f"{slot}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / PAYLOAD).write_bytes(payload)
        try:
            load_bundle(tmp / PAYLOAD, extract_dir=tmp)
        except ModelError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Rejected("bad_bundle", str(err).replace(str(tmp / PAYLOAD), "payload")) from None
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.slots)
        return self.slot_bundle(slot)

    # -- provisioning and recovery ----------------------------------------------

    def provision(self, bundle: ModelBundle, payload: bytes) -> Installed:
        """Make ``bundle`` the content of slot a and the committed state (first start with OTA)."""
        self.ensure_dirs()
        sha = sha256_bytes(payload)
        self.write_slot("a", payload, sha)
        inst = Installed(name=bundle.name, active="a", version=bundle.version, sha256=sha, counter=bundle.version)
        self.write_installed(inst)
        log.info("ota: provisioned slot a with %s v%d", bundle.name, bundle.version)
        return inst

    def recover(self) -> list[str]:
        """Finish or undo an update that was in flight when the process died; returns what was done."""
        inst = self.installed()
        records = self.open_transaction()
        actions: list[str] = []
        for leftover in self.slots.glob("*.tmp") if self.slots.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)
            actions.append(f"removed the partial slot {leftover.name}")
        if not records or inst is None:
            return actions
        begin = records[0]
        txn, steps = begin["txn"], [r["step"] for r in records]
        if "commit" in steps:
            self.finish_commit(txn, begin)
            actions.append(f"completed the commit of v{begin['version']}")
        elif "rollback" in steps:
            reason = next(r for r in records if r["step"] == "rollback").get("reason", "")
            self.finish_rollback(txn, begin, reason)
            actions.append(f"completed the rollback of v{begin['version']}")
        elif "trial" in steps:
            self.journal(txn, "rollback", reason="the node restarted while trying this model")
            self.finish_rollback(txn, begin, "the node restarted while trying this model")
            actions.append(f"rolled back v{begin['version']}: the node restarted during its health window")
        else:
            self.journal(txn, "aborted", reason=f"interrupted after {steps[-1]}")
            self.journal(txn, "done")
            actions.append(f"abandoned the install of v{begin['version']} (interrupted after {steps[-1]})")
        return actions

    def begin(self, name: str, version: int, sha256: str, created_ts: float) -> tuple[int, str, dict[str, Any]]:
        """Start an update into the inactive slot; returns (transaction id, slot, the begin record)."""
        inst = self.installed()
        if inst is None:
            raise OtaError("the model store is not provisioned")
        self.compact_journal()
        txn = self.next_txn()
        slot = inst.inactive
        record = dict(
            name=name,
            version=version,
            sha256=sha256,
            slot=slot,
            created=created_ts,
            from_version=inst.version,
            from_slot=inst.active,
            from_sha256=inst.sha256,
        )
        self.journal(txn, "begin", **record)
        if inst.previous is not None and inst.previous.slot == slot:
            # The slot we are about to overwrite can no longer be rolled back to.
            inst.previous = None
            self.write_installed(inst)
        return txn, slot, {"txn": txn, "step": "begin", **record}

    def commit(self, txn: int, begin: dict[str, Any]) -> Installed:
        self.journal(txn, "commit")
        return self.finish_commit(txn, begin)

    def rollback(self, txn: int, begin: dict[str, Any], reason: str) -> Installed:
        self.journal(txn, "rollback", reason=reason)
        return self.finish_rollback(txn, begin, reason)

    def abort(self, txn: int, reason: str) -> None:
        """The update stopped before its model served: nothing to undo, the running model stays."""
        self.journal(txn, "aborted", reason=reason)
        self.journal(txn, "done")

    def finish_commit(self, txn: int, begin: dict[str, Any]) -> Installed:
        inst = self.installed()
        assert inst is not None
        if not (inst.active == begin["slot"] and inst.version == begin["version"]):
            inst = Installed(
                name=begin["name"],
                active=begin["slot"],
                version=begin["version"],
                sha256=begin["sha256"],
                counter=max(inst.counter, begin["version"]),
                rejected=inst.rejected,
                previous=SlotState(slot=begin["from_slot"], version=begin["from_version"], sha256=begin["from_sha256"]),
                time_floor=max(inst.time_floor, float(begin.get("created", 0.0))),
            )
            self.write_installed(inst)
        self.journal(txn, "done")
        return inst

    def finish_rollback(self, txn: int, begin: dict[str, Any], reason: str) -> Installed:
        inst = self.installed()
        assert inst is not None
        if begin["version"] not in inst.rejected:
            inst.rejected = sorted({*inst.rejected, begin["version"]})
            self.write_installed(inst)
        self.journal(txn, "done")
        return inst

    def ensure_bootable(self) -> list[str]:
        """Check the active slot; fall back to the previous one if it is damaged. Returns what was done."""
        inst = self.installed()
        if inst is None:
            return []
        if self.slot_ok(inst.active, inst.sha256):
            return []
        prev = inst.previous
        if prev is not None and self.slot_ok(prev.slot, prev.sha256):
            damaged = inst.active
            inst.active, inst.version, inst.sha256, inst.previous = prev.slot, prev.version, prev.sha256, None
            self.write_installed(inst)
            return [f"slot {damaged} is damaged; switched to slot {prev.slot} (v{prev.version})"]
        raise OtaError(f"slot {inst.active} is damaged and there is no previous slot to fall back to")

    def check(self) -> list[str]:
        """Consistency problems, or []: committed state readable, active slot intact, no update half done."""
        problems = []
        try:
            inst = self.installed()
        except OtaError as err:
            return [str(err)]
        if inst is None:
            return ["not provisioned (no installed.json)"]
        if not self.slot_ok(inst.active, inst.sha256):
            problems.append(f"active slot {inst.active} does not hold v{inst.version} ({inst.sha256[:12]})")
        if inst.counter < inst.version:
            problems.append(f"anti-rollback counter {inst.counter} is below the active version {inst.version}")
        if self.open_transaction():
            problems.append("an update is in flight (journal has no 'done')")
        return problems

"""The order of a release's rollout steps: the newest signed step of each version, and which versions were halted.

``fleet promote`` and ``fleet halt`` re-sign the same version with a new
percent, and each such step counts ``rollout.step`` up (signed, like the
percent). A step older than the newest one verified is a replay (an attacker
re-publishing a recorded promote after a halt) and is refused; a halt is
sticky: once a version has been seen at 0 %, no step of that version is taken
again, whatever its percent. The node keeps this ledger beside its trusted
``keys.json`` (persisted like the anti-rollback counter, so a reboot does not
forget a halt); the ground station keeps one per run and cross-checks it with
the signed rollout state.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from edgerun.ota.errors import Rejected
from edgerun.ota.manifest import Manifest

log = logging.getLogger(__name__)

KEEP_VERSIONS = 32  # per model; older versions are refused by the anti-rollback counter anyway


class StepLedger:
    """Newest verified step per (model, version) and the halted versions; optionally persisted as JSON."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._steps: dict[str, dict[int, dict[str, Any]]] = {}
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_bytes())
            for model, versions in raw.items():
                self._steps[str(model)] = {
                    int(v): {"step": int(e["step"]), "halted": bool(e["halted"])} for v, e in versions.items()
                }
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            # A damaged ledger must not stop updates; the anti-rollback counter still holds.
            log.warning("ota: %s is unreadable (%s); starting a new step ledger", path, err)
            self._steps = {}

    def newest(self, model: str, version: int) -> tuple[int, bool] | None:
        """(newest step, halted) seen of ``model`` v``version``, or None."""
        entry = self._steps.get(model, {}).get(version)
        return None if entry is None else (entry["step"], entry["halted"])

    def check(self, manifest: Manifest) -> None:
        """Refuse a step older than the newest verified one, and any step of a halted version."""
        seen = self.newest(manifest.name, manifest.version)
        if seen is None:
            return
        step, halted = seen
        what = f"{manifest.name} v{manifest.version}"
        if manifest.rollout.step < step:
            raise Rejected(
                "replayed",
                f"{what}: rollout step {manifest.rollout.step} is older than step {step} already verified "
                "(a replayed rollout message)",
            )
        if halted and manifest.rollout.percent > 0:
            raise Rejected(
                "halted", f"{what} was halted (step {step}); a halted release is never taken: publish a new version"
            )

    def record(self, manifest: Manifest) -> bool:
        """Remember a verified step (call after ``check``); returns whether the ledger changed."""
        with self._lock:
            versions = self._steps.setdefault(manifest.name, {})
            entry = versions.get(manifest.version, {"step": -1, "halted": False})
            new = {
                "step": max(entry["step"], manifest.rollout.step),
                "halted": entry["halted"] or manifest.rollout.percent <= 0.0,
            }
            if new == entry:
                return False
            versions[manifest.version] = new
            for old in sorted(versions)[:-KEEP_VERSIONS]:
                del versions[old]
            if self.path is not None:
                from edgerun.ota.store import atomic_write

                doc = {m: {str(v): e for v, e in vs.items()} for m, vs in self._steps.items()}
                atomic_write(self.path, json.dumps(doc, sort_keys=True).encode())
            return True

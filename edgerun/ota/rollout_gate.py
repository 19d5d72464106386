"""Stopping a download when its rollout is halted: the node's side of ``edgerun fleet halt`` while bytes are in flight.

The updater admits a release only when the node is in its signed rollout cohort,
and a halt is the same release re-signed at 0 %. A node already downloading
would otherwise finish and install it; the MQTT transport asks ``halted_for``
between chunks whether a newer release message withdrew this node. The newer
manifest must be signed by a release key listed in the ``keys.json`` of the
offer being fetched (the bytes the updater verified against the root keys just
before the download began), name the same model and version, and put this node
outside its cohort; an unsigned or forged message changes nothing.
"""

from __future__ import annotations

import msgspec

from edgerun.ota.errors import OtaError
from edgerun.ota.manifest import in_rollout, parse_manifest
from edgerun.ota.transport import Offer
from edgerun.ota.trust import KeyList, Keyring, TrustStore


def halted_for(node_id: str, fetching: Offer, newer: Offer) -> str | None:
    """Why the download of ``fetching`` should stop now that ``newer`` is out, or None to go on."""
    if not node_id or newer.identity() == fetching.identity() or fetching.keys is None:
        return None
    try:
        current = parse_manifest(fetching.manifest)
        doc = msgspec.json.decode(fetching.keys, type=KeyList)
        keyring = Keyring(doc, fetching.keys, fetching.keys_sig or "")
        manifest = TrustStore.verify_manifest(newer.manifest, newer.manifest_sig, keyring)
    except (OtaError, msgspec.DecodeError, msgspec.ValidationError):
        return None  # not a signed step of this release: ignore it
    if (manifest.name, manifest.version) != (current.name, current.version):
        return None  # another release: the updater judges it after this one
    if manifest.rollout.step < current.rollout.step:
        return None  # an older step replayed: it cannot undo the step being fetched
    if in_rollout(manifest.rollout, node_id):
        return None
    return (
        f"the rollout of {manifest.name} v{manifest.version} now covers {manifest.rollout.percent:g}% "
        f"and no longer this node (halted or narrowed by a signed release)"
    )

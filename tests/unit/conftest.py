"""Fixtures shared by the unit tests of rollouts and of the station's release check."""

from __future__ import annotations

import pytest

from edgerun.ota.transport import Offer
from tests.unit.test_ota_release import Fleet, head_variant


@pytest.fixture(scope="module")
def released(tmp_path_factory, blazeface_bundle):
    """A fleet's keys and its v2 release at 10 % (salt "canary-salt"), as a node receives it."""
    tmp = tmp_path_factory.mktemp("rollout")
    fleet = Fleet(tmp / "fleet")
    fleet.write_keys()
    from edgerun.ota.release import ReleaseSpec

    v2 = head_variant(blazeface_bundle, tmp / "v2", 2)
    release = fleet.publish(v2, spec=ReleaseSpec(rollout_percent=10.0, rollout_salt="canary-salt"))
    d = fleet.release_dir
    offer = Offer(
        "test",
        release.manifest_bytes,
        (release.directory / "manifest.json.minisig").read_text(),
        (d / "keys.json").read_bytes(),
        (d / "keys.json.minisig").read_text(),
    )
    return fleet, offer

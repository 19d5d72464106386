"""The model bundles and the signed OTA release a HIL run flies with, made the way an operator makes them.

``prepare_fleet_release(run_dir)`` writes:

* ``models/v1``: the demo BlazeFace bundle, with the ``hilaccel`` variant (the test-control accelerator,
  the same .tflite file) beside ``tflite``, so a node can fail over from an "accelerator" to the CPU, and
  ``hilcpu`` (a weaker board's CPU, the same file again);
* ``models/v2``: the same model with its output heads retrained a little (a real, runnable model);
* ``ota/root.pub`` (the key every node trusts) and ``ota/releases``: keys.json signed by the root, and the
  v2 release (payload, delta against v1, manifest signed by the release key).

``python -m hil.fleet_release publish RELEASES MODEL HOST:PORT`` publishes it, retained, on a broker (the
runner starts it inside the broker's network namespace).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgerun.hostport import parse_hostport
from edgerun.models.bundle import ModelBundle, load_bundle, write_manifest
from edgerun.models.demo import ensure_demo_bundle
from edgerun.ota.minisign import SecretKey
from edgerun.ota.release import ReleaseSpec, build_release
from edgerun.ota.trust import keys_trusted_comment, make_key_list
from edgerun.ota.variants import derive_bundle, is_head, perturb_weights
from edgerun.testing.control import ACCELERATOR_KEY, SLOW_CPU_KEY
from edgerun.tomlfile import tomllib


@dataclass(frozen=True)
class FleetRelease:
    v1: ModelBundle
    v2: ModelBundle
    root_pub: Path
    release_dir: Path

    @property
    def model(self) -> str:
        return self.v1.name


def with_accelerator_variant(bundle: ModelBundle) -> ModelBundle:
    """The bundle's tflite file also serves as its ``hilaccel`` and ``hilcpu`` variants (the test-control stand-ins
    for an accelerator and a weaker board's CPU; rewrites model.toml in place)."""
    manifest = tomllib.loads((bundle.root / "model.toml").read_text())
    manifest["variants"][ACCELERATOR_KEY] = manifest["variants"]["tflite"]
    manifest["variants"][SLOW_CPU_KEY] = manifest["variants"]["tflite"]
    write_manifest(bundle.root, manifest)
    return load_bundle(bundle.root)


def prepare_fleet_release(run_dir: Path, version: int = 2) -> FleetRelease:
    demo = ensure_demo_bundle(fetch=False)
    models = run_dir / "models"
    tflite = demo.variant_path("tflite")
    assert tflite is not None  # the demo bundle has one
    v1 = with_accelerator_variant(derive_bundle(demo, models / "v1", demo.version, tflite.read_bytes()))
    data, _ = perturb_weights(tflite.read_bytes(), is_head, 1e-2, seed=version)
    v2 = with_accelerator_variant(derive_bundle(demo, models / f"v{version}", version, data))
    ota = run_dir / "ota"
    release_dir = ota / "releases"
    release_dir.mkdir(parents=True, exist_ok=True)
    root_key, release_key = SecretKey.generate(), SecretKey.generate()
    root_pub = ota / "root.pub"
    root_pub.write_text(root_key.public_key.to_text())
    keys = make_key_list([release_key.public_key], 1, 30.0)
    (release_dir / "keys.json").write_bytes(keys)
    signature = root_key.sign(keys, keys_trusted_comment(1, int(time.time())))
    (release_dir / "keys.json.minisig").write_text(signature.to_text())
    build_release(v2.root, release_dir, ReleaseSpec(), base_path=v1.root, key=release_key)
    return FleetRelease(v1, v2, root_pub, release_dir)


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] != "publish":
        print("usage: python -m hil.fleet_release publish RELEASES MODEL HOST:PORT", file=sys.stderr)
        return 2
    from edgerun.ota.transport_mqtt import publish_release

    host, port = parse_hostport(argv[3], "HOST:PORT")
    publish_release(Path(argv[1]), argv[2], host, port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

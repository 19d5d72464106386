"""Checks a node runs before any heavy work: every mistake a person must fix, found in one place, in seconds.

``preflight(cfg)`` runs before the model bundle is unpacked, the replay scene
is built, an engine is opened or a sink connects. Each check reads only what
it names (a key file, a TLS file, a directory's permissions) and raises a
``ConfigError`` (exit 2: a restart cannot help) naming the key and the file:

* key files: ``ota.root_keys`` parse as minisign public keys and meet
  ``ota.root_threshold``;
* TLS: ``sinks.mqtt.tls_ca`` / ``tls_cert`` / ``tls_key`` load into an SSL
  context (also when only OTA uses the broker);
* the bundle: ``model.bundle`` exists and is a directory or a file
  (``ModelError``, also exit 2; its contents are checked when it is loaded,
  the next step);
* inputs: ``source.path`` for an images source, ``source.replay.scene``; a
  GStreamer ``source.pipeline`` needs an OpenCV built with GStreamer;
* the swarm: ``swarm.key_file`` holds valid keys, ``swarm.bind`` and ``swarm.seeds`` are host:port;
* the camera: ``service.snapshot_token_file`` holds a one-line token;
* writable state: ``engine.state_dir`` (crash breadcrumbs, when an
  accelerator is configured), ``ota.state_dir`` (when OTA is on), the JSONL
  sink's directory, and the cache a ``.tar`` bundle is unpacked into.

A check that needs its feature's optional library imports it inside.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from edgerun.config import Config
from edgerun.errors import ConfigError, ModelError

Check = Callable[[Config], None]


def preflight(cfg: Config) -> None:
    """Run every check; the first failure raises (ConfigError or ModelError, both exit 2)."""
    for check in CHECKS:
        check(cfg)


def check_root_keys(cfg: Config) -> None:
    ota = cfg.ota
    if not ota.enabled:
        return
    from edgerun.ota.errors import Rejected, SignatureError
    from edgerun.ota.trust import TrustStore
    from edgerun.ota.updater import load_root_keys

    try:
        TrustStore(load_root_keys(ota.root_keys), ota.root_threshold)
    except (SignatureError, Rejected) as err:
        raise ConfigError(f"ota.root_keys: {err}") from None


def check_tls(cfg: Config) -> None:
    mqtt = cfg.sinks.mqtt
    if not (mqtt.enabled or (cfg.ota.enabled and cfg.ota.mqtt)):
        return
    from edgerun.sinks.mqtt import build_ssl_context

    build_ssl_context(mqtt)  # ConfigError naming tls_ca / tls_cert


def check_bundle(cfg: Config) -> None:
    if not cfg.model.bundle:
        return
    path = Path(cfg.model.bundle)
    if not path.exists():
        raise ModelError(f"model.bundle: {path} not found")
    if not (path.is_dir() or path.is_file()):
        raise ModelError(f"model.bundle: {path} is not a directory or a tar archive")


def check_inputs(cfg: Config) -> None:
    src = cfg.source
    if src.kind == "images" and not Path(src.path).exists():
        raise ConfigError(f"source.path: {src.path} not found")
    if src.kind == "replay" and src.replay.scene and not Path(src.replay.scene).is_file():
        raise ConfigError(f"source.replay.scene: {src.replay.scene} not found")
    if src.kind == "opencv" and (src.pipeline or "!" in src.uri):
        import cv2

        if not cv2.videoio_registry.hasBackend(cv2.CAP_GSTREAMER):
            key = "source.pipeline" if src.pipeline else "source.uri"
            raise ConfigError(
                f"{key}: a GStreamer pipeline needs an OpenCV built with GStreamer, and OpenCV {cv2.__version__} "
                f"at {Path(cv2.__file__).parent} has none (pip's opencv-python wheels never do; docs/camera.md)"
            )


def check_writable_dirs(cfg: Config) -> None:
    from edgerun.engines.breadcrumb import default_state_dir
    from edgerun.models.bundle import cache_dir

    dirs: list[tuple[str, Path]] = []
    if any(key != "tflite" for key in cfg.engine.order):
        dirs.append(("engine.state_dir", Path(cfg.engine.state_dir) if cfg.engine.state_dir else default_state_dir()))
    if cfg.ota.enabled:
        dirs.append(("ota.state_dir", Path(cfg.ota.state_dir) if cfg.ota.state_dir else default_state_dir()))
    jsonl = cfg.sinks.jsonl
    if jsonl.enabled and jsonl.path != "-":
        dirs.append(("sinks.jsonl.path", Path(jsonl.path).parent))
    if cfg.model.bundle and Path(cfg.model.bundle).is_file():
        dirs.append(("model.bundle (unpacked into the cache)", cache_dir()))
    for key, path in dirs:
        problem = unwritable(path)
        if problem:
            raise ConfigError(f"{key}: {path} {problem}")


def unwritable(path: Path) -> str:
    """Why the node could not create files in ``path`` (made on demand), or "" when it can."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "cannot be created"
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot be created: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
    return ""


def check_swarm(cfg: Config) -> None:
    """The swarm key file (missing, unreadable, wrong size) and the gossip addresses, each naming its key."""
    if not cfg.swarm.enabled:
        return
    from edgerun.fleet.service import load_swarm_keyring, parse_hostport, swarm_timing

    load_swarm_keyring(cfg.swarm.key_file)
    swarm_timing(cfg.swarm)
    parse_hostport(cfg.swarm.bind, "swarm.bind")
    for i, seed in enumerate(cfg.swarm.seeds):
        parse_hostport(seed, f"swarm.seeds[{i}]")


def check_snapshot(cfg: Config) -> None:
    """The snapshot token file holds a token (the HTTP service says once when the snapshot is off)."""
    svc = cfg.service
    if not (svc.http_enabled and svc.snapshot_token_file):
        return
    from edgerun.service.http import load_snapshot_token

    load_snapshot_token(svc.snapshot_token_file)


CHECKS: list[Check] = [
    check_bundle,
    check_root_keys,
    check_tls,
    check_inputs,
    check_writable_dirs,
    check_swarm,
    check_snapshot,
]

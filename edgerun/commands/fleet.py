"""``edgerun fleet status | objects | publish | promote | halt | rollback``: the fleet, what it found, its rollouts."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from edgerun.commands.options import (
    add_broker_login_options,
    add_old_spelling,
    add_root_key_options,
    load_root_keys,
    load_signing_key,
    mqtt_client_config,
    parse_hostport,
)
from edgerun.errors import ConfigError, EdgerunError
from edgerun.wire import FLEET_OBJECTS_TOPIC


def fleet_view(
    host: str, port: int, seconds: float, roots: list[Any] | None = None, threshold: int = 1, cfg: Any = None
) -> tuple[Any, dict[str, Any]]:
    """Listen to the fleet's topics for ``seconds`` and build the same model the station keeps.

    Releases are verified against ``roots`` as a node would, and shown unverified without them.
    """
    from edgerun.fleet.rollout import read_topics
    from edgerun.station.model import SUBSCRIPTIONS, FleetModel

    messages = read_topics(host, port, SUBSCRIPTIONS, seconds=seconds, quiet_s=None, cfg=cfg)
    model = FleetModel()
    now = time.time()
    for topic in sorted(messages, key=lambda t: t.endswith("/status")):  # status last: it decides online/offline
        model.ingest(topic, messages[topic], now)
    rollouts = {}
    from edgerun.station.station import Station, StationOptions

    station = Station(StationOptions(mqtt_host=host, mqtt_port=port, root_keys=roots or [], root_threshold=threshold))
    station.model = model
    for name in model.releases:
        view = station.rollout_view(name, now)
        if view is not None:
            rollouts[name] = view
    return model, rollouts


def _fmt(value: Any, spec: str = "") -> str:
    if value is None or value == "":
        return "-"
    return format(value, spec) if spec else str(value)


def cmd_fleet_status(args: argparse.Namespace) -> int:
    host, port = parse_hostport(args.mqtt, "--mqtt", 1883)
    model, rollouts = fleet_view(
        host, port, args.seconds, load_root_keys(args), args.root_threshold, mqtt_client_config(args, host, port)
    )
    now = time.time()
    nodes = [n.to_json(now, model.stale_s) for n in sorted(model.nodes.values(), key=lambda n: n.id)]
    if args.json:
        print(json.dumps({"nodes": nodes, "objects": len(model.objects), "rollouts": rollouts}, default=str))
        return 0
    header = (
        f"{'node':<20} {'state':<9} {'model':<24} {'engine':<12} {'fps':>6} {'p99 ms':>7} {'drops':>6} "
        f"{'swarm':>5}  reason"
    )
    print(header)
    for n in nodes:
        engine = (n["engine"] or "-") + (" (fallback)" if n["fallback"] else "")
        model_text = f"{n['model']} v{n['model_version']}" if n["model"] else "-"
        reason = "; ".join(f"{k}: {v}" for k, v in n["reasons"].items())
        print(
            f"{n['id']:<20} {n['state']:<9} {model_text:<24} {engine:<12} {_fmt(n['fps'], '.1f'):>6} "
            f"{_fmt(n['p99_ms'], '.1f'):>7} {_fmt(n['dropped']):>6} {_fmt(n['swarm_seen']):>5}  {reason}"
        )
    if not nodes:
        print(f"(no node heard on mqtt://{host}:{port} within {args.seconds:g} s)")
    for r in rollouts.values():
        if "error" in r:
            print(f"release {r['model']}: unreadable ({r['error']})")
            continue
        if r["trust"] in ("forged", "replayed"):
            print(f"release {r['model']} v{r['version']}: {r['trust'].upper()}, not a release: {r['trust_reason']}")
            continue
        line = f"rollout {r['model']} v{r['version']}: {r['phase']} at {r['percent']:g}%, {r['progress']}"
        if r.get("reason"):
            line += f"; {r['reason']}"
        if r["trust"] != "verified":
            line += f" [UNVERIFIED: {r['trust_reason']}]"
        print(line)
    return 0


MAX_HEARD = 100_000  # fleet messages kept by one `fleet objects` run (a few hundred bytes each)


def hear_fleet_objects(host: str, port: int, topic: str, seconds: float, cfg: Any = None) -> list[bytes]:
    """Every message on the fleet objects topic for ``seconds``, after the latest of each object the broker
    retains on ``<topic>/<id>`` (the nodes' ``sinks.mqtt.object_retain_s``)."""
    from edgerun.mqtt_client import MqttError, connect_blocking, new_client

    heard: list[bytes] = []
    lock = threading.Lock()
    subscribed = threading.Event()

    def on_message(client: Any, userdata: Any, msg: Any) -> None:
        with lock:
            if msg.payload and len(heard) < MAX_HEARD:
                heard.append(bytes(msg.payload))

    client = new_client(cfg, id_prefix="edgerun-fleet-objects")
    client.on_subscribe = lambda *args: subscribed.set()
    client.on_message = on_message
    connect_blocking(client, host, port)
    try:
        client.subscribe([(topic, 1), (f"{topic}/+", 1)])
        if not subscribed.wait(5.0):
            raise MqttError(f"mqtt://{host}:{port}: no answer to the subscription to {topic} within 5 s")
        time.sleep(seconds)
        with lock:
            return list(heard)
    finally:
        client.disconnect()
        client.loop_stop()


def _write_output(path: str, data: bytes) -> None:
    """Standard output for "-", else the file, replaced whole (a reader never sees half an export)."""
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"-o {path}: {err.strerror or err}") from None


def cmd_fleet_objects(args: argparse.Namespace) -> int:
    from edgerun.fleet.export import Export, render

    host, port = parse_hostport(args.mqtt, "--mqtt", 1883)
    if not args.seconds > 0:
        raise ConfigError(f"--seconds: expected more than 0, got {args.seconds:g}")
    cfg = mqtt_client_config(args, host, port)
    export = Export()
    for payload in hear_fleet_objects(host, port, args.topic, args.seconds, cfg):
        export.add_payload(payload)
    _write_output(args.out, render(export, args.format))
    count = len(export.objects)
    summary = f"fleet objects: {count} from mqtt://{host}:{port} {args.topic} in {args.seconds:g} s"
    unplaced = export.skipped_no_latlon
    if unplaced and args.format != "csv":
        summary += f"; {unplaced} without lat/lon (edgerun.object/1) left out of the {args.format}"
    if export.bad:
        summary += f"; {export.bad} bad messages skipped (first: {export.first_error})"
    print(summary, file=sys.stderr)
    return 0


def _control(args: argparse.Namespace) -> Any:
    from edgerun.fleet.rollout import RolloutControl

    key = load_signing_key(args.signing_key, args)
    host, port = parse_hostport(args.mqtt, "--mqtt", 1883)
    return RolloutControl(host, port, key, cfg=mqtt_client_config(args, host, port)), host, port


def _pick_model(args: argparse.Namespace, host: str, port: int) -> tuple[str, Any]:
    """The model's retained release, verified against ``--root-key`` as a node would (UnverifiedRelease if not)."""
    from edgerun.fleet.rollout import ROLLOUT_PREFIX, read_topics, rollout_topic
    from edgerun.fleet.trusted_release import ReleaseVerifier
    from edgerun.ota.transport_mqtt import TOPIC_PREFIX, release_topic

    retained = read_topics(
        host, port, [f"{TOPIC_PREFIX}/+", f"{ROLLOUT_PREFIX}/+"], cfg=mqtt_client_config(args, host, port)
    )
    models = sorted(t.rsplit("/", 1)[1] for t in retained if t.startswith(TOPIC_PREFIX + "/"))
    model = args.model
    if model is None:
        if len(models) != 1:
            found = ", ".join(models) or "none"
            raise EdgerunError(f"name the model with --model (releases on the broker: {found})")
        model = models[0]
    payload = retained.get(release_topic(model))
    if payload is None:
        raise EdgerunError(
            f"no release of {model!r} is retained on the broker (publish one with `edgerun fleet publish`)"
        )
    roots = load_root_keys(args)
    if not roots:
        raise ConfigError(
            "--root-key is required: the release on the broker is verified against the fleet's root "
            "keys before anything about it is signed"
        )
    verifier = ReleaseVerifier(roots, args.root_threshold)
    checked = verifier.check(model, payload, retained.get(rollout_topic(model)))
    checked.require_verified()
    return model, checked


def _base_version(checked: Any) -> int | None:
    """The base the signed rollout state names (an unsigned state is not believed)."""
    return checked.state.state.base_version if checked.state is not None else None


KEY_FILES = ("keys.json", "keys.json.minisig")


def _check_keys_dir(keys: str) -> None:
    for name in KEY_FILES:
        if not (Path(keys) / name).is_file():
            raise ConfigError(f"--keys {keys}: no {name} (make it with `edgerun ota keys` and `edgerun ota sign`)")


def _copy_keys(keys: str, out: Path) -> None:
    """The release key list goes with every release, so a node new to the fleet can check it."""
    for name in KEY_FILES:
        shutil.copyfile(Path(keys) / name, out / name)


def cmd_fleet_publish(args: argparse.Namespace) -> int:
    from edgerun.fleet.rollout import RolloutState, default_salt
    from edgerun.models.bundle import load_bundle
    from edgerun.ota.release import ReleaseSpec, build_release
    from edgerun.ota.transport_mqtt import publish_release
    from edgerun.progress import phases

    control, host, port = _control(args)
    if not 0.0 < args.percent <= 100.0:
        raise ConfigError(f"--percent: expected within (0, 100], got {args.percent:g}")
    _check_keys_dir(args.keys)
    bundle = load_bundle(args.release)
    base = load_bundle(args.base) if args.base else None
    if args.fleet_seconds > 0:
        # The delta only helps the nodes that run its base: say what the fleet runs before shipping one.
        fleet, _ = fleet_view(host, port, args.fleet_seconds, cfg=control.cfg)
        now = time.time()
        # A node that is gone runs nothing (its retained swarm view still names its model).
        running = Counter(
            n.model_version
            for n in fleet.nodes.values()
            if n.model == bundle.name and n.state(now, fleet.stale_s) not in ("dead", "stopped")
        )
        if running:
            print(f"the fleet runs {bundle.name} " + ", ".join(f"v{v} on {k} node(s)" for v, k in running.items()))
            if base is not None and base.version not in running:
                print(f"  warning: --base is v{base.version}, which no node runs: they will take the full payload")
            elif base is None:
                common = running.most_common(1)[0][0]
                print(f"  note: no --base: every node downloads the full payload (a delta needs the v{common} bundle)")
    salt = args.salt if args.salt is not None else default_salt(bundle.name, bundle.version)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="edgerun-release-"))
    out.mkdir(parents=True, exist_ok=True)
    _copy_keys(args.keys, out)
    spec = ReleaseSpec(expires_days=args.expires_days, rollout_percent=args.percent, rollout_salt=salt)
    with phases("fleet publish", 2) as progress:
        progress.step("build the release (payload, delta, signature)")
        release = build_release(args.release, out, spec, base_path=args.base, key=control.key)
        m = release.manifest
        progress.step(f"publish to mqtt://{host}:{port}")
        publish_release(out, m.name, host, port, cfg=control.cfg)
    phase = "complete" if args.percent >= 100 else "canary"
    state = RolloutState(
        model=m.name,
        version=m.version,
        percent=args.percent,
        salt=salt,
        phase=phase,
        by="operator",
        ts=time.time(),
        base_version=base.version if base else None,
    )
    control.announce(state)
    delta = f", delta from v{m.delta.base_version} {m.delta.size} bytes" if m.delta else ""
    print(
        f"published {m.name} v{m.version} to {args.percent:g}% of the fleet (salt {salt!r}; full "
        f"{m.target.size} bytes{delta}) on mqtt://{host}:{port}"
    )
    if release.note:
        print(f"  {release.note}")
    return 0


def _step(args: argparse.Namespace, percent: float, phase: str, reason: str) -> int:
    from edgerun.fleet.trusted_release import check_payload_on_broker

    control, host, port = _control(args)
    model, checked = _pick_model(args, host, port)
    if percent > 0:
        print(asyncio.run(check_payload_on_broker(checked, host, port, control.cfg)))
    state = control.step(checked, percent, phase, reason, "operator", _base_version(checked))
    why = f": {reason}" if reason else ""
    print(f"{model} v{state.version}: {phase} at {percent:g}% (salt {state.salt!r}){why}")
    return 0


def cmd_fleet_promote(args: argparse.Namespace) -> int:
    from edgerun.fleet.rollout import phase_for

    if not 0.0 < args.percent <= 100.0:
        raise ConfigError(f"--percent: expected within (0, 100], got {args.percent:g}")
    return _step(args, args.percent, phase_for(args.percent), "")


def cmd_fleet_retire(args: argparse.Namespace) -> int:
    """Publish a retained retire mark: every station takes the node off its fleet view and stores who and when."""
    import getpass

    import msgspec

    from edgerun import wire
    from edgerun.mqtt_client import connect_blocking, new_client, publish_confirmed
    from edgerun.station.model import NODE_ID_RE

    node = args.node
    if not NODE_ID_RE.match(node) or node in wire.RESERVED_NODE_IDS:
        raise ConfigError(f"NODE: {node[:80]!r} is not a node id")
    host, port = parse_hostport(args.mqtt, "--mqtt", 1883)
    by = args.by or f"operator:{getpass.getuser()}"
    mark = wire.RetireNode(node=node, ts=time.time(), by=by[:128], reason=args.reason[:500])
    client = new_client(mqtt_client_config(args, host, port), id_prefix="edgerun-fleet-retire")
    connect_blocking(client, host, port)
    try:
        publish_confirmed(
            client,
            f"mqtt://{host}:{port}",
            [(wire.retired_topic(node), msgspec.json.encode(mark))],
            refused_hint="is this the operator's identity?",
        )
    finally:
        client.disconnect()
        client.loop_stop()
    print(f"retired {node} (by {by}): stations take it off the fleet view until it speaks again")
    return 0


def cmd_fleet_halt(args: argparse.Namespace) -> int:
    return _step(args, 0.0, "halted", args.reason or "halted by the operator")


def versioned_copy(bundle_path: str, version: int, out: Path) -> Path:
    """A copy of a bundle under a new version number (a node's anti-rollback counter only lets versions go up)."""
    from edgerun.models.bundle import MANIFEST, load_bundle, write_manifest
    from edgerun.tomlfile import tomllib

    bundle = load_bundle(bundle_path)
    if not bundle.root.is_dir():
        raise ConfigError(f"--to {bundle_path}: give the bundle directory, not a packed tar")
    shutil.copytree(bundle.root, out)
    manifest = tomllib.loads((out / MANIFEST).read_text())
    manifest["version"] = version
    manifest.get("provenance", {}).pop("sha256", None)  # the old digest names the old version
    write_manifest(out, manifest)
    return out


def cmd_fleet_rollback(args: argparse.Namespace) -> int:
    """Halt the current release and ship the old model's contents as the next version."""
    from edgerun.fleet.rollout import RolloutState
    from edgerun.models.bundle import load_bundle
    from edgerun.ota.release import ReleaseSpec, build_release
    from edgerun.ota.transport_mqtt import publish_release

    control, host, port = _control(args)
    if not 0.0 < args.percent <= 100.0:
        raise ConfigError(f"--percent: expected within (0, 100], got {args.percent:g}")
    _check_keys_dir(args.keys)
    old = load_bundle(args.to)
    args.model = args.model or old.name
    model, checked = _pick_model(args, host, port)
    current = checked.require_verified()
    if old.name != model:
        raise ConfigError(f"--to is {old.name!r}, the release on the broker is {model!r}")
    if current.rollout.percent > 0:
        control.step(
            checked, 0.0, "halted", f"rolling back to v{old.version}'s model", "operator", _base_version(checked)
        )
        print(f"{model} v{current.version}: halted")
    version = current.version + 1
    work = Path(tempfile.mkdtemp(prefix="edgerun-rollback-"))
    try:
        bundle = versioned_copy(args.to, version, work / "bundle")
        out = work / "release"
        out.mkdir()
        _copy_keys(args.keys, out)
        salt = f"{model}-v{version}"
        spec = ReleaseSpec(expires_days=args.expires_days, rollout_percent=args.percent, rollout_salt=salt)
        release = build_release(bundle, out, spec, base_path=args.base, key=control.key)
        publish_release(out, model, host, port, cfg=control.cfg)
        phase = "complete" if args.percent >= 100 else "canary"
        control.announce(
            RolloutState(
                model=model,
                version=version,
                percent=args.percent,
                salt=salt,
                phase=phase,
                reason=f"rollback: v{old.version}'s model as v{version}",
                by="operator",
                ts=time.time(),
                base_version=current.version,
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"published {model} v{version} (the model of v{old.version}) to {args.percent:g}% of the fleet "
        f"({release.manifest.target.size} bytes) on mqtt://{host}:{port}"
    )
    return 0


def add_fleet_parser(sub: Any) -> None:
    fleet = sub.add_parser("fleet", help="the fleet from the broker: status and staged model rollouts")
    fsub = fleet.add_subparsers(dest="fleet_command", required=True)

    def common(p: argparse.ArgumentParser, signing: bool) -> None:
        p.add_argument("--mqtt", default="127.0.0.1:1883", metavar="HOST:PORT", help="the fleet's broker")
        add_root_key_options(p)
        add_broker_login_options(p)
        if signing:
            p.add_argument("--signing-key", required=True, metavar="FILE", help="release secret key")
            p.add_argument("--password-env", default=None, help="the signing key's password is in this variable")

    p = fsub.add_parser("status", help="every node, its model and health; rollouts in progress")
    common(p, False)
    p.add_argument("--seconds", type=float, default=3.0, help="listen this long (metrics come every few seconds)")
    p.add_argument("--json", action="store_true", help="print the fleet as JSON")
    p.set_defaults(func=cmd_fleet_status)
    p = fsub.add_parser(
        "objects",
        help="what the swarm found, for a ground team's map: GeoJSON, KML or CSV",
        description="Listen to the fleet objects topic and write the latest report of each object found: "
        "GeoJSON (RFC 7946) or KML 2.2 for a map, or CSV. Objects without lat/lon (edgerun.object/1) "
        "are left out of GeoJSON and KML and counted on stderr.",
    )
    p.add_argument("--mqtt", default="127.0.0.1:1883", metavar="HOST:PORT", help="the fleet's broker")
    add_broker_login_options(p)
    p.add_argument("--format", choices=["geojson", "kml", "csv"], default="geojson", help="file format")
    p.add_argument("-o", "--out", default="-", metavar="FILE", help="write here (default: standard output)")
    add_old_spelling(p, "--output", dest="out")
    p.add_argument(
        "--seconds", type=float, default=10.0, help="listen this long (objects are reported as drones find them)"
    )
    p.add_argument("--topic", default=FLEET_OBJECTS_TOPIC, help="the nodes' sinks.mqtt.fleet_topic")
    p.set_defaults(func=cmd_fleet_objects)
    p = fsub.add_parser("publish", help="publish a signed release to a canary percentage of the fleet")
    p.add_argument("release", help="the new model bundle (directory or tar)")
    common(p, True)
    p.add_argument("--percent", type=float, required=True, help="share of the fleet in the first cohort")
    p.add_argument("--keys", required=True, metavar="DIR", help="directory with keys.json and keys.json.minisig")
    p.add_argument("--base", default=None, help="the bundle the fleet runs now: ship a delta from it")
    p.add_argument("--salt", default=None, help="cohort salt (default: <model>-v<version>)")
    p.add_argument("-o", "--out", default=None, metavar="DIR", help="keep the release directory here")
    p.add_argument("--expires-days", type=float, default=30.0, help="nodes refuse the release after this many days")
    p.add_argument("--fleet-seconds", type=float, default=3.0, help="listen this long for what the fleet runs")
    p.set_defaults(func=cmd_fleet_publish)
    p = fsub.add_parser("promote", help="widen the rollout (nodes already in stay in)")
    common(p, True)
    p.add_argument("--percent", type=float, required=True, help="the share of the fleet in the rollout from now")
    p.add_argument("--model", default=None, help="the model to promote (needed when the broker holds several)")
    p.set_defaults(func=cmd_fleet_promote)
    p = fsub.add_parser("retire", help="take a node off every station's fleet view (it comes back if it speaks)")
    p.add_argument("node", metavar="NODE", help="the node's id")
    p.add_argument("--mqtt", default="127.0.0.1:1883", metavar="HOST:PORT", help="the fleet's broker")
    add_broker_login_options(p)
    p.add_argument("--by", default="", help="who retires it, as stations store it (default: operator:<login>)")
    p.add_argument("--reason", default="", help="why, as stations show and store it")
    p.set_defaults(func=cmd_fleet_retire)
    p = fsub.add_parser("halt", help="stop the rollout: no further node takes the release")
    common(p, True)
    p.add_argument("--model", default=None, help="the model to halt (needed when the broker holds several)")
    p.add_argument("--reason", default="", help="why, signed into the halt step (default: halted by the operator)")
    p.set_defaults(func=cmd_fleet_halt)
    p = fsub.add_parser("rollback", help="halt the release and ship an older model as the next version")
    common(p, True)
    p.add_argument("--to", required=True, metavar="BUNDLE", help="the model to go back to (bundle directory)")
    p.add_argument("--keys", required=True, metavar="DIR", help="directory with keys.json and keys.json.minisig")
    p.add_argument("--percent", type=float, default=100.0, help="share of the fleet that takes the older model")
    p.add_argument("--base", default=None, help="the bundle being rolled back: ship a delta from it")
    p.add_argument("--model", default=None, help="the model to roll back (default: the name in --to's bundle)")
    p.add_argument("--expires-days", type=float, default=30.0, help="nodes refuse the release after this many days")
    p.set_defaults(func=cmd_fleet_rollback)

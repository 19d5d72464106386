"""``edgerun station`` and ``edgerun fleet status | publish | promote | halt``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError, EdgerunError

# -- option parsing ------------------------------------------------------------------------


def parse_hostport(text: str, what: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ConfigError(f"{what}: expected HOST:PORT, got {text!r}")
    return host, number


def _password(args: argparse.Namespace) -> bytes | None:
    var = getattr(args, "password_env", None)
    if not var:
        return None
    if var not in os.environ:
        raise ConfigError(f"--password-env {var}: the variable is not set")
    return os.environ[var].encode()


def load_signing_key(path: str | None, args: argparse.Namespace) -> Any:
    if not path:
        return None
    from edgerun.ota.errors import OtaError
    from edgerun.ota.minisign import SecretKey

    try:
        return SecretKey.load(path, _password(args))
    except OSError as err:
        raise ConfigError(f"--signing-key {path}: {err.strerror or err}") from None
    except OtaError as err:
        raise ConfigError(f"--signing-key: {err}") from None


def mqtt_client_config(args: argparse.Namespace, host: str, port: int) -> Any:
    """Credentials and TLS for the broker from ``--mqtt-user`` and friends (a MqttSinkConfig), or None for none.

    A fleet broker with access control (deploy/mosquitto/) takes the operator's identity for ``fleet publish``,
    ``promote`` and ``halt``, and the station's identity for ``edgerun station`` and ``fleet status``.
    """
    from edgerun.config import MqttSinkConfig
    from edgerun.sinks.mqtt import build_ssl_context

    user = getattr(args, "mqtt_user", None) or ""
    password = ""
    if getattr(args, "mqtt_password_env", None):
        var = args.mqtt_password_env
        if var not in os.environ:
            raise ConfigError(f"--mqtt-password-env {var}: the variable is not set")
        password = os.environ[var]
    elif getattr(args, "mqtt_password_file", None):
        try:
            password = Path(args.mqtt_password_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"--mqtt-password-file {args.mqtt_password_file}: {err.strerror or err}") from None
    if password and not user:
        raise ConfigError("--mqtt-user: a password was given without a user name")
    for option in ("mqtt_tls_ca", "mqtt_cert", "mqtt_key"):
        path = getattr(args, option, None)
        if path and not Path(path).is_file():
            raise ConfigError(f"--{option.replace('_', '-')} {path}: no such file")
    if bool(getattr(args, "mqtt_cert", None)) != bool(getattr(args, "mqtt_key", None)):
        raise ConfigError("--mqtt-cert and --mqtt-key go together")
    tls = bool(getattr(args, "mqtt_tls", False))
    if not (user or tls or getattr(args, "mqtt_tls_ca", None) or getattr(args, "mqtt_cert", None)):
        return None
    cfg = MqttSinkConfig(host=host, port=port, username=user, password=password, tls=tls,
                         tls_ca=args.mqtt_tls_ca or "", tls_cert=args.mqtt_cert or "", tls_key=args.mqtt_key or "")
    build_ssl_context(cfg)  # unreadable or mismatched PEM files fail here, as one line
    return cfg


def load_root_keys(args: argparse.Namespace) -> list[Any]:
    """The fleet's root public keys (``--root-key``, repeatable: files or base64 lines, as in ``ota.root_keys``)."""
    from edgerun.ota.errors import OtaError
    from edgerun.ota.updater import load_root_keys as parse_roots

    entries = getattr(args, "root_key", None) or []
    try:
        roots = parse_roots(entries)
    except OSError as err:
        raise ConfigError(f"--root-key: {err.filename}: {err.strerror or err}") from None
    except OtaError as err:
        raise ConfigError(f"--root-key: {err}") from None
    threshold = getattr(args, "root_threshold", 1)
    if roots and not 1 <= threshold <= len(roots):
        raise ConfigError(f"--root-threshold {threshold}: needs 1..{len(roots)} (the root keys given)")
    return roots


def load_truth(spec: str | None) -> list[dict[str, Any]]:
    """Ground-truth outlines: a JSON file ([{"label", "box_m": [west, south, east, north]}]) or ``replay:SEED``."""
    if not spec:
        return []
    if spec.startswith("replay"):
        from edgerun.sources.replay import build_scene

        scene = build_scene(_seed(spec, "--truth"))
        return [{"label": label, "box_m": [round(float(v), 2) for v in box]}
                for box, label in zip(scene.boxes_m, scene.labels)]
    try:
        doc = json.loads(Path(spec).read_text())
    except OSError as err:
        raise ConfigError(f"--truth {spec}: {err.strerror or err}") from None
    except ValueError as err:
        raise ConfigError(f"--truth {spec}: not JSON ({err})") from None
    items = doc.get("objects") if isinstance(doc, dict) else doc
    out = []
    for i, item in enumerate(items if isinstance(items, list) else [None]):
        box = item.get("box_m") if isinstance(item, dict) else None
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
            raise ConfigError(f"--truth {spec}: objects[{i}]: expected {{\"label\", \"box_m\": [w, s, e, n]}}")
        out.append({"label": str(item.get("label", ""))[:40], "box_m": [float(v) for v in box]})
    return out


def _seed(spec: str, what: str) -> int:
    _, _, seed = spec.partition(":")
    try:
        return int(seed or 1)
    except ValueError:
        raise ConfigError(f"{what} {spec}: expected replay:SEED") from None


def prepare_ground(spec: str | None, extent: str | None, workdir: Path) -> tuple[Path | None, tuple[float, ...]]:
    """The ground image to serve and its extent (west, south, east, north metres); ``replay:SEED`` renders the scene."""
    bounds: tuple[float, ...] = (0.0, 0.0, 40.0, 40.0)
    if extent:
        try:
            bounds = tuple(float(v) for v in extent.split(","))
        except ValueError:
            bounds = ()
        if len(bounds) != 4 or bounds[2] <= bounds[0] or bounds[3] <= bounds[1]:
            raise ConfigError(f"--ground-extent: expected WEST,SOUTH,EAST,NORTH metres, got {extent!r}")
    if not spec:
        return None, bounds
    if spec.startswith("replay"):
        import cv2

        from edgerun.sources.replay import build_scene

        scene = build_scene(_seed(spec, "--ground"))
        path = workdir / "ground.jpg"
        cv2.imwrite(str(path), cv2.resize(scene.image, (1000, 1000), interpolation=cv2.INTER_AREA))
        return path, (0.0, 0.0, *scene.extent_m)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--ground {spec}: no such file")
    return path, bounds


# -- edgerun station -----------------------------------------------------------------------


def cmd_station(args: argparse.Namespace) -> int:
    from edgerun.cli import _setup_logging
    from edgerun.station.station import StationOptions

    _setup_logging(args.log_level or "info")

    from edgerun.station.server import check_bind_policy, parse_node_nets, read_snapshot_token

    if not args.mqtt:
        raise ConfigError("--mqtt HOST:PORT: say where the fleet's broker is")
    mqtt_host, mqtt_port = parse_hostport(args.mqtt, "--mqtt", 1883)
    bind_host, bind_port = parse_hostport(args.bind, "--bind", 8080)
    check_bind_policy(bind_host, args.users is not None, args.public_view)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    doors = dict(
        allowed_hosts=args.allowed_host, users_file=Path(args.users) if args.users else None,
        public_view=args.public_view, tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None, node_nets=parse_node_nets(args.node_net),
        snapshot_token=read_snapshot_token(args.snapshot_token_file) if args.snapshot_token_file else None,
    )
    node_http = {}
    for item in args.node_http:
        node, sep, address = item.partition("=")
        if not sep or not node or not address:
            raise ConfigError(f"--node-http: expected NODE=HOST:PORT, got {item!r}")
        node_http[node] = address
    workdir = Path(tempfile.mkdtemp(prefix="edgerun-station-"))
    try:
        ground, extent = prepare_ground(args.ground, args.ground_extent, workdir)
        options = StationOptions(
            mqtt_host=mqtt_host, mqtt_port=mqtt_port, bind_host=bind_host, bind_port=bind_port, ground=ground,
            mqtt_cfg=mqtt_client_config(args, mqtt_host, mqtt_port),
            ground_extent=extent,  # type: ignore[arg-type]
            truth=load_truth(args.truth), signing_key=load_signing_key(args.signing_key, args), node_http=node_http,
            root_keys=load_root_keys(args), root_threshold=args.root_threshold,
            state_dir=Path(args.state_dir) if args.state_dir else None,
            stale_s=args.stale_s, auto_halt=not args.no_auto_halt, **doors,
        )
        return asyncio.run(run_station(options, args.seconds))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def run_station(options: Any, seconds: float | None = None) -> int:
    from edgerun.station.server import StationServer
    from edgerun.station.station import Station

    station = Station(options)
    server = StationServer(station, options.bind_host, options.bind_port)
    await server.start()
    await station.start()
    key = options.signing_key
    mode = f"rollout actions signed by release key {key.public_key.id_hex}" if key else "read-only (no --signing-key)"
    if not options.root_keys:
        mode += "; releases shown unverified (no --root-key)"
    if options.users_file is not None:
        mode += f"; operators log in (--users {options.users_file})"
        mode += "; viewing is open (--public-view)" if options.public_view else ""
    elif options.public_view:
        mode += "; view only, no login (--public-view)"
    host = f"[{options.bind_host}]" if ":" in options.bind_host else options.bind_host
    print(f"station: {server.scheme}://{host}:{server.port}/ fed from mqtt://{options.mqtt_host}:"
          f"{options.mqtt_port}; {mode}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), seconds) if seconds else await stop.wait()
    except asyncio.TimeoutError:
        pass
    await server.stop()
    await station.stop()
    return 0


def cmd_station_passwd(args: argparse.Namespace) -> int:
    """Add an operator to the station's password file, or change their password (Argon2id, mode 0600)."""
    import getpass
    import sys

    from edgerun.station.auth import check_user, set_password

    check_user(args.user)
    if args.password_stdin or not sys.stdin.isatty():
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass(f"password for {args.user}: ")
        if getpass.getpass("again: ") != password:
            raise ConfigError("the two passwords differ")
    path = Path(args.file)
    created = set_password(path, args.user, password)
    print(f"{'added' if created else 'changed the password of'} operator {args.user} in {path}; "
          f"start the station with --users {path}")
    return 0


# -- edgerun fleet -------------------------------------------------------------------------


def fleet_view(host: str, port: int, seconds: float, roots: list[Any] | None = None,
               threshold: int = 1, cfg: Any = None) -> tuple[Any, dict[str, Any]]:
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
    model, rollouts = fleet_view(host, port, args.seconds, load_root_keys(args), args.root_threshold,
                                 mqtt_client_config(args, host, port))
    now = time.time()
    nodes = [n.to_json(now, model.stale_s) for n in sorted(model.nodes.values(), key=lambda n: n.id)]
    if args.json:
        print(json.dumps({"nodes": nodes, "objects": len(model.objects), "rollouts": rollouts}, default=str))
        return 0
    header = f"{'node':<20} {'state':<9} {'model':<24} {'engine':<12} {'fps':>6} {'p99 ms':>7} {'drops':>6} " \
             f"{'swarm':>5}  reason"
    print(header)
    for n in nodes:
        engine = (n["engine"] or "-") + (" (fallback)" if n["fallback"] else "")
        model_text = f"{n['model']} v{n['model_version']}" if n["model"] else "-"
        reason = "; ".join(f"{k}: {v}" for k, v in n["reasons"].items())
        print(f"{n['id']:<20} {n['state']:<9} {model_text:<24} {engine:<12} {_fmt(n['fps'], '.1f'):>6} "
              f"{_fmt(n['p99_ms'], '.1f'):>7} {_fmt(n['dropped']):>6} {_fmt(n['swarm_seen']):>5}  {reason}")
    if not nodes:
        print(f"(no node heard on mqtt://{host}:{port} within {args.seconds:g} s)")
    for r in rollouts.values():
        if "error" in r:
            print(f"release {r['model']}: unreadable ({r['error']})")
            continue
        if r["trust"] in ("forged", "replayed"):
            print(f"release {r['model']} v{r['version']}: {r['trust'].upper()}, not a release: {r['trust_reason']}")
            continue
        line = f"rollout {r['model']} v{r['version']}: {r['phase']} at {r['percent']:g}%, " \
               f"{r['nodes_on_version']} of {r['nodes']} nodes on it"
        if r.get("reason"):
            line += f"; {r['reason']}"
        if r["trust"] != "verified":
            line += f" [UNVERIFIED: {r['trust_reason']}]"
        print(line)
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

    retained = read_topics(host, port, [f"{TOPIC_PREFIX}/+", f"{ROLLOUT_PREFIX}/+"],
                           cfg=mqtt_client_config(args, host, port))
    models = sorted(t.rsplit("/", 1)[1] for t in retained if t.startswith(TOPIC_PREFIX + "/"))
    model = args.model
    if model is None:
        if len(models) != 1:
            found = ", ".join(models) or "none"
            raise EdgerunError(f"name the model with --model (releases on the broker: {found})")
        model = models[0]
    payload = retained.get(release_topic(model))
    if payload is None:
        raise EdgerunError(f"no release of {model!r} is retained on the broker "
                           "(publish one with `edgerun fleet publish`)")
    roots = load_root_keys(args)
    if not roots:
        raise ConfigError("--root-key is required: the release on the broker is verified against the fleet's root "
                          "keys before anything about it is signed")
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
            n.model_version for n in fleet.nodes.values()
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
    release = build_release(args.release, out, spec, base_path=args.base, key=control.key)
    m = release.manifest
    publish_release(out, m.name, host, port, cfg=control.cfg)
    phase = "complete" if args.percent >= 100 else "canary"
    state = RolloutState(model=m.name, version=m.version, percent=args.percent, salt=salt, phase=phase,
                         by="operator", ts=time.time(), base_version=base.version if base else None)
    control.announce(state)
    delta = f", delta from v{m.delta.base_version} {m.delta.size} bytes" if m.delta else ""
    print(f"published {m.name} v{m.version} to {args.percent:g}% of the fleet (salt {salt!r}; full "
          f"{m.target.size} bytes{delta}) on mqtt://{host}:{port}")
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
        control.step(checked, 0.0, "halted", f"rolling back to v{old.version}'s model", "operator",
                     _base_version(checked))
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
        control.announce(RolloutState(model=model, version=version, percent=args.percent, salt=salt, phase=phase,
                                      reason=f"rollback: v{old.version}'s model as v{version}", by="operator",
                                      ts=time.time(), base_version=current.version))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"published {model} v{version} (the model of v{old.version}) to {args.percent:g}% of the fleet "
          f"({release.manifest.target.size} bytes) on mqtt://{host}:{port}")
    return 0


def add_station_parsers(sub: Any) -> None:
    def roots(p: argparse.ArgumentParser) -> None:
        p.add_argument("--root-key", action="append", default=[], metavar="FILE",
                       help="a root public key of the fleet, as the nodes have it (repeat): releases on the broker "
                            "are verified against it before they are shown or signed; required with --signing-key")
        p.add_argument("--root-threshold", type=int, default=1, metavar="N",
                       help="root signatures keys.json needs (as ota.root_threshold)")

    def broker_login(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("broker login (a fleet broker with access control: deploy/mosquitto/)")
        g.add_argument("--mqtt-user", default=None, metavar="NAME",
                       help="MQTT user name (the operator's for publish/promote/halt, the station's to watch)")
        g.add_argument("--mqtt-password-env", default=None, metavar="VAR", help="the MQTT password is in this variable")
        g.add_argument("--mqtt-password-file", default=None, metavar="FILE", help="the MQTT password is in this file")
        g.add_argument("--mqtt-tls", action="store_true", help="TLS to the broker, checked against the system CAs")
        g.add_argument("--mqtt-tls-ca", default=None, metavar="PEM", help="TLS to the broker, checked against this CA")
        g.add_argument("--mqtt-cert", default=None, metavar="PEM", help="client certificate for the broker")
        g.add_argument("--mqtt-key", default=None, metavar="PEM", help="the client certificate's key")

    st = sub.add_parser("station", help="the ground station: the fleet on one page, rollout control")
    st.add_argument("--mqtt", default=None, metavar="HOST:PORT", help="the fleet's broker (required)")
    st.add_argument("--bind", default="127.0.0.1:8080", metavar="HOST:PORT", help="where the page is served")
    st.add_argument("--ground", default=None, metavar="IMAGE", help="ground image under the map (or replay:SEED)")
    st.add_argument("--ground-extent", default=None, metavar="W,S,E,N", help="metres the ground image covers")
    st.add_argument("--truth", default=None, metavar="FILE", help="ground truth outlines (JSON, or replay:SEED)")
    st.add_argument("--signing-key", default=None, metavar="FILE", help="release secret key: enables page actions")
    st.add_argument("--password-env", default=None, help="the signing key's password is in this variable")
    roots(st)
    broker_login(st)
    st.add_argument("--state-dir", default=None, metavar="DIR",
                    help="keep the rollout step ledger here, so a halt seen before a restart is still known")
    st.add_argument("--node-http", action="append", default=[], metavar="NODE=HOST:PORT",
                    help="where a node's HTTP service is (for its live snapshot; repeat)")
    st.add_argument("--stale-s", type=float, default=15.0, help="grey a node out after this long unheard")
    st.add_argument("--no-auto-halt", action="store_true", help="only warn when a canary regresses")
    st.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    st.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                    help="a name the page is reached by besides its bind address (repeat; refuses any other Host)")
    st.add_argument("--users", default=None, metavar="FILE",
                    help="operator accounts (edgerun station passwd): every page and action needs a login")
    st.add_argument("--public-view", action="store_true",
                    help="viewing needs no login (with --users: acting does; without: the page is read-only)")
    st.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate chain")
    st.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    st.add_argument("--node-net", action="append", default=[], metavar="CIDR",
                    help="fetch a snapshot from an address a node advertises only inside this range (repeat)")
    st.add_argument("--snapshot-token-file", default=None, metavar="FILE",
                    help="bearer token for the nodes' /snapshot.jpg ([service] snapshot_token_file)")
    st.set_defaults(func=cmd_station)
    st_sub = st.add_subparsers(dest="station_command", metavar="{passwd}")
    pw = st_sub.add_parser("passwd", help="add an operator to the password file or change their password")
    pw.add_argument("user", help="the operator's user name")
    pw.add_argument("--file", default="station-users", metavar="PATH", help="the password file (default: %(default)s)")
    pw.add_argument("--password-stdin", action="store_true",
                    help="read the password from the first line of stdin (default when stdin is not a terminal)")
    pw.set_defaults(func=cmd_station_passwd)

    fleet = sub.add_parser("fleet", help="the fleet from the broker: status and staged model rollouts")
    fsub = fleet.add_subparsers(dest="fleet_command", required=True)

    def common(p: argparse.ArgumentParser, signing: bool) -> None:
        p.add_argument("--mqtt", default="127.0.0.1:1883", metavar="HOST:PORT")
        roots(p)
        broker_login(p)
        if signing:
            p.add_argument("--signing-key", required=True, metavar="FILE", help="release secret key")
            p.add_argument("--password-env", default=None, help="the signing key's password is in this variable")

    p = fsub.add_parser("status", help="every node, its model and health; rollouts in progress")
    common(p, False)
    p.add_argument("--seconds", type=float, default=3.0, help="listen this long (metrics come every few seconds)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fleet_status)
    p = fsub.add_parser("publish", help="publish a signed release to a canary percentage of the fleet")
    p.add_argument("release", help="the new model bundle (directory or tar)")
    common(p, True)
    p.add_argument("--percent", type=float, required=True, help="share of the fleet in the first cohort")
    p.add_argument("--keys", required=True, metavar="DIR", help="directory with keys.json and keys.json.minisig")
    p.add_argument("--base", default=None, help="the bundle the fleet runs now: ship a delta from it")
    p.add_argument("--salt", default=None, help="cohort salt (default: <model>-v<version>)")
    p.add_argument("--out", default=None, help="keep the release directory here")
    p.add_argument("--expires-days", type=float, default=30.0)
    p.add_argument("--fleet-seconds", type=float, default=3.0, help="listen this long for what the fleet runs")
    p.set_defaults(func=cmd_fleet_publish)
    p = fsub.add_parser("promote", help="widen the rollout (nodes already in stay in)")
    common(p, True)
    p.add_argument("--percent", type=float, required=True)
    p.add_argument("--model", default=None)
    p.set_defaults(func=cmd_fleet_promote)
    p = fsub.add_parser("halt", help="stop the rollout: no further node takes the release")
    common(p, True)
    p.add_argument("--model", default=None)
    p.add_argument("--reason", default="")
    p.set_defaults(func=cmd_fleet_halt)
    p = fsub.add_parser("rollback", help="halt the release and ship an older model as the next version")
    common(p, True)
    p.add_argument("--to", required=True, metavar="BUNDLE", help="the model to go back to (bundle directory)")
    p.add_argument("--keys", required=True, metavar="DIR", help="directory with keys.json and keys.json.minisig")
    p.add_argument("--percent", type=float, default=100.0)
    p.add_argument("--base", default=None, help="the bundle being rolled back: ship a delta from it")
    p.add_argument("--model", default=None)
    p.add_argument("--expires-days", type=float, default=30.0)
    p.set_defaults(func=cmd_fleet_rollback)


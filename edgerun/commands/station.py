"""``edgerun station`` (and ``station passwd``): the ground station page fed from the fleet's broker."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

from edgerun.commands.options import (
    add_broker_login_options,
    add_root_key_options,
    ask_new_password,
    first_stdin_line,
    load_root_keys,
    load_signing_key,
    log_level,
    mqtt_client_config,
    parse_hostport,
    setup_logging,
)
from edgerun.errors import ConfigError

# -- ground and truth ----------------------------------------------------------------------


def load_truth(spec: str | None) -> list[dict[str, Any]]:
    """Ground-truth outlines: a JSON file ([{"label", "box_m": [west, south, east, north]}]) or ``replay:SEED``."""
    if not spec:
        return []
    if spec.startswith("replay"):
        from edgerun.sources.replay import build_scene

        scene = build_scene(_seed(spec, "--truth"))
        return [
            {"label": label, "box_m": [round(float(v), 2) for v in box]}
            for box, label in zip(scene.boxes_m, scene.labels)
        ]
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
            raise ConfigError(f'--truth {spec}: objects[{i}]: expected {{"label", "box_m": [w, s, e, n]}}')
        out.append({"label": str(item.get("label", ""))[:40], "box_m": [float(v) for v in box]})
    return out


def _seed(spec: str, what: str) -> int:
    _, _, seed = spec.partition(":")
    try:
        return int(seed or 1)
    except ValueError:
        raise ConfigError(f"{what} {spec}: expected replay:SEED") from None


def prepare_ground(
    spec: str | None, extent: str | None, workdir: Path
) -> tuple[Path | None, tuple[float, float, float, float]]:
    """The ground image to serve and its extent (west, south, east, north metres); ``replay:SEED`` renders the scene."""
    bounds = (0.0, 0.0, 40.0, 40.0)
    if extent:
        try:
            values = [float(v) for v in extent.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or values[2] <= values[0] or values[3] <= values[1]:
            raise ConfigError(f"--ground-extent: expected WEST,SOUTH,EAST,NORTH metres, got {extent!r}")
        bounds = (values[0], values[1], values[2], values[3])
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
    from edgerun.station.station import StationOptions

    setup_logging(log_level(args, "info"))

    from edgerun.station.server import check_bind_policy, parse_node_nets, read_snapshot_token

    if not args.mqtt:
        raise ConfigError("--mqtt HOST:PORT: say where the fleet's broker is")
    mqtt_host, mqtt_port = parse_hostport(args.mqtt, "--mqtt", 1883)
    bind_host, bind_port = parse_hostport(args.bind, "--bind", 8080)
    check_bind_policy(bind_host, args.users is not None, args.public_view)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    doors = dict(
        allowed_hosts=args.allowed_host,
        users_file=Path(args.users) if args.users else None,
        public_view=args.public_view,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        node_nets=parse_node_nets(args.node_net),
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
            mqtt_host=mqtt_host,
            mqtt_port=mqtt_port,
            bind_host=bind_host,
            bind_port=bind_port,
            ground=ground,
            tiles=Path(args.tiles) if args.tiles else None,
            mqtt_cfg=mqtt_client_config(args, mqtt_host, mqtt_port),
            ground_extent=extent,
            truth=load_truth(args.truth),
            signing_key=load_signing_key(args.signing_key, args),
            node_http=node_http,
            root_keys=load_root_keys(args),
            root_threshold=args.root_threshold,
            state_dir=Path(args.state_dir) if args.state_dir else None,
            stale_s=args.stale_s,
            auto_halt=not args.no_auto_halt,
            **alert_options(args),
            **store_options(args),
            **doors,
        )
        return asyncio.run(run_station(options, args.seconds))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def alert_options(args: argparse.Namespace) -> dict[str, Any]:
    """--alert-labels, --alert-webhook and --page-url as StationOptions fields."""
    from edgerun.station.webhook import check_webhook_url

    labels = [label.strip() for label in (args.alert_labels or "").split(",") if label.strip()]
    if args.page_url and not args.page_url.startswith(("http://", "https://")):
        raise ConfigError(f"--page-url: expected an http:// or https:// URL, got {args.page_url!r}")
    if args.alert_image_wait_s < 0 or args.alert_max_age_s <= 0:
        raise ConfigError("--alert-image-wait-s must be 0 or more and --alert-max-age-s positive")
    if args.ack_expiry_s < 0:
        raise ConfigError("--ack-expiry-s must be 0 (kept until cleared) or more")
    return {
        "alert_labels": labels,
        "alert_webhook": check_webhook_url(args.alert_webhook) if args.alert_webhook else None,
        "page_url": args.page_url or "",
        "alert_image_wait_s": args.alert_image_wait_s,
        "alert_max_age_s": args.alert_max_age_s,
        "ack_expiry_s": args.ack_expiry_s,
    }


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    """--db and its retention as StationOptions fields (``--db none``: keep nothing, as before the store)."""
    from edgerun.station.store import default_db_path

    db = args.db if args.db is not None else str(default_db_path())
    if args.db_max_age_days <= 0:
        raise ConfigError(f"--db-max-age-days: must be positive, got {args.db_max_age_days:g}")
    if args.db_max_mb <= 0:
        raise ConfigError(f"--db-max-mb: must be positive, got {args.db_max_mb:g}")
    if args.session_expiry_s < 0:
        raise ConfigError(f"--session-expiry-s: must be 0 or more, got {args.session_expiry_s}")
    return {
        "db": None if db == "none" else db,
        "db_max_age_s": args.db_max_age_days * 86400.0,
        "db_max_bytes": int(args.db_max_mb * 1024 * 1024),
        "session_expiry_s": args.session_expiry_s,
    }


async def run_station(options: Any, seconds: float | None = None) -> int:
    from edgerun.station.server import StationServer
    from edgerun.station.station import Station

    station = Station(options)
    if station.store is not None:
        mode_store = f"; mission kept in {station.store.redacted}"
    else:
        mode_store = "; nothing kept across restarts (--db none)"
    await station.restore()
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
    options.page_url = options.page_url or f"{server.scheme}://{host}:{server.port}"  # the webhook's links
    if options.alert_webhook:
        mode += f"; new finds are POSTed to {options.alert_webhook}"
    print(
        f"station: {server.scheme}://{host}:{server.port}/ fed from mqtt://{options.mqtt_host}:"
        f"{options.mqtt_port}; {mode}{mode_store}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    refused = station.subscriber.refused_for_good
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(refused.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds or None, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
        await server.stop()
        await station.stop()
    if refused.is_set():  # a wrong password or a login the ACL forbids: a person must fix it (exit 2)
        from edgerun.mqtt_client import MqttLoginRefused

        raise MqttLoginRefused(station.subscriber.refusal)
    if not station.subscriber.connected_once:  # it served a page of nothing: say why, and exit non-zero
        from edgerun.mqtt_client import MqttError

        why = station.subscriber.last_failure or f"mqtt://{options.mqtt_host}:{options.mqtt_port}: no answer"
        raise MqttError(f"station: never connected: {why.removesuffix('; retrying').removesuffix('; reconnecting')}")
    return 0


def cmd_station_passwd(args: argparse.Namespace) -> int:
    """Add an operator to the station's password file, or change their password (Argon2id, mode 0600)."""
    import sys

    from edgerun.station.auth import check_user, set_password

    check_user(args.user)
    if args.password_stdin or not sys.stdin.isatty():
        password = first_stdin_line()
    else:
        password = ask_new_password(f"password for {args.user}: ", "again: ", ConfigError("the two passwords differ"))
    path = Path(args.file)
    created = set_password(path, args.user, password)
    print(
        f"{'added' if created else 'changed the password of'} operator {args.user} in {path}; "
        f"start the station with --users {path}"
    )
    return 0


def add_station_parser(sub: Any) -> None:
    st = sub.add_parser("station", help="the ground station: the fleet on one page, rollout control")
    st.add_argument("--mqtt", default=None, metavar="HOST:PORT", help="the fleet's broker (required)")
    st.add_argument("--bind", default="127.0.0.1:8080", metavar="HOST:PORT", help="where the page is served")
    st.add_argument("--ground", default=None, metavar="IMAGE", help="ground image under the map (or replay:SEED)")
    st.add_argument("--ground-extent", default=None, metavar="W,S,E,N", help="metres the ground image covers")
    st.add_argument(
        "--tiles", default=None, metavar="PATH", help="offline basemap: a {z}/{x}/{y}.png directory or an .mbtiles file"
    )
    st.add_argument("--truth", default=None, metavar="FILE", help="ground truth outlines (JSON, or replay:SEED)")
    st.add_argument("--signing-key", default=None, metavar="FILE", help="release secret key: enables page actions")
    st.add_argument("--password-env", default=None, help="the signing key's password is in this variable")
    add_root_key_options(st)
    add_broker_login_options(st)
    st.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="keep the rollout step ledger here, so a halt seen before a restart is still known",
    )
    st.add_argument(
        "--node-http",
        action="append",
        default=[],
        metavar="NODE=HOST:PORT",
        help="where a node's HTTP service is (for its live snapshot; repeat)",
    )
    st.add_argument(
        "--db",
        default=None,
        metavar="PATH|URL",
        help="keep the mission here: a SQLite file (default: $XDG_STATE_HOME/edgerun/station.db), a "
        "postgresql://USER@HOST/DB URL that several stations share, or 'none'",
    )
    st.add_argument(
        "--db-max-age-days", type=float, default=30.0, help="forget events, objects and nodes older than this"
    )
    st.add_argument(
        "--db-max-mb", type=float, default=2048.0, help="keep the stored rows under this size (oldest history first)"
    )
    st.add_argument(
        "--session-expiry-s",
        type=int,
        default=3600,
        help="the broker keeps the station's subscriptions and queued messages this long while it is down (0: no)",
    )
    st.add_argument(
        "--alert-labels",
        default=None,
        metavar="LABEL,...",
        help="only new objects with these labels alert the page and the webhook (default: every label)",
    )
    st.add_argument(
        "--alert-webhook",
        default=None,
        metavar="URL",
        help="POST a JSON body for each new alert here (retried with backoff, bounded; pending posts kept in --db)",
    )
    st.add_argument(
        "--alert-image-wait-s",
        type=float,
        default=3.0,
        help="a webhook post waits this long for its find's picture, then goes without it (and says so)",
    )
    st.add_argument(
        "--ack-expiry-s",
        type=int,
        default=3 * 86400,
        help="the broker forgets an acknowledgement's retained mark after this long (default 3 days; 0: never)",
    )
    st.add_argument(
        "--alert-max-age-s",
        type=float,
        default=3600.0,
        help="give up (counted) a webhook post still pending after this long (the receiver was down)",
    )
    st.add_argument(
        "--page-url",
        default=None,
        metavar="URL",
        help="the page's address as the webhook's receiver reaches it (default: the bind address)",
    )
    st.add_argument("--stale-s", type=float, default=15.0, help="grey a node out after this long unheard")
    st.add_argument("--no-auto-halt", action="store_true", help="only warn when a canary regresses")
    st.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    st.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the page is reached by besides its bind address (repeat; refuses any other Host)",
    )
    st.add_argument(
        "--users",
        default=None,
        metavar="FILE",
        help="operator accounts (edgerun station passwd): every page and action needs a login",
    )
    st.add_argument(
        "--public-view",
        action="store_true",
        help="viewing needs no login (with --users: acting does; without: the page is read-only)",
    )
    st.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate chain")
    st.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    st.add_argument(
        "--node-net",
        action="append",
        default=[],
        metavar="CIDR",
        help="fetch a snapshot from an address a node advertises only inside this range (repeat)",
    )
    st.add_argument(
        "--snapshot-token-file",
        default=None,
        metavar="FILE",
        help="bearer token for the nodes' /snapshot.jpg ([service] snapshot_token_file)",
    )
    st.set_defaults(func=cmd_station)
    st_sub = st.add_subparsers(dest="station_command", metavar="{passwd}")
    pw = st_sub.add_parser("passwd", help="add an operator to the password file or change their password")
    pw.add_argument("user", help="the operator's user name")
    pw.add_argument("--file", default="station-users", metavar="PATH", help="the password file (default: %(default)s)")
    pw.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the password from the first line of stdin (default when stdin is not a terminal)",
    )
    pw.set_defaults(func=cmd_station_passwd)

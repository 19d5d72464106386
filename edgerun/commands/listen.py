"""``edgerun listen``: watch what nodes publish, over MQTT or DDS, without other tools.

One line per message: a short human summary, or the message as JSON with
--json. Everything received is untrusted: a payload that is too big, not
UTF-8, not JSON or not shaped like edgerun.detections/1 is counted and
skipped (the first one is described on stderr), never a crash.

    edgerun listen --mqtt 127.0.0.1:1883                      # every node's detections
    edgerun listen --mqtt 127.0.0.1:1883 --topic 'edgerun/#'  # and events, status, metrics
    edgerun listen --dds --json                                # native DDS topic, as JSON lines
    edgerun listen --dds --ros2                                # vision_msgs/Detection2DArray topics
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from edgerun.commands.options import add_broker_login_options, add_old_spelling
from edgerun.errors import EdgerunError
from edgerun.listen import DEFAULT_MAX_BYTES, DEFAULT_MQTT_TOPIC, Printer, _listen_dds, _listen_mqtt


def _add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("source (one of)")
    src.add_argument("--mqtt", metavar="HOST:PORT", default=None, help="subscribe at this MQTT broker")
    src.add_argument("--dds", action="store_true", help="read the native DDS topic (edgerun/detections)")
    src.add_argument("--ros2", action="store_true", help="with --dds: read vision_msgs/Detection2DArray topics")
    p.add_argument("--json", action="store_true", help="print each message as one JSON line")
    p.add_argument("--count", type=int, default=0, help="exit after this many messages (exit 1 if not reached)")
    p.add_argument("--seconds", type=float, default=0.0, help="exit after this many seconds")
    p.add_argument("--node", default="", help="only this node's detections")
    p.add_argument(
        "--topic",
        action="append",
        default=None,
        help=f"MQTT topic filter, repeatable (default {DEFAULT_MQTT_TOPIC}); with --dds a native topic name",
    )
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="skip larger MQTT payloads")
    mq = p.add_argument_group("MQTT")
    mq.add_argument("--qos", type=int, choices=[0, 1], default=0, help="subscription QoS")
    mq.add_argument("--mqtt-tls-insecure", action="store_true", help="with TLS: skip the host name check")
    # The login options every broker-facing command shares (--mqtt-user, --mqtt-password-env/-file, --mqtt-tls,
    # --mqtt-tls-ca, --mqtt-cert, --mqtt-key); listen's earlier spellings still parse, hidden from help.
    add_broker_login_options(p)
    add_old_spelling(p, "--username", dest="mqtt_user")
    add_old_spelling(p, "--password", dest="listen_password")  # a password in argv shows in ps: the env/file ones
    add_old_spelling(p, "--tls", dest="mqtt_tls", action="store_true")
    add_old_spelling(p, "--tls-ca", dest="mqtt_tls_ca")
    add_old_spelling(p, "--tls-cert", dest="mqtt_cert")
    add_old_spelling(p, "--tls-key", dest="mqtt_key")
    add_old_spelling(p, "--tls-insecure", dest="mqtt_tls_insecure", action="store_true")
    dd = p.add_argument_group("DDS")
    dd.add_argument("--domain", type=int, default=0, help="DDS domain id")
    dd.add_argument("--interface", default="lo", help="network interface (default lo: loopback, no multicast)")
    dd.add_argument("--dds-config", default="", help="Cyclone DDS XML (inline or a path); overrides --interface")
    dd.add_argument("--namespace", default="", help="with --ros2: read only rt/<namespace>/detections")


def add_listen_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``listen`` to the ``edgerun`` command line (``args.func`` is ``run_listen``)."""
    p = subparsers.add_parser(
        "listen",
        help="print the detections nodes publish (MQTT or DDS), one per line",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    _add_arguments(p)
    p.set_defaults(func=run_listen)
    return p


def run_listen(args: argparse.Namespace) -> int:
    """Listen until ``--count`` messages, ``--seconds`` or Ctrl-C; 0 on success, 1 if ``--count`` was not met."""
    if args.ros2:
        args.dds = True
    if bool(args.mqtt) == bool(args.dds):
        raise EdgerunError("listen: give exactly one of --mqtt HOST:PORT or --dds")
    if args.count < 0 or args.seconds < 0 or args.max_bytes < 1:
        raise EdgerunError("listen: --count, --seconds and --max-bytes must not be negative")
    printer = Printer(args.json, args.count)
    try:
        if args.mqtt:
            _listen_mqtt(args, printer)
        else:
            _listen_dds(args, printer)
    except KeyboardInterrupt:
        pass
    if printer.bad:
        print(f"listen: {printer.bad} bad messages skipped", file=sys.stderr, flush=True)
    return 1 if args.count and printer.printed < args.count else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgerun listen", description=__doc__.split("\n\n")[1] if __doc__ else None)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_listen(args)
    except EdgerunError as err:
        print(f"edgerun: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())

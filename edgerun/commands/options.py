"""What several ``edgerun`` subcommands share: logging, HOST:PORT, passwords, signing and root keys, broker login."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError, EdgerunError
from edgerun.hostport import parse_hostport as parse_hostport  # the commands' HOST:PORT options

# -- logging -------------------------------------------------------------------------------


def setup_logging(level: str) -> None:
    from edgerun.service.journal import JournalHandler, journal_stream_is

    if journal_stream_is(sys.stderr):  # under systemd: structured journal entries instead of plain lines
        logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[JournalHandler()])
        return
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# -- addresses -----------------------------------------------------------------------------


# -- passwords -----------------------------------------------------------------------------


def env_password(option: str, var: str, error: type[EdgerunError] = ConfigError) -> str:
    """The password in the environment variable ``var`` that ``option`` names; ``error`` when it is not set."""
    if var not in os.environ:
        raise error(f"{option} {var}: the variable is not set")
    return os.environ[var]


def key_password(args: argparse.Namespace, error: type[EdgerunError] = ConfigError) -> bytes | None:
    """A secret key's password from ``--password-env``, or None when the option is not given."""
    var = getattr(args, "password_env", None)
    if not var:
        return None
    return env_password("--password-env", var, error).encode()


def first_stdin_line() -> str:
    return sys.stdin.readline().rstrip("\r\n")


def ask_new_password(prompt: str, again: str, mismatch: EdgerunError, empty: EdgerunError | None = None) -> str:
    """A new password typed twice on the terminal; ``empty`` (if given) refuses an empty one before the second ask."""
    import getpass

    password = getpass.getpass(prompt)
    if not password and empty is not None:
        raise empty
    if getpass.getpass(again) != password:
        raise mismatch
    return password


# -- keys ----------------------------------------------------------------------------------


def load_signing_key(path: str | None, args: argparse.Namespace) -> Any:
    if not path:
        return None
    from edgerun.ota.errors import OtaError
    from edgerun.ota.minisign import SecretKey

    try:
        return SecretKey.load(path, key_password(args))
    except OSError as err:
        raise ConfigError(f"--signing-key {path}: {err.strerror or err}") from None
    except OtaError as err:
        raise ConfigError(f"--signing-key: {err}") from None


def add_root_key_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root-key",
        action="append",
        default=[],
        metavar="FILE",
        help="a root public key of the fleet, as the nodes have it (repeat): releases on the broker "
        "are verified against it before they are shown or signed; required with --signing-key",
    )
    p.add_argument(
        "--root-threshold",
        type=int,
        default=1,
        metavar="N",
        help="root signatures keys.json needs (as ota.root_threshold)",
    )


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


# -- broker login --------------------------------------------------------------------------


def add_broker_login_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker login (a fleet broker with access control: deploy/mosquitto/)")
    g.add_argument(
        "--mqtt-user",
        default=None,
        metavar="NAME",
        help="MQTT user name (the operator's for publish/promote/halt, the station's to watch)",
    )
    g.add_argument("--mqtt-password-env", default=None, metavar="VAR", help="the MQTT password is in this variable")
    g.add_argument("--mqtt-password-file", default=None, metavar="FILE", help="the MQTT password is in this file")
    g.add_argument("--mqtt-tls", action="store_true", help="TLS to the broker, checked against the system CAs")
    g.add_argument("--mqtt-tls-ca", default=None, metavar="PEM", help="TLS to the broker, checked against this CA")
    g.add_argument("--mqtt-cert", default=None, metavar="PEM", help="client certificate for the broker")
    g.add_argument("--mqtt-key", default=None, metavar="PEM", help="the client certificate's key")


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
        password = env_password("--mqtt-password-env", args.mqtt_password_env)
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
    cfg = MqttSinkConfig(
        host=host,
        port=port,
        username=user,
        password=password,
        tls=tls,
        tls_ca=args.mqtt_tls_ca or "",
        tls_cert=args.mqtt_cert or "",
        tls_key=args.mqtt_key or "",
    )
    build_ssl_context(cfg)  # unreadable or mismatched PEM files fail here, as one line
    return cfg

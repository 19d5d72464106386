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


LOG_LEVELS = ("debug", "info", "warning", "error")
_VERBOSITY_GROUP = "logging (before or after the subcommand)"


def add_verbosity_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """``--log-level``, ``-v/--verbose`` and ``-q/--quiet`` on ``edgerun`` itself (``top``) or on a subcommand.

    Both positions work: ``edgerun -v listen`` and ``edgerun listen -v``. A subcommand's defaults would overwrite
    what was given before it (argparse copies the subcommand's namespace over the top one), so the subcommand's
    copies default to SUPPRESS and count into their own dests; ``log_level`` adds the two positions up.
    """
    suffix = "" if top else "_after"
    unset: Any = None if top else argparse.SUPPRESS
    group = p.add_argument_group(_VERBOSITY_GROUP)
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=unset,
        dest="log_level" + suffix,
        help="log from this level up (overrides -v/-q; default: the command's own, often warning)",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=unset if not top else 0,
        dest="verbose" + suffix,
        help="log one level more (repeatable: -vv for debug from warning)",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="count",
        default=unset if not top else 0,
        dest="quiet" + suffix,
        help="log one level less (repeatable: -qq for errors only from info)",
    )


def log_level(args: argparse.Namespace, default: str) -> str:
    """The level the person asked for: ``--log-level`` (the later position wins), else ``default`` moved one
    step per ``-v`` (more) and ``-q`` (less), counted in both positions and kept within debug..error."""
    explicit = getattr(args, "log_level_after", None) or getattr(args, "log_level", None)
    if explicit:
        return str(explicit)
    steps = getattr(args, "quiet", 0) + getattr(args, "quiet_after", 0)
    steps -= getattr(args, "verbose", 0) + getattr(args, "verbose_after", 0)
    start = LOG_LEVELS.index(default) if default in LOG_LEVELS else LOG_LEVELS.index("warning")
    return LOG_LEVELS[min(max(start + steps, 0), len(LOG_LEVELS) - 1)]


def verbosity_given(args: argparse.Namespace) -> bool:
    """Whether any of ``--log-level``, ``-v`` or ``-q`` was on the command line, in either position."""
    return bool(
        getattr(args, "log_level", None)
        or getattr(args, "log_level_after", None)
        or getattr(args, "verbose", 0)
        or getattr(args, "verbose_after", 0)
        or getattr(args, "quiet", 0)
        or getattr(args, "quiet_after", 0)
    )


_handlers_made: list[logging.Handler] = []  # by setup_logging, so a second call finds its own


def setup_logging(level: str) -> None:
    """Plain lines on stderr (journal entries under systemd) from ``level`` up; a second call only sets the level.

    ``edgerun`` configures logging before a command when -v/-q/--log-level was given, and the command may
    configure it again with its own default (``run`` takes node.log_level): the handler is made once.
    """
    from edgerun.service.journal import JournalHandler, journal_stream_is

    numeric = getattr(logging, level.upper(), logging.INFO)
    root = logging.getLogger()
    if any(handler in root.handlers for handler in _handlers_made):
        root.setLevel(numeric)
        return
    handler: logging.Handler
    if journal_stream_is(sys.stderr):  # under systemd: structured journal entries instead of plain lines
        handler = JournalHandler()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _handlers_made.append(handler)
    logging.basicConfig(level=numeric, handlers=[handler])


# -- help and spellings -----------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default where it tells something (not None, False or an empty list),
    unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is False  # a switch: off unless given
            or default in ("", [], argparse.SUPPRESS)
            or isinstance(action, (argparse._CountAction, argparse._VersionAction))
        ):
            return text
        return f"{text} (default: %(default)s)"


def add_old_spelling(p: argparse.ArgumentParser, *flags: str, dest: str, **kwargs: Any) -> None:
    """An earlier spelling of an option that documented usage and scripts still type: it works, help hides it.

    One spelling per idea across commands (``--force``, ``--signing-key``, ``--percent``, ``-o/--out``); the old
    one sets the same ``dest`` and has no default of its own, so the new spelling's default stands.
    """
    p.add_argument(*flags, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def require_one_spelling(p: argparse.ArgumentParser, dest: str, flag: str) -> None:
    """Make ``flag`` required although an old spelling may give it instead (argparse checks each action alone).

    ``edgerun`` checks after parsing (``missing_required``) and reports it as argparse would.
    """
    required = [*(p.get_default("required_spellings") or []), (dest, flag)]
    p.set_defaults(required_spellings=required, command_parser=p)


def missing_required(args: argparse.Namespace) -> str | None:
    """The first option that ``require_one_spelling`` made required and neither spelling gave, or None."""
    for dest, flag in getattr(args, "required_spellings", None) or []:
        if getattr(args, dest, None) is None:
            return flag
    return None


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

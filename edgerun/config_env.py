"""Config keys from environment variables: ``EDGERUN_<SECTION>_<KEY>`` over the TOML file.

balena sets per-device and per-fleet variables in the dashboard; this is how they reach the node:
``EDGERUN_SINKS_MQTT_HOST=broker.lan`` is ``[sinks.mqtt] host = "broker.lan"``,
``EDGERUN_SERVICE_HTTP_PORT=9100`` is ``[service] http_port = 9100``. A variable overrides the file.
Names are matched against the config's own structure (sections, then keys, both may contain ``_``),
so every key of ``Config`` has exactly one variable and nothing is listed by hand.

Values are read as TOML values (``9100``, ``true``, ``["a", "b"]``, ``0.5``); a string key takes the
text as it is, a list of strings also takes ``a,b,c``, a bool also ``1/0/yes/no/on/off``. Validation is
the TOML's own, and a bad variable is one line naming it:
``EDGERUN_SERVICE_HTTP_PORT: service.http_port: expected int <= 65535, got 70000``.

Variables whose first word is not a config section (``EDGERUN_CACHE``, the balena health check's
``EDGERUN_HTTP_PORT``) are not config and are left alone.
"""

from __future__ import annotations

import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping

import msgspec

from edgerun.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6)
    import tomli as tomllib

PREFIX = "EDGERUN_"
BOOL_WORDS = {"1": True, "yes": True, "on": True, "0": False, "no": False, "off": False}


def _plain(tp: Any) -> Any:
    """The type under Annotated[...] and ``X | None``."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1:
        return _plain(args[0])
    return tp


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _fields(section: type) -> dict[str, Any]:
    return {name: _plain(tp) for name, tp in typing.get_type_hints(section, include_extras=True).items()}


def resolve(words: list[str], section: type, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], Any] | None:
    """The key path and type that ``words`` (lower case, split at ``_``) name under ``section``, or None."""
    fields = _fields(section)
    for end in range(len(words), 0, -1):  # longest first: http_port before http
        name = "_".join(words[:end])
        if name not in fields:
            continue
        tp, rest = fields[name], words[end:]
        if _is_section(tp):
            found = resolve(rest, tp, (*path, name)) if rest else None
        else:
            found = ((*path, name), tp) if not rest else None
        if found is not None:
            return found
    return None


def parse_value(text: str, tp: Any) -> Any:
    """A variable's text as the value a TOML file would give for a key of type ``tp``."""
    if tp is str:
        return text
    stripped = text.strip()
    if tp is bool and stripped.lower() in BOOL_WORDS:
        return BOOL_WORDS[stripped.lower()]
    try:
        return tomllib.loads(f"v = {stripped}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if typing.get_origin(tp) is list and typing.get_args(tp) == (str,):
        return [item.strip() for item in stripped.split(",") if item.strip()]
    return text  # validation then says what was expected and shows this text


@dataclass
class EnvOverlay:
    """The config table with the variables applied, and which variable set which key path."""

    data: dict[str, Any]
    variables: dict[str, str] = field(default_factory=dict)  # "sinks.mqtt.host" -> "EDGERUN_SINKS_MQTT_HOST"

    def source_of(self, err: ConfigError) -> str | None:
        """The variable behind a validation error's key path, when a variable set it."""
        key = str(err).split(":", 1)[0]
        return self.variables.get(key.split("[", 1)[0])


def overlay_env(data: dict[str, Any], environ: Mapping[str, str] | None = None, root: type | None = None) -> EnvOverlay:
    """Apply every ``EDGERUN_<SECTION>_<KEY>`` variable to a parsed TOML table (a copy)."""
    if root is None:
        from edgerun.config import Config

        root = Config
    environ = os.environ if environ is None else environ
    sections = {name for name, tp in _fields(root).items() if _is_section(tp)}
    merged = _copy_tables(data)
    overlay = EnvOverlay(merged)
    for var in sorted(environ):
        if not var.startswith(PREFIX):
            continue
        words = var[len(PREFIX) :].lower().split("_")
        if not any("_".join(words[:i]) in sections for i in range(1, len(words) + 1)):
            continue  # not a config variable
        found = resolve(words, root)
        if found is None:
            raise ConfigError(f"{var}: names no config key (EDGERUN_<SECTION>_<KEY>, e.g. EDGERUN_SINKS_MQTT_HOST)")
        path, tp = found
        table = merged
        for part in path[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{var}: {'.'.join(path[:-1])} is not a table in the config file")
        table[path[-1]] = parse_value(environ[var], tp)
        overlay.variables[".".join(path)] = var
    return overlay


def _copy_tables(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_tables(v) if isinstance(v, dict) else v for k, v in data.items()}

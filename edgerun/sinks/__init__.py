"""Detection sinks, found by key with ``sink_class``.

Sink modules are imported only when a sink is used, so a node without
paho-mqtt or cyclonedds installed still starts with the sinks it has.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from edgerun.errors import ConfigError, EdgerunError

if TYPE_CHECKING:
    from edgerun.sinks.base import Sink

# key -> "module:Class"
SINK_MODULES: dict[str, str] = {
    "jsonl": "edgerun.sinks.jsonl:JsonlSink",
    "mqtt": "edgerun.sinks.mqtt:MqttSink",
    "dds": "edgerun.sinks.dds:DdsSink",
}


def sink_class(key: str) -> type[Sink]:
    """The Sink class registered under ``key``; a missing library is one clear error."""
    try:
        target = SINK_MODULES[key]
    except KeyError:
        known = ", ".join(sorted(SINK_MODULES))
        raise ConfigError(f"sinks: expected one of {known}, got {key!r}") from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise EdgerunError(f"sinks.{key}: cannot load the {key} sink ({err})") from None
    cls: type[Sink] = getattr(module, class_name)
    return cls

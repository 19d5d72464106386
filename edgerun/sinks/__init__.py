"""Detection sinks, found by key with ``sink_class``.

Sink modules are imported only when a sink is used, so a node without
paho-mqtt or cyclonedds installed still starts with the sinks it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from edgerun.errors import ConfigError
from edgerun.registry import resolve

if TYPE_CHECKING:
    from edgerun.sinks.base import Sink

# key -> "module:Class"
SINK_MODULES: dict[str, str] = {
    "jsonl": "edgerun.sinks.jsonl:JsonlSink",
    "mqtt": "edgerun.sinks.mqtt:MqttSink",
    "dds": "edgerun.sinks.dds:DdsSink",
}


def sink_class(key: str) -> Callable[[Any, str], Sink]:
    """The Sink class registered under ``key``; a missing library is one clear error.

    Typed by its constructor: every sink takes its own config section and the node id.
    """
    cls: Callable[[Any, str], Sink] = resolve(SINK_MODULES, key, "unknown sink", ConfigError)
    return cls

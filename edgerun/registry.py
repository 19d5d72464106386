"""Back ends registered by key as ``"module:Class"`` strings, imported on first use.

Engines, decoders, sources and sinks all resolve this way, so a node without
TensorRT, onnxruntime or cyclonedds still imports edgerun and starts with the
parts it has; asking for a missing one is one clear error naming the library.
"""

from __future__ import annotations

import importlib
from typing import Any

from edgerun.errors import EdgerunError


def resolve(registry: dict[str, str], key: Any, unknown: str, error: type[EdgerunError]) -> Any:
    """The class registered under ``key``; ``unknown`` words the error, e.g. "unknown engine"."""
    try:
        target = registry[key]
    except (KeyError, TypeError):
        known = ", ".join(sorted(registry))
        raise error(f"{unknown} {key!r} (known: {known})") from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise error(f"{key}: cannot load {module_name} ({err})") from None
    return getattr(module, class_name)

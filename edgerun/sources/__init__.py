"""Frame sources, found by key with ``source_class`` and built from config with ``make_source``.

Each back end is one module with one ``Source`` subclass and a ``from_config``
constructor; modules import lazily, so a node that captures from a camera never
pays for the replay's scene (or needs scikit-image).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from edgerun.errors import SourceError

if TYPE_CHECKING:
    from collections.abc import Callable

    from edgerun.config import SourceConfig
    from edgerun.sources.base import Source

# key -> "module:Class"; the keys are the values of ``source.kind`` in the config.
SOURCE_MODULES: dict[str, str] = {
    "opencv": "edgerun.sources.opencv:OpenCvSource",
    "images": "edgerun.sources.images:ImagesSource",
    "replay": "edgerun.sources.replay:ReplaySource",
}


def source_class(key: str) -> type[Source]:
    """The Source subclass registered under ``key``."""
    try:
        target = SOURCE_MODULES[key]
    except KeyError:
        known = ", ".join(sorted(SOURCE_MODULES))
        raise SourceError(f"unknown source kind {key!r} (known: {known})") from None
    module_name, class_name = target.split(":")
    module = importlib.import_module(module_name)
    return cast("type[Source]", getattr(module, class_name))


def make_source(cfg: SourceConfig) -> Source:
    """A closed source for ``cfg.kind``, configured from ``cfg``; the caller opens it."""
    cls = source_class(cfg.kind)
    factory = cast("Callable[[SourceConfig], Source]", cls.from_config)  # type: ignore[attr-defined]
    return factory(cfg)

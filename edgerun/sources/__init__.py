"""Frame sources, found by key with ``source_class`` and built from config with ``make_source``.

Each back end is one module with one ``Source`` subclass and a ``from_config``
constructor; modules import lazily, so a node that captures from a camera never
pays for the replay's scene (or needs scikit-image).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from edgerun.errors import SourceError
from edgerun.registry import resolve

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
    return cast("type[Source]", resolve(SOURCE_MODULES, key, "unknown source kind", SourceError))


def make_source(cfg: SourceConfig) -> Source:
    """A closed source for ``cfg.kind``, configured from ``cfg``; the caller opens it."""
    cls = source_class(cfg.kind)
    factory = cast("Callable[[SourceConfig], Source]", cls.from_config)
    return factory(cfg)

"""The one exception family that user-facing failures belong to.

Anything raised as an ``EdgerunError`` is printed by the CLI as a single line
and exits non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class EdgerunError(Exception):
    """A failure the operator can fix: bad config, missing model, bad input."""

    exit_code = 1


class ConfigError(EdgerunError):
    """The configuration is invalid; the message names the key path."""

    exit_code = 2


class ModelError(EdgerunError):
    """A model bundle or model file is missing, corrupt or inconsistent."""


class EngineError(EdgerunError):
    """An inference back end could not be opened or failed to run."""


class SourceError(EdgerunError):
    """A frame source could not be opened or stopped delivering frames."""

"""The one exception family that user-facing failures belong to.

Anything raised as an ``EdgerunError`` is printed by the CLI as a single line
and exits with the class's ``exit_code``; anything else is a bug and keeps its
traceback. The codes are a contract with the systemd unit
(``RestartPreventExitStatus=2``):

* 2: a person must fix the configuration or the model (a restart cannot help);
* 1: anything else (a device or link that may come back, a bug reported as one line).
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_NEEDS_OPERATOR = 2


class EdgerunError(Exception):
    """A failure with a one-line reason: bad config, missing model, bad input, device trouble."""

    exit_code = EXIT_FAILURE


class ConfigError(EdgerunError):
    """The configuration is invalid; the message names the key path."""

    exit_code = EXIT_NEEDS_OPERATOR


class ModelError(EdgerunError):
    """A model bundle or model file is missing, unreadable, corrupt or inconsistent."""

    exit_code = EXIT_NEEDS_OPERATOR


class EngineError(EdgerunError):
    """An inference back end could not be opened or failed to run."""


class SourceError(EdgerunError):
    """A frame source could not be opened or stopped delivering frames."""

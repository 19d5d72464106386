"""Why an update was refused, as one line an operator can act on.

``Rejected`` carries a short ``code`` (stable, for events, tests and metrics)
and a message that names the file and what was wrong with it.
"""

from __future__ import annotations

from edgerun.errors import EdgerunError


class OtaError(EdgerunError):
    """An OTA operation failed (bad key file, unreadable release, store problem)."""


class Rejected(OtaError):
    """A release was refused; nothing in the model store changed.

    ``final`` rejections are remembered for the manifest that caused them and
    not re-examined; transient ones (a dropped connection, a clock not yet
    synchronised) are tried again on the next poll.
    """

    def __init__(self, code: str, message: str, *, final: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.final = final


class SignatureError(OtaError):
    """A minisign signature or key file is malformed or does not verify."""

"""The contract for frame sources: read the next frame *into* a caller's buffer.

The pipeline owns the image buffers (one per pool slot) and passes one to
``read``; a source never hands out an image it allocated per frame.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from edgerun.config import SourceConfig
from edgerun.types import FrameMeta


class Source(ABC):
    """A camera, stream, file or synthetic flight. Used from the capture thread only."""

    KEY: ClassVar[str]
    # True for sources that can produce frames faster than real time (files,
    # replays): the capture stage then paces them at ``fps`` when asked to.
    # A class default that an instance may override (an opencv file vs a camera).
    synthetic_clock: bool = False

    width: int = 0
    height: int = 0
    fps: float = 0.0  # nominal rate; 0 when unknown

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: SourceConfig) -> Source:
        """A source built from the node's ``[source]`` section (not opened yet)."""

    @abstractmethod
    def open(self) -> None:
        """Open the device; sets ``width``/``height``. Raises SourceError with a clear message."""

    @abstractmethod
    def read(self, image: np.ndarray, seq: int) -> FrameMeta | None:
        """Fill ``image`` (height, width, 3 uint8 BGR) with the next frame.

        Returns its metadata, ``None`` at a clean end of stream, or raises
        SourceError when the device is gone (the capture stage reopens it).
        """

    def skip(self, count: int) -> int:
        """Pass over the next ``count`` frames without handing them out; returns how many there were
        (fewer at the end of a stream that does not loop).

        The pipeline calls this for the frames of a paced replay that fell due while every
        worker was busy: frames a capture thread would have read only to drop. This default
        reads them into a scratch buffer; sources that can move on without decoding override it.
        """
        scratch = getattr(self, "_skip_scratch", None)
        if scratch is None or scratch.shape != (self.height, self.width, 3):
            scratch = self._skip_scratch = np.zeros((self.height, self.width, 3), np.uint8)
        for done in range(count):
            if self.read(scratch, -1) is None:
                return done
        return count

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the device."""

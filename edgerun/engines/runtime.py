"""A model runtime: one model opened on one back end, with its preprocessor and decoder.

The pipeline serves one ``ModelRuntime`` at a time; failover and OTA updates
make and swap them. It lives beside the engines, not in the pipeline, so the
engines package (failover) does not import the pipeline that runs it.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from edgerun.decoders.base import Decoder
from edgerun.engines.base import Engine
from edgerun.preprocess import Preprocessor


class ProblemReporter(Protocol):
    """The part of health that runtime users report to (``edgerun.service.health.Health``)."""

    def set_problem(self, key: str, reason: str) -> None: ...

    def clear_problem(self, key: str) -> None: ...


class FrameLost(Exception):
    """Raised by whoever guards a runtime's engine calls for a frame it gave up on; counted under ``reason``,
    not logged."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ServeLocally(Exception):
    """Raised by the offload lane for a frame no helper took (none chosen, refused, busy, window full):
    nothing was lost, the frame is served by the local engine instead."""


@dataclass(slots=True)
class ModelInfo:
    """What each batch says about the model that produced it."""

    name: str
    version: int
    labels: tuple[str, ...]
    # What neighbours match before serving each other's frames (edgerun.offload): ModelBundle.content_hash.
    hash: str = ""


class ModelRuntime:
    """Everything that depends on the model: engine, preprocessor, decoder, and what batches report.

    The pipeline serves one runtime at a time and can swap to another between
    two frames (failover to another back end, an OTA model update). A frame
    keeps the runtime it was preprocessed for until it is decoded, so frames in
    flight during a swap finish on the model they were prepared for.

    Preprocessors and decoders keep scratch buffers, so each worker thread uses
    its own copy (``ensure_workers``); index 0 is the one made by the caller.
    """

    def __init__(self, engine: Engine, preprocessor: Preprocessor, decoder: Decoder, model: ModelInfo) -> None:
        self.engine = engine
        self.preprocessors = [preprocessor]
        self.decoders = [decoder]
        self.model = model
        # Engines that take one call at a time are entered under this lock when
        # several infer threads share them; a no-op for engines that take concurrent calls.
        self.serial: AbstractContextManager[Any] = (
            threading.Lock() if getattr(engine, "concurrent_calls", 1) <= 1 else nullcontext()
        )

    @property
    def preprocessor(self) -> Preprocessor:
        return self.preprocessors[0]

    @property
    def decoder(self) -> Decoder:
        return self.decoders[0]

    def ensure_workers(self, count: int) -> None:
        """Per-worker preprocessors and decoders for ``count`` worker threads (made once, before use)."""
        while len(self.preprocessors) < count:
            self.preprocessors.append(self.preprocessors[0].clone())
        while len(self.decoders) < count:
            self.decoders.append(self.decoders[0].clone())

    def __repr__(self) -> str:
        return f"ModelRuntime({self.model.name} v{self.model.version} on {self.engine.KEY})"

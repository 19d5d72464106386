"""The helper's side of offloading: a neighbour's frame through this node's own serving model.

Each frame arrives letterboxed to the model input, so it is preprocessed as a frame of exactly that size
(the letterbox is the identity) and normalised the way this model wants. The engine call goes through the
``ServingController`` like the node's own frames: the failover that watches those watches these (a hang
or a fault moves both to the next engine), and an OTA swap changes what both are served by. A frame for
another model (by hash: the weights, preprocessing, decoder and labels) is answered "model".

Runs in the offload server's worker threads; each keeps its own preprocessor, decoder and buffers per
runtime, made on its first frame for that runtime.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgerun.decoders.base import Decoder
from edgerun.engines.runtime import FrameLost, ModelRuntime
from edgerun.offload.server import ServeResult
from edgerun.pipeline.serving import ServingController
from edgerun.preprocess import Preprocessor


@dataclass(slots=True)
class _Kit:
    preprocessor: Preprocessor
    decoder: Decoder
    tensor: np.ndarray
    outputs: list[np.ndarray]


class ModelServer:
    """``serve`` (an ``edgerun.offload.server.ServeFn``) for the node's current model."""

    def __init__(self, serving: ServingController, node_id: str, *, tracer: Any = None) -> None:
        self.serving = serving
        self.node_id = node_id
        self.tracer = tracer  # edgerun.tracing.FrameTracer: the remote infer span joins the origin's trace
        self._local = threading.local()

    def serve(self, model_hash: str, image: np.ndarray, traceparent: str, origin: str) -> ServeResult:
        runtime = self.serving.runtime
        if runtime is None or runtime.model.hash != model_hash:
            return ServeResult(None, "model")
        height, width = runtime.engine.input_spec.image_hw
        if image.shape[:2] != (height, width):
            return ServeResult(None, "model")  # same hash, other size: not a frame for this model
        kit = self._kit(runtime, width, height)
        kit.preprocessor(image, kit.tensor)
        start_ns = time.time_ns()
        t0 = time.monotonic()
        try:
            with runtime.serial:
                self.serving.infer(runtime, kit.tensor, kit.outputs)
        except FrameLost:
            return ServeResult(None, "error")
        infer_ms = (time.monotonic() - t0) * 1000.0
        end_ns = time.time_ns()
        detections = kit.decoder.decode(kit.outputs)
        tracer = self.tracer
        if tracer is not None and traceparent:
            attributes = {"edgerun.node": self.node_id, "edgerun.engine": runtime.engine.KEY}
            tracer.remote_infer(traceparent, start_ns, end_ns, {**attributes, "edgerun.remote.origin": origin})
        return ServeResult(detections, "ok", infer_ms)

    def _kit(self, runtime: ModelRuntime, width: int, height: int) -> _Kit:
        kits: weakref.WeakKeyDictionary[ModelRuntime, _Kit] | None = getattr(self._local, "kits", None)
        if kits is None:
            kits = self._local.kits = weakref.WeakKeyDictionary()
        kit = kits.get(runtime)
        if kit is None:
            engine = runtime.engine
            kit = _Kit(
                runtime.preprocessor.for_source(width, height),
                runtime.decoder.clone(),
                engine.allocate_input(),
                engine.allocate_outputs(),
            )
            kits[runtime] = kit
        return kit

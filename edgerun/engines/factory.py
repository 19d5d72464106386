"""Factories for model runtimes: a bundle opened on an engine, the CPU engine's layout, and the
failover over ``engine.order``. The node, ``edgerun bench`` and tests make runtimes the same way here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.decoders import decoder_class
from edgerun.engines.base import Engine, EngineOptions, engine_class
from edgerun.engines.breadcrumb import Breadcrumbs, default_state_dir
from edgerun.engines.failover import EventCallback, Failover, FailoverSettings
from edgerun.engines.runtime import ModelInfo, ModelRuntime
from edgerun.models.bundle import ModelBundle
from edgerun.preprocess import Preprocessor

if TYPE_CHECKING:
    from edgerun.config import Config
    from edgerun.service.health import Health


def build_runtime(
    bundle: ModelBundle, engine: Engine, frame_size: tuple[int, int], score_threshold: float | None = None
) -> ModelRuntime:
    """Engine + preprocessor + decoder for one bundle, ready to serve frames of ``frame_size`` (w, h)."""
    params = dict(bundle.manifest.decoder.params)
    if score_threshold is not None:
        params["min_score_thresh"] = score_threshold
    decoder = decoder_class(bundle.manifest.decoder.kind)(params, engine.input_spec, engine.output_specs)
    decoder.check_labels(bundle.labels)
    preprocessor = Preprocessor(bundle.manifest.preprocess, engine.input_spec, *frame_size)
    return ModelRuntime(
        engine, preprocessor, decoder, ModelInfo(bundle.name, bundle.version, bundle.labels, bundle.content_hash)
    )


def cpu_engine_layout(cfg: Config, *, fallback: bool) -> tuple[int, int]:
    """(threads per interpreter, interpreter replicas) for the CPU TFLite engine.

    ``engine.num_threads`` and ``engine.replicas`` win when set. Otherwise
    (measured: docs/benchmarks.md, Engine layout):

    * a live camera (``drop_*`` policies) gets one interpreter on every core:
      a frame's latency is one invoke, the shortest there is;
    * offline input (``block``: every frame counts, throughput is all) and the
      CPU fallback behind an accelerator get one single-threaded interpreter
      per core, each worker taking its own frame. A multi-threaded interpreter
      waits for its slowest thread at every layer, so the other stage threads
      preempting one of its threads stall all of it; independent replicas only
      slow the one that lost its core. The fallback runs beside the separate
      stage threads laid out for the accelerator, the worst case for that.
    """
    cores = os.cpu_count() or 1
    threads, replicas = cfg.engine.num_threads, cfg.engine.replicas
    if not replicas:
        throughput = fallback or cfg.pipeline.policy == "block"
        replicas = max(1, cores // (threads or 1)) if throughput else 1
    return threads or max(1, cores // replicas), replicas


def open_failover(
    cfg: Config,
    bundle: ModelBundle,
    frame_size: tuple[int, int],
    *,
    health: Health | None = None,
    on_event: EventCallback | None = None,
) -> Failover:
    """The failover controller over ``engine.order`` for ``bundle``; call ``start()`` to open the engines.

    The last resort is the bundle's CPU engine (``ModelBundle.cpu_engine``): TFLite, or ONNX Runtime
    held to its CPU provider, so a node with onnxruntime-gpu still has a fallback that needs no GPU.
    """
    last_resort = bundle.cpu_engine
    order = list(dict.fromkeys([*cfg.engine.order, last_resort]))
    absent = {key: f"bundle has no {key} variant" for key in order if bundle.variant_path(key) is None}
    behind_accelerator = any(key != last_resort and key not in absent for key in order)

    def open_runtime(key: str) -> ModelRuntime:
        path = bundle.variant_path(key)
        assert path is not None
        if key == last_resort and key == "tflite":
            threads, replicas = cpu_engine_layout(cfg, fallback=behind_accelerator)
            options = EngineOptions(num_threads=threads, replicas=replicas)
        elif key == last_resort:
            # ONNX Runtime: one session with its own thread pool (replicas are a TFLite layout).
            options = EngineOptions(num_threads=cfg.engine.num_threads, device="cpu")
        else:
            # state_dir: where ONNX Runtime's TensorRT provider caches the engines it builds
            extra = {"state_dir": cfg.engine.state_dir}
            options = EngineOptions(num_threads=cfg.engine.num_threads, device=cfg.engine.device, extra=extra)
        engine = engine_class(key)(path, options)
        try:
            return build_runtime(bundle, engine, frame_size, cfg.model.score_threshold)
        except BaseException:
            engine.close()
            raise

    ecfg = cfg.engine
    settings = FailoverSettings(
        hang_deadline_s=ecfg.hang_deadline_ms / 1000.0,
        reprobe_min_s=ecfg.reprobe_min_s,
        reprobe_max_s=ecfg.reprobe_max_s,
    )
    # Breadcrumbs only where an engine other than the CPU last resort can run.
    watched = [key for key in order if key != last_resort and key not in absent]
    state_dir = Path(ecfg.state_dir) if ecfg.state_dir else default_state_dir()
    crumbs = Breadcrumbs.shared(state_dir) if watched else None
    return Failover(
        order,
        open_runtime,
        settings,
        absent=absent,
        health=health,
        on_event=on_event,
        breadcrumbs=crumbs,
        last_resort=last_resort,
    )

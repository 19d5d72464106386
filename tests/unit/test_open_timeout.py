"""An engine open that times out must still close the engine it eventually returns.

Failover gives up on an open after ``OPEN_TIMEOUT_S`` (a TensorRT engine deserialising on
a wedged driver); the open may return much later, and its engine (device memory, a CUDA
context) must not leak. Event-based: nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import threading

import pytest

from edgerun.config import parse_config
from edgerun.engines import failover as failover_module
from edgerun.engines.base import EngineOptions, engine_class
from edgerun.engines.factory import build_runtime
from edgerun.engines.failover import EngineHang, Failover, call_with_timeout  # defined in engines/worker.py


class _Opened:
    """What an open returns, reduced to its ``close``: ``call_with_timeout`` takes any callable, and the fault
    (an open that outlasts its deadline) is an event the test holds. A real engine's late open is the last test."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_late_result_is_handed_to_on_late():
    release = threading.Event()
    opened = _Opened()

    def slow_open() -> _Opened:
        release.wait(30)
        return opened

    with pytest.raises(EngineHang):
        call_with_timeout(slow_open, 0.01, "edgerun-open-test", on_late=lambda late: late.close())
    assert not opened.closed.is_set()
    release.set()
    assert opened.closed.wait(30)


def test_a_result_in_time_is_returned_and_not_closed():
    opened = _Opened()
    assert call_with_timeout(lambda: opened, 30, "edgerun-open-test", on_late=lambda late: late.close()) is opened
    assert not opened.closed.is_set()


def test_failover_closes_an_engine_whose_open_timed_out(monkeypatch, blazeface_bundle):
    """A real TFLite engine opened after failover gave up on it is closed when it arrives."""
    monkeypatch.setattr(failover_module, "OPEN_TIMEOUT_S", 0.01)
    cfg = parse_config({})
    release = threading.Event()
    closed = threading.Event()

    def open_runtime(key: str):
        release.wait(30)  # a driver that takes its time
        engine = engine_class("tflite")(blazeface_bundle.variant_path("tflite"), EngineOptions(num_threads=1))
        real_close = engine.close

        def close() -> None:
            real_close()
            closed.set()

        engine.close = close  # type: ignore[method-assign]  # observes the close
        return build_runtime(blazeface_bundle, engine, (640, 480), cfg.model.score_threshold)

    failover = Failover(["tflite"], open_runtime)
    with pytest.raises(Exception, match="did not return within"):
        failover.start()
    release.set()
    assert closed.wait(30)
    failover.close()

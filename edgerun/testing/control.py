"""TEST TOOL: the node's test-control socket, for the hardware-in-the-loop rig (``hil``).

Exists only when the node is started with ``edgerun run --test-control [PATH]``: no config key reaches it,
so a production node never listens. It is a unix socket (default ``edgerun-control.sock`` in the run
directory); a client sends one JSON line and reads one JSON line back::

    {"cmd": "ping"}                                  -> {"ok": true, "node": "drone-1", "pid": 123}
    {"cmd": "accelerator", "mode": "hang"}           "raise", "hang" or "clear": the hilaccel engine's FaultPlan
    {"cmd": "clock_skew", "seconds": 30}             the process's wall clock (time.time) runs this far off
    {"cmd": "camera", "present": false}              the source raises SourceError until it is back
    {"cmd": "ota_crash_at", "step": "staged"}        SIGKILL right after journalling that OTA step
    {"cmd": "state"}                                 what is armed, and the accelerator's call/fault counts

``--test-control`` also registers the engine key ``hilaccel``: the CPU TFLite engine standing in for an
accelerator (``FaultInjectingEngine``) whose faults this socket arms; and ``hilcpu``: the CPU TFLite engine
standing in for a weaker board's CPU (every call takes at least ``EDGERUN_TEST_CPU_DELAY_MS``). Bad requests
get ``{"ok": false, "error": ...}``; nothing a client sends raises into the node's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.config import SourceConfig
from edgerun.engines.base import ENGINE_MODULES, EngineOptions
from edgerun.engines.tflite import TFLiteEngine
from edgerun.errors import SourceError
from edgerun.ota.store import STEPS
from edgerun.sources.base import Source
from edgerun.testing.faults import FaultInjectingEngine, FaultPlan
from edgerun.types import FrameMeta

log = logging.getLogger(__name__)

ACCELERATOR_KEY = "hilaccel"
SLOW_CPU_KEY = "hilcpu"
SLOW_CPU_DELAY_ENV = "EDGERUN_TEST_CPU_DELAY_MS"  # the process's hilcpu: milliseconds every call takes at least
DEFAULT_SOCKET = "edgerun-control.sock"
MAX_REQUEST = 4096  # one JSON line; anything longer is not a control request

# Shared by every ControlledAccelerator of the process: a re-probe sees the fault until it is cleared.
ACCELERATOR_PLAN = FaultPlan()
_real_time = time.time


class ControlledAccelerator(FaultInjectingEngine):
    """TEST ENGINE: the real CPU TFLite engine posing as a serial accelerator, failing on the socket's command."""

    KEY = ACCELERATOR_KEY

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        super().__init__(
            TFLiteEngine(model_path, EngineOptions(num_threads=1)),
            ACCELERATOR_PLAN,
            ACCELERATOR_KEY,
            cpu_threads=0,
            concurrent_calls=1,
        )


class SlowCpu(FaultInjectingEngine):
    """TEST ENGINE: the real CPU TFLite engine posing as a weaker board's CPU (a drone's small ARM board cannot
    exist on this machine): every call takes at least ``EDGERUN_TEST_CPU_DELAY_MS`` ms (unset or 0: this CPU's
    own speed). The HIL rig puts it behind ``hilaccel``, so a failed accelerator leaves the drone on a CPU that
    cannot keep up with its camera, as a Raspberry Pi-class drone's would."""

    KEY = SLOW_CPU_KEY

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        raw = os.environ.get(SLOW_CPU_DELAY_ENV, "") or "0"
        try:
            delay_ms = float(raw)
        except ValueError:
            raise ValueError(f"{SLOW_CPU_DELAY_ENV}: expected milliseconds, got {raw!r}") from None
        if not 0 <= delay_ms <= 60_000:
            raise ValueError(f"{SLOW_CPU_DELAY_ENV}: expected 0..60000 ms, got {raw!r}")
        super().__init__(
            TFLiteEngine(model_path, EngineOptions(num_threads=1)),
            FaultPlan(delay_s=delay_ms / 1000.0),
            SLOW_CPU_KEY,
            cpu_threads=1,
            concurrent_calls=1,
        )


def register_test_engines() -> None:
    """Makes ``hilaccel`` and ``hilcpu`` valid engine keys in this process (called by ``edgerun run
    --test-control``)."""
    ENGINE_MODULES.setdefault(ACCELERATOR_KEY, "edgerun.testing.control:ControlledAccelerator")
    ENGINE_MODULES.setdefault(SLOW_CPU_KEY, "edgerun.testing.control:SlowCpu")


class ControlledCamera(Source):
    """TEST SOURCE: the node's real source behind the switch that ``{"cmd": "camera"}`` flips.

    ``edgerun run --test-control`` wraps the node's source in one; while ``present`` is False, reads,
    skips and reopens raise SourceError as an unplugged camera's would.
    """

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.present = True
        self.KEY = inner.KEY  # type: ignore[misc]  # reports as the source it stands in for

    @classmethod
    def from_config(cls, cfg: SourceConfig) -> Source:
        raise TypeError("ControlledCamera wraps a built source (edgerun run --test-control)")

    # The node and pipeline read and set these on the source: they are the real source's.
    @property
    def width(self) -> int:
        return self.inner.width

    @width.setter
    def width(self, value: int) -> None:
        self.inner.width = value

    @property
    def height(self) -> int:
        return self.inner.height

    @height.setter
    def height(self, value: int) -> None:
        self.inner.height = value

    @property
    def fps(self) -> float:
        return self.inner.fps

    @fps.setter
    def fps(self, value: float) -> None:
        self.inner.fps = value

    @property
    def synthetic_clock(self) -> bool:
        return self.inner.synthetic_clock

    @synthetic_clock.setter
    def synthetic_clock(self, value: bool) -> None:
        self.inner.synthetic_clock = value

    def _check_present(self) -> None:
        if not self.present:
            raise SourceError("camera disconnected (test control)")

    def open(self) -> None:
        self._check_present()
        self.inner.open()

    def read(self, image: np.ndarray, seq: int) -> FrameMeta | None:
        self._check_present()
        return self.inner.read(image, seq)

    def skip(self, count: int) -> int:
        self._check_present()
        return self.inner.skip(count)

    def close(self) -> None:
        self.inner.close()


class ControlServer:
    """The socket's server on the node's loop; ``node`` is the running ``edgerun.node.Node``."""

    def __init__(self, node: Any, path: str | Path) -> None:
        self.node = node
        self.path = Path(path)
        self.skew_s = 0.0
        self.camera_present = True
        self.ota_crash_at = ""
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by a killed predecessor
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_REQUEST)
        os.chmod(self.path, 0o600)
        log.warning("test control listening on %s (test mode: never in production)", self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("expected a JSON object")
                reply = self.handle(request)
            except (ValueError, TypeError, KeyError) as err:
                reply = {"ok": False, "error": str(err)}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            pass  # a client that sends nothing, too much or hangs up: nothing to answer
        finally:
            writer.close()

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One command; raises ValueError/TypeError/KeyError on a bad request."""
        cmd = request.get("cmd")
        if cmd == "ping":
            return {"ok": True, "node": self.node.node_id, "pid": os.getpid()}
        if cmd == "state":
            return {"ok": True, **self.state()}
        if cmd == "accelerator":
            mode = request["mode"]
            if mode == "clear":
                ACCELERATOR_PLAN.clear()
            else:
                ACCELERATOR_PLAN.arm(mode)  # ValueError on an unknown mode
            log.warning("test control: accelerator %s", mode)
            return {"ok": True, **self.state()}
        if cmd == "clock_skew":
            self.set_skew(float(request["seconds"]))
            return {"ok": True, **self.state()}
        if cmd == "camera":
            self.set_camera(bool(request["present"]))
            return {"ok": True, **self.state()}
        if cmd == "ota_crash_at":
            self.set_ota_crash(str(request["step"]))
            return {"ok": True, **self.state()}
        raise ValueError(f"unknown command {cmd!r}")

    def state(self) -> dict[str, Any]:
        return {
            "accelerator": ACCELERATOR_PLAN.mode or "ok",
            "accelerator_calls": ACCELERATOR_PLAN.calls,
            "accelerator_faults": ACCELERATOR_PLAN.faults,
            "clock_skew_s": self.skew_s,
            "camera_present": self.camera_present,
            "ota_crash_at": self.ota_crash_at,
        }

    def set_skew(self, seconds: float) -> None:
        """Every ``time.time()`` of the process runs ``seconds`` off (payload stamps, gossip, OTA expiry)."""
        self.skew_s = seconds
        time.time = (lambda: _real_time() + seconds) if seconds else _real_time
        log.warning("test control: wall clock skewed by %+.1f s", seconds)

    def set_ota_crash(self, step: str) -> None:
        """A power cut right after the updater journals ``step``: the process SIGKILLs itself there."""
        if step not in STEPS:
            raise ValueError(f"unknown OTA step {step!r}")
        updater = getattr(self.node, "updater", None)
        if updater is None:
            raise ValueError("OTA is not enabled on this node (ota.enabled)")

        def power_cut(done: str) -> None:
            if done == step:
                log.warning("test control: OTA step %s journalled, killing the process", step)
                os.kill(os.getpid(), signal.SIGKILL)

        updater.store.after_journal = power_cut
        self.ota_crash_at = step
        log.warning("test control: SIGKILL after OTA step %s", step)

    def set_camera(self, present: bool) -> None:
        """A camera that disappears: reads and reopens raise SourceError until it is back."""
        source = self.node.source
        if source is not None and not isinstance(source, ControlledCamera):
            raise ValueError("the node's source has no test switch (not built with --test-control)")
        self.camera_present = present
        if source is not None:
            source.present = present
        log.warning("test control: camera %s", "back" if present else "gone")

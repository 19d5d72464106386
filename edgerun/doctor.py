"""``edgerun doctor``: which inference back ends this node can use, and why not.

Each probe imports the back end's library and looks for its devices without
loading a model, so doctor runs in a second on any board.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

from edgerun.engines.base import ENGINE_MODULES
from edgerun.engines.tflite import EDGETPU_LIBRARY


def _version(module_name: str) -> str:
    module = importlib.import_module(module_name)
    return str(getattr(module, "__version__", "unknown"))


def probe_tflite() -> dict[str, Any]:
    for name in ("ai_edge_litert", "tflite_runtime"):
        try:
            importlib.import_module(f"{name}.interpreter")
        except ImportError as err:
            last = str(err)
            continue
        return {"ok": True, "library": name, "version": _version(name), "devices": [f"cpu x{os.cpu_count()}"]}
    return {"ok": False, "why": f"no TFLite runtime importable ({last}); pip install ai-edge-litert"}


def probe_edgetpu() -> dict[str, Any]:
    tflite = probe_tflite()
    if not tflite["ok"]:
        return {"ok": False, "why": "needs a TFLite runtime first"}
    try:
        ctypes.CDLL(EDGETPU_LIBRARY)
    except OSError as err:
        return {"ok": False, "why": f"{EDGETPU_LIBRARY} not loadable ({err}); install libedgetpu1-std"}
    devices = [f"pci:{i}" for i, _ in enumerate(sorted(p for p in os.listdir("/dev") if p.startswith("apex_")))]
    devices += [f"usb:{i}" for i in range(_coral_usb_count())]
    if not devices:
        return {"ok": False, "why": f"{EDGETPU_LIBRARY} loads, but no Edge TPU is attached (no /dev/apex_*, no USB)"}
    return {"ok": True, "library": EDGETPU_LIBRARY, "devices": devices}


# Coral USB Accelerator: Global Unichip before its firmware is loaded, Google after.
CORAL_USB_IDS = {("1a6e", "089a"), ("18d1", "9302")}


def _coral_usb_count() -> int:
    count = 0
    for dev in Path("/sys/bus/usb/devices").glob("*"):
        try:
            ids = ((dev / "idVendor").read_text().strip(), (dev / "idProduct").read_text().strip())
        except OSError:
            continue
        count += ids in CORAL_USB_IDS
    return count


def probe_tensorrt() -> dict[str, Any]:
    from edgerun.engines.tensorrt import device_report

    return device_report()


def probe_onnx() -> dict[str, Any]:
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError as err:
        return {"ok": False, "why": f"onnxruntime not importable ({err}); pip install edgerun[onnx]"}
    from edgerun.engines.onnx import choose_providers

    chosen = [p if isinstance(p, str) else p[0] for p in choose_providers(ort.get_available_providers(), "")]
    # The providers edgerun would use, best first (CPU is always there).
    return {"ok": True, "library": "onnxruntime", "version": ort.__version__, "devices": chosen}


PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "tflite": probe_tflite,
    "edgetpu": probe_edgetpu,
    "tensorrt": probe_tensorrt,
    "onnx": probe_onnx,
}


def doctor_report() -> dict[str, Any]:
    backends = {key: PROBES[key]() for key in PROBES}
    for key, result in backends.items():
        result["registered"] = key in ENGINE_MODULES
    return {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "opencv": _version("cv2"),
        "backends": backends,
    }


def run_doctor(as_json: bool = False) -> int:
    report = doctor_report()
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"machine {report['machine']}, python {report['python']}, numpy {report['numpy']}, opencv {report['opencv']}")
    for key, result in report["backends"].items():
        if result["ok"]:
            devices = ", ".join(result.get("devices", []))
            print(f"  {key:9s} ok    {result.get('library', '')} {result.get('version', '')}  devices: {devices}")
        else:
            print(f"  {key:9s} no    {result['why']}")
    return 0

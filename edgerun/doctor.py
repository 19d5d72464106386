"""``edgerun doctor``: which inference back ends this node can use, and why not.

Each probe imports the back end's library and looks for its devices without
loading a model, so doctor runs in a second on any board. It also says which
video back ends the OpenCV in use was built with: pip's OpenCV wheels have
V4L2 and FFmpeg but no GStreamer, so on a Jetson the CSI camera pipeline
(``nvarguscamerasrc``) needs JetPack's system OpenCV (docs/installing.md).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import platform
import re
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


# The Video I/O back ends a node's sources use, as cv2.getBuildInformation() names them.
VIDEO_IO = {"gstreamer": "GStreamer", "v4l2": "v4l/v4l2", "ffmpeg": "FFMPEG"}
JETSON_RELEASE_FILE = Path("/etc/nv_tegra_release")


def opencv_video_io(build_information: str) -> dict[str, bool]:
    """Which of GStreamer, V4L2 and FFmpeg an OpenCV build has, from its build information text."""
    found: dict[str, bool] = {}
    for key, label in VIDEO_IO.items():
        match = re.search(rf"^\s*{re.escape(label)}:\s*(\S+)", build_information, re.MULTILINE)
        found[key] = match is not None and match.group(1).upper() == "YES"
    return found


def probe_opencv() -> dict[str, Any]:
    import cv2

    report: dict[str, Any] = {"version": cv2.__version__, "path": str(Path(cv2.__file__).parent)}
    report.update(opencv_video_io(cv2.getBuildInformation()))
    if not report["gstreamer"] and JETSON_RELEASE_FILE.exists():
        report["hint"] = (
            "this OpenCV has no GStreamer, so no nvarguscamerasrc (CSI cameras): use JetPack's system OpenCV, "
            "in a venv made with --system-site-packages and no opencv-python* wheel (docs/installing.md)"
        )
    return report


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
        "opencv_video_io": probe_opencv(),
        "backends": backends,
    }


def run_doctor(as_json: bool = False) -> int:
    report = doctor_report()
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"machine {report['machine']}, python {report['python']}, numpy {report['numpy']}, opencv {report['opencv']}")
    video = report["opencv_video_io"]
    has = ", ".join(f"{key} {'yes' if video[key] else 'no'}" for key in VIDEO_IO)
    print(f"  opencv    video I/O: {has}  ({video['path']})")
    if "hint" in video:
        print(f"            {video['hint']}")
    for key, result in report["backends"].items():
        if result["ok"]:
            devices = ", ".join(result.get("devices", []))
            print(f"  {key:9s} ok    {result.get('library', '')} {result.get('version', '')}  devices: {devices}")
        else:
            print(f"  {key:9s} no    {result['why']}")
    return 0

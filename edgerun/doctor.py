"""``edgerun doctor``: which inference back ends this node can use, and why not.

Each probe imports the back end's library and looks for its devices without
loading a model, so doctor runs in a second on any board. It also says which
video back ends the OpenCV in use was built with: pip's OpenCV wheels have
V4L2 and FFmpeg but no GStreamer, so on a Jetson the CSI camera pipeline
(``nvarguscamerasrc``) needs JetPack's system OpenCV (docs/installing.md).

It lists the V4L2 cameras it can see (``/dev/video*``) and whether this user
may open them (permissions, the ``video`` group). Given a node config, it checks
what the node would connect to: the MQTT broker (an MQTT 5 login with the
node's username, password and TLS, within a short timeout) and the camera
(opened as the node opens it, credentials hidden), and exits 1 when either
cannot be used (docs/camera.md).
"""

from __future__ import annotations

import ctypes
import errno
import grp
import importlib
import json
import os
import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from edgerun.engines.base import ENGINE_MODULES
from edgerun.engines.tflite import EDGETPU_LIBRARY

if TYPE_CHECKING:
    from edgerun.config import MqttSinkConfig, SourceConfig


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


DEV_DIR = Path("/dev")
V4L2_SYSFS = Path("/sys/class/video4linux")
_VIDEO_NODE = re.compile(r"^video(\d+)$")


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def probe_camera_device(path: Path) -> dict[str, Any]:
    """One ``/dev/videoN``: its name, owner group and mode, and whether this user can open it (and why not)."""
    st = path.stat()
    group = _group_name(st.st_gid)
    entry: dict[str, Any] = {"path": str(path), "group": group, "mode": oct(st.st_mode & 0o777)}
    try:
        entry["name"] = (V4L2_SYSFS / path.name / "name").read_text().strip()
    except OSError:
        entry["name"] = ""
    try:
        # O_NONBLOCK: a V4L2 open never waits, and an open starts no capture.
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
    except OSError as err:
        entry["ok"] = False
        if err.errno in (errno.EACCES, errno.EPERM):
            member = st.st_gid == os.getegid() or st.st_gid in os.getgroups()
            entry["why"] = (
                f"permission denied ({entry['mode']}, group {group})"
                if member
                else f"permission denied: this user is not in group {group} "
                f"(sudo usermod -aG {group} $USER, then log in again)"
            )
        elif err.errno == errno.EBUSY:
            entry["why"] = "busy: another process has it open"
        else:
            entry["why"] = err.strerror or str(err)
        return entry
    entry["ok"] = True
    return entry


def probe_cameras(dev_dir: Path = DEV_DIR) -> list[dict[str, Any]]:
    """Every ``videoN`` node under ``dev_dir``, in number order."""
    nodes = [(int(m.group(1)), p) for p in dev_dir.glob("video*") if (m := _VIDEO_NODE.match(p.name))]
    return [probe_camera_device(path) for _, path in sorted(nodes)]


def probe_broker(mqtt: MqttSinkConfig, timeout_s: float) -> dict[str, Any]:
    """Log in to the broker as the node would (its username, password and TLS), then leave.

    ``state``: "connected"; "login_refused" (the broker answered and refused this login for good, as
    ``edgerun listen`` reports it: a person must fix the credentials or the broker's password file);
    "unreachable" (no TCP, no TLS, no CONNACK, or a refusal a retry may pass); "config_error" (the TLS files
    cannot be read, so nothing was tried).
    """
    from edgerun.errors import ConfigError
    from edgerun.mqtt_client import MqttError, MqttLoginRefused, connect_blocking, new_client

    address = f"{mqtt.host}:{mqtt.port}"

    def failed(state: str, err: Exception) -> dict[str, Any]:
        why = str(err).removeprefix(f"mqtt://{address}: ")
        return {"address": address, "ok": False, "state": state, "why": why}

    try:
        # Its own client id, never the node's: the broker would hand a running node's session to doctor.
        client = new_client(mqtt, id_prefix="edgerun-doctor", reconnect=None)
    except ConfigError as err:
        return failed("config_error", err)
    client.connect_timeout = timeout_s
    try:
        connect_blocking(client, mqtt.host, mqtt.port, timeout=timeout_s)
    except MqttLoginRefused as err:
        return failed("login_refused", err)
    except MqttError as err:
        return failed("unreachable", err)
    client.disconnect()
    client.loop_stop()
    return {"address": address, "ok": True, "state": "connected"}


def probe_source(cfg: SourceConfig) -> dict[str, Any]:
    """Open the configured camera as the node would (its own timeouts), read one frame, close it."""
    import numpy as np

    from edgerun.errors import EdgerunError
    from edgerun.sources import make_source

    source = make_source(cfg)
    described = str(getattr(source, "description", cfg.kind))
    try:
        source.open()
        image = np.zeros((source.height, source.width, 3), np.uint8)
        source.read(image, 0)
    except EdgerunError as err:
        return {"source": described, "ok": False, "why": str(err)}
    finally:
        source.close()
    return {"source": described, "ok": True, "size": [source.width, source.height], "fps": source.fps}


def probe_config(config_path: str, timeout_s: float) -> dict[str, Any]:
    """What the node configured in ``config_path`` connects to: its broker and its camera."""
    from edgerun.config import load_config

    cfg = load_config(config_path)
    report: dict[str, Any] = {"path": config_path}
    mqtt = cfg.sinks.mqtt
    if mqtt.enabled or (cfg.ota.enabled and cfg.ota.mqtt):
        report["broker"] = probe_broker(mqtt, timeout_s)
    if cfg.source.kind == "opencv":
        report["camera"] = probe_source(cfg.source)
    return report


PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "tflite": probe_tflite,
    "edgetpu": probe_edgetpu,
    "tensorrt": probe_tensorrt,
    "onnx": probe_onnx,
}


def doctor_report(config_path: str | None = None, timeout_s: float = 2.0) -> dict[str, Any]:
    backends = {key: PROBES[key]() for key in PROBES}
    for key, result in backends.items():
        result["registered"] = key in ENGINE_MODULES
    report = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "opencv": _version("cv2"),
        "opencv_video_io": probe_opencv(),
        "backends": backends,
        "cameras": probe_cameras(),
    }
    if config_path is not None:
        report["config"] = probe_config(config_path, timeout_s)
    return report


def reachable(report: dict[str, Any]) -> bool:
    """False when the configured broker or camera did not answer."""
    config = report.get("config", {})
    return all(config[key]["ok"] for key in ("broker", "camera") if key in config)


def run_doctor(as_json: bool = False, config_path: str | None = None, timeout_s: float = 2.0) -> int:
    report = doctor_report(config_path, timeout_s)
    code = 0 if reachable(report) else 1
    if as_json:
        print(json.dumps(report, indent=2))
        return code
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
    cameras = report["cameras"]
    if not cameras:
        print("  cameras   none found (no /dev/video*)")
    for i, cam in enumerate(cameras):
        label = "cameras" if i == 0 else ""
        name = f" ({cam['name']})" if cam["name"] else ""
        state = "ok   " if cam["ok"] else "no   "
        detail = f"group {cam['group']}, {cam['mode']}" if cam["ok"] else cam["why"]
        print(f"  {label:9s} {state} {cam['path']}{name}  {detail}")
    if "config" in report:
        config = report["config"]
        print(f"config {config['path']}:")
        if "broker" in config:
            broker = config["broker"]
            said = {
                "connected": "connected",
                "login_refused": f"login refused {broker.get('why', '').removeprefix('refused the connection ')}",
                "config_error": f"not tried: {broker.get('why')}",
            }.get(broker["state"], f"unreachable: {broker.get('why')}")
            print(f"  broker    {'ok' if broker['ok'] else 'no':5s} {broker['address']} {said}")
        if "camera" in config:
            cam = config["camera"]
            if cam["ok"]:
                width, height = cam["size"]
                print(f"  camera    ok    {cam['source']}: a {width}x{height} frame read ({cam['fps']:g} fps)")
            else:
                print(f"  camera    no    {cam['why']}")
    return code

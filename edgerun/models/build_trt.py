"""``edgerun model build-trt``: a TensorRT engine from an ONNX model, on the board that will run it.

TensorRT engines are tied to the GPU and the TensorRT version they were built
with, so they are built on the device (or one just like it), not shipped.
The input is a ``.onnx`` file or a bundle directory; for a bundle the engine
is written next to the model as ``model.engine`` and registered as the
bundle's ``tensorrt`` variant. A bundle without an ``.onnx`` variant gets one
first, converted from its TFLite model (``tflite2onnx``, pure Python).

Written for the TensorRT 10 API (JetPack 6). TensorRT 11 runs the same
engines but builds strongly typed networks only: there FP16 must come from
the ONNX model itself and calibrated INT8 is gone (both are reported).

Precision: FP16 unless ``--no-fp16``; INT8 when calibration data is given:
a ``.npy`` array of preprocessed input tensors (N x the input shape, or N
tensors with a leading batch of 1), or a directory of images, preprocessed
with the bundle's own settings. INT8 uses TensorRT's entropy calibrator
(implicit quantisation; deprecated in TensorRT 10 in favour of Q/DQ models,
still supported), and the calibration cache is kept beside the engine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.errors import EngineError, ModelError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
MAX_CALIBRATION_IMAGES = 500


def onnx_variant(bundle_root: Path) -> Path:
    """The bundle's ``.onnx`` model, converted from its TFLite model and registered if it has none."""
    from edgerun.models.bundle import MANIFEST, load_bundle

    bundle = load_bundle(bundle_root)
    existing = bundle.variant_path("onnx")
    if existing is not None:
        return existing
    try:
        import tflite2onnx
    except ImportError:
        raise ModelError(
            f"{bundle_root}: the bundle has no onnx variant and tflite2onnx is not installed to convert one "
            "(pip install edgerun[onnx])"
        ) from None
    tflite_path = bundle.variant_path("tflite")
    assert tflite_path is not None
    out = bundle.root / "model.onnx"
    tmp = out.with_suffix(".onnx.tmp")
    # tflite2onnx warns once per float16 weight tensor (they are dequantised, which is fine).
    quiet = logging.getLogger("tflite2onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        tflite2onnx.convert(str(tflite_path), str(tmp))
    except Exception as err:
        tmp.unlink(missing_ok=True)
        raise ModelError(f"{tflite_path}: conversion to ONNX failed ({err})") from None
    finally:
        quiet.setLevel(level)
    tmp.replace(out)
    _register_variant(bundle.root / MANIFEST, "onnx", out.name)
    log.info("converted %s to %s", tflite_path.name, out)
    return out


def _register_variant(manifest_path: Path, key: str, file_name: str) -> None:
    import tomllib

    from edgerun.models.bundle import write_manifest

    data = tomllib.loads(manifest_path.read_text(encoding="utf-8"))
    data.setdefault("variants", {})[key] = file_name
    write_manifest(manifest_path.parent, data)


def _input_spec(onnx_path: Path) -> Any:
    from edgerun.engines.base import EngineOptions
    from edgerun.engines.onnx import OnnxEngine

    engine = OnnxEngine(onnx_path, EngineOptions(num_threads=1, extra={"providers": ["CPUExecutionProvider"]}))
    try:
        return engine.input_spec
    finally:
        engine.close()


def calibration_tensors(source: Path, onnx_path: Path, bundle_root: Path | None) -> np.ndarray:
    """(N, *input shape[1:]) float32 tensors for INT8 calibration, from a .npy or a directory of images."""
    spec = _input_spec(onnx_path)
    if source.suffix == ".npy":
        data = np.load(source).astype(np.float32, copy=False)
        if data.shape[1:] == tuple(spec.shape):  # (N, 1, C, H, W)
            data = data.reshape(data.shape[0], *spec.shape[1:])
        if data.shape[1:] != tuple(spec.shape[1:]):
            raise ModelError(f"{source}: calibration tensors of shape {data.shape}, model input is {spec.shape}")
        return data
    if not source.is_dir():
        raise ModelError(f"{source}: calibration data must be a .npy file or a directory of images")
    if bundle_root is None:
        raise ModelError("calibration images need a bundle (its preprocessing); or give a .npy of tensors")
    import cv2

    from edgerun.models.bundle import load_bundle
    from edgerun.preprocess import Preprocessor

    bundle = load_bundle(bundle_root)
    paths = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:MAX_CALIBRATION_IMAGES]
    if not paths:
        raise ModelError(f"{source}: no images ({', '.join(IMAGE_SUFFIXES)}) to calibrate with")
    tensors = np.empty((len(paths), *spec.shape[1:]), np.float32)
    tensor = np.empty(spec.shape, spec.dtype)
    for i, path in enumerate(paths):
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            raise ModelError(f"{path}: not a readable image")
        Preprocessor(bundle.manifest.preprocess, spec, image.shape[1], image.shape[0])(image, tensor)
        tensors[i] = tensor[0]
    return tensors


def build_engine(
    onnx_path: Path,
    engine_path: Path,
    *,
    fp16: bool = True,
    calibration: np.ndarray | None = None,
    workspace_mb: int = 1024,
    device: str = "",
) -> dict[str, Any]:
    """Build and write a serialised TensorRT engine; returns what was built (for the CLI to print)."""
    from edgerun.engines.tensorrt import CudaContext, cuda_device_index, tensorrt_modules, trt_logger

    trt, cuda = tensorrt_modules()
    logger = trt_logger(trt)
    ctx = CudaContext(cuda, cuda_device_index(device))
    t0 = time.monotonic()
    try:
        with ctx:
            builder = trt.Builder(logger)
            network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
            parser = trt.OnnxParser(network, logger)
            if not parser.parse_from_file(str(onnx_path)):
                errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
                raise ModelError(f"{onnx_path}: TensorRT's ONNX parser refused it ({errors or 'no detail'})")
            config = builder.create_builder_config()
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
            _fixed_batch_profile(trt, builder, network, config)
            precision = ["fp32"]
            if fp16:
                flag = getattr(trt.BuilderFlag, "FP16", None)
                if flag is None:  # TensorRT 11: strongly typed only, precision comes from the ONNX model
                    log.warning("TensorRT %s has no FP16 flag: the engine keeps the ONNX types", trt.__version__)
                else:
                    config.set_flag(flag)
                    precision.append("fp16")
            calibrator = None
            if calibration is not None:
                if not hasattr(trt.BuilderFlag, "INT8") or not hasattr(trt, "IInt8EntropyCalibrator2"):
                    raise EngineError(
                        f"TensorRT {trt.__version__} has no calibrated INT8: quantise the ONNX model with Q/DQ "
                        "nodes instead (NVIDIA ModelOpt), or build with TensorRT 10"
                    )
                config.set_flag(trt.BuilderFlag.INT8)
                calibrator = _entropy_calibrator(trt, cuda, calibration, engine_path.with_suffix(".calib"))
                config.int8_calibrator = calibrator
                precision.append("int8")
            serialized = builder.build_serialized_network(network, config)
            if serialized is None:
                raise EngineError(f"{onnx_path}: TensorRT could not build an engine (see the TensorRT log above)")
            engine_path.write_bytes(bytes(serialized))
    finally:
        ctx.detach()
    return {
        "onnx": str(onnx_path),
        "engine": str(engine_path),
        "tensorrt": trt.__version__,
        "precision": precision,
        "bytes": engine_path.stat().st_size,
        "build_s": round(time.monotonic() - t0, 1),
    }


def _fixed_batch_profile(trt: Any, builder: Any, network: Any, config: Any) -> None:
    """Inputs with a dynamic batch get a profile pinned to batch 1 (the node infers one frame at a time)."""
    profile = None
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = tuple(tensor.shape)
        if all(d >= 0 for d in shape):
            continue
        if any(d < 0 for d in shape[1:]):
            raise ModelError(f"input {tensor.name!r} has dynamic dimensions {shape}; export a fixed image size")
        profile = profile or builder.create_optimization_profile()
        fixed = (1, *shape[1:])
        profile.set_shape(tensor.name, fixed, fixed, fixed)
    if profile is not None:
        config.add_optimization_profile(profile)


def _entropy_calibrator(trt: Any, cuda: Any, tensors: np.ndarray, cache_path: Path) -> Any:
    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[name-defined,misc]
        """Feeds the calibration tensors one at a time through one device buffer."""

        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.tensors = np.ascontiguousarray(tensors, dtype=np.float32)
            self.index = 0
            self.device = cuda.mem_alloc(self.tensors[0:1].nbytes)

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self.index >= len(self.tensors):
                return None
            cuda.memcpy_htod(self.device, self.tensors[self.index : self.index + 1])
            self.index += 1
            return [int(self.device)]

        def read_calibration_cache(self) -> bytes | None:
            return cache_path.read_bytes() if cache_path.is_file() else None

        def write_calibration_cache(self, cache: Any) -> None:
            cache_path.write_bytes(bytes(cache))

    return EntropyCalibrator()


def build_trt_command(
    source: str,
    out: str | None,
    *,
    fp16: bool,
    calibration: str | None,
    workspace_mb: int,
    device: str,
) -> dict[str, Any]:
    """What ``edgerun model build-trt`` does: resolve the ONNX model, build, register in the bundle."""
    from edgerun.models.bundle import MANIFEST

    path = Path(source)
    bundle_root: Path | None = None
    if path.is_dir():
        bundle_root = path
        onnx_path = onnx_variant(path)
        engine_path = Path(out) if out else path / "model.engine"
    elif path.suffix == ".onnx" and path.is_file():
        onnx_path = path
        engine_path = Path(out) if out else path.with_suffix(".engine")
    else:
        raise ModelError(f"{source}: expected a .onnx file or a model bundle directory")
    calib = calibration_tensors(Path(calibration), onnx_path, bundle_root) if calibration else None
    result = build_engine(
        onnx_path, engine_path, fp16=fp16, calibration=calib, workspace_mb=workspace_mb, device=device
    )
    if bundle_root is not None and engine_path.parent.resolve() == bundle_root.resolve():
        _register_variant(bundle_root / MANIFEST, "tensorrt", engine_path.name)
        result["bundle"] = str(bundle_root)
    return result

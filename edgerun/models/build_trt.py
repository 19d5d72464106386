"""``edgerun model build-trt``: a TensorRT engine from an ONNX model, on the board that will run it.

TensorRT engines are tied to the GPU and the TensorRT version they were built
with, so they are built on the device (or one just like it), not shipped.
The input is a ``.onnx`` file or a bundle directory; for a bundle the engine
is written next to the model as ``model.engine`` and registered as the
bundle's ``tensorrt`` variant. A bundle without an ``.onnx`` variant gets one
first, converted from its TFLite model (``tflite2onnx``, pure Python).

Written for the TensorRT 10 API: JetPack 6.1 and 6.2 ship TensorRT 10.3
(JetPack 6.0 ships 8.6, which edgerun does not support). TensorRT 11 has no
JetPack release and removes the precision builder flags (FP16, INT8) and the
INT8 calibrator: networks are strongly typed, so precision comes from the
ONNX model itself (ModelOpt AutoCast, Q/DQ nodes); both are reported. An
engine runs only under the TensorRT version that built it: after an upgrade,
build it again.

The input tensor's spec (shape, data type, layout) is read from the network
TensorRT parsed, so building needs neither ONNX Runtime nor the bundle's
other variants. Precision: FP16 unless ``--no-fp16``; INT8 when calibration
data is given: a ``.npy`` array of preprocessed input tensors (N x the input
shape, or N tensors with a leading batch of 1), or a directory of images,
preprocessed with the bundle's own settings; the calibrator feeds them in the
input tensor's own data type. INT8 uses TensorRT's entropy calibrator
(implicit quantisation; deprecated in TensorRT 10 in favour of Q/DQ models,
still supported), and the calibration cache is kept beside the engine. The
engine and the cache are written atomically (temporary file, fsync, rename):
an interrupted build never leaves a truncated engine for a node to load.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgerun.engines.base import TensorSpec
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
    from edgerun.models.bundle import MANIFEST, write_manifest
    from edgerun.tomlfile import load_toml

    data = load_toml(manifest_path, ModelError, MANIFEST)
    data.setdefault("variants", {})[key] = file_name
    write_manifest(manifest_path.parent, data)


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or keeps what it held: temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def network_input_spec(trt: Any, network: Any, onnx_path: Path) -> TensorSpec:
    """The parsed network's one input as the node will feed it: batch 1, its own data type."""
    from edgerun.engines.onnx import image_layout
    from edgerun.engines.tensorrt import numpy_dtype

    if network.num_inputs != 1:
        raise ModelError(f"{onnx_path}: expected 1 input tensor, found {network.num_inputs}")
    tensor = network.get_input(0)
    shape = tuple(int(d) for d in tuple(tensor.shape))
    if any(d < 0 for d in shape[1:]):
        raise ModelError(f"input {tensor.name!r} has dynamic dimensions {shape}; export a fixed image size")
    shape = (1, *shape[1:])
    dtype = numpy_dtype(trt, tensor.dtype, f"{onnx_path}: input {tensor.name!r}")
    return TensorSpec(name=tensor.name, shape=shape, dtype=dtype, layout=image_layout(shape))


def calibration_tensors(source: Path, spec: TensorSpec, bundle_root: Path | None) -> np.ndarray:
    """(N, *input shape[1:]) tensors in the input's own dtype for INT8 calibration, from a .npy or images."""
    if source.suffix == ".npy":
        try:
            data = np.load(source, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ModelError(f"{source}: not a readable .npy array ({err})") from None
        data = data.astype(spec.dtype, copy=False)
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
    tensors = np.empty((len(paths), *spec.shape[1:]), spec.dtype)
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
    calibration: Callable[[TensorSpec], np.ndarray] | None = None,
    workspace_mb: int = 1024,
    device: str = "",
) -> dict[str, Any]:
    """Build and write a serialised TensorRT engine; returns what was built (for the CLI to print).

    ``calibration`` (INT8) gets the parsed network's input spec and returns the calibration tensors.
    """
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
            spec = network_input_spec(trt, network, onnx_path)
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
                tensors = calibration(spec)
                calibrator = entropy_calibrator(trt, cuda, tensors, spec, engine_path.with_suffix(".calib"))
                config.int8_calibrator = calibrator
                precision.append("int8")
            serialized = builder.build_serialized_network(network, config)
            if serialized is None:
                raise EngineError(f"{onnx_path}: TensorRT could not build an engine (see the TensorRT log above)")
            write_atomically(engine_path, bytes(serialized))
    finally:
        ctx.close()
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


def entropy_calibrator(trt: Any, cuda: Any, tensors: np.ndarray, spec: TensorSpec, cache_path: Path) -> Any:
    """TensorRT's entropy calibrator over ``tensors``, fed in the input tensor's own dtype."""

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):
        """Feeds the calibration tensors one at a time through one device buffer."""

        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.tensors = np.ascontiguousarray(tensors, dtype=spec.dtype)
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
            write_atomically(cache_path, bytes(cache))

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
    calib = None
    if calibration:
        calib_source = Path(calibration)

        def calib(spec: TensorSpec) -> np.ndarray:
            return calibration_tensors(calib_source, spec, bundle_root)

    result = build_engine(
        onnx_path, engine_path, fp16=fp16, calibration=calib, workspace_mb=workspace_mb, device=device
    )
    if bundle_root is not None and engine_path.parent.resolve() == bundle_root.resolve():
        _register_variant(bundle_root / MANIFEST, "tensorrt", engine_path.name)
        result["bundle"] = str(bundle_root)
    return result

"""What setup.cfg's extras promise about the wheels they pull in: the platforms tflite-micro installs on, and the
COBS implementation the mcu extra may resolve to."""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import random
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO


def extra(name: str) -> dict[str, Requirement]:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in parser["options.extras_require"][name].splitlines()]
    return {req.name: req for req in (Requirement(line) for line in lines if line)}


def machine_env(machine: str) -> dict[str, str]:
    return {"platform_machine": machine, "sys_platform": "linux", "platform_system": "Linux"}


def test_tflite_micro_is_asked_for_only_where_google_publishes_a_wheel():
    """Its wheels are x86_64 Linux only (cp3xx-manylinux_2_28_x86_64; none for aarch64): on a Pi or Jetson the
    extra must install nothing rather than send pip after a wheel that does not exist."""
    marker = extra("mcu-check")["tflite-micro"].marker
    assert marker is not None
    assert marker.evaluate(machine_env("x86_64"))
    assert not marker.evaluate(machine_env("aarch64"))


def test_the_installed_tflite_micro_wheel_is_for_a_machine_the_marker_allows():
    try:
        wheel = importlib.metadata.distribution("tflite-micro").read_text("WHEEL") or ""
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tflite-micro not installed (the mcu-check extra)")
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    marker = extra("mcu-check")["tflite-micro"].marker
    assert marker is not None and tags
    for tag in tags:  # cp311-cp311-manylinux_2_28_x86_64: the machine is the platform tag's tail
        machine = "x86_64" if tag.endswith("x86_64") else tag.rsplit("_", 1)[-1]
        assert marker.evaluate(machine_env(machine)), tag


def test_check_mcu_without_tflite_micro_says_what_to_install(blazeface_bundle):
    """FAULT INJECTION: ``sys.modules["tflite_micro"] = None`` stands in for a machine without the wheel (a Pi):
    the command names the missing wheel in one line (exit 2), not "cannot parse the TFLite model"."""
    model = blazeface_bundle.variant_path("tflite")
    code = (
        "import sys; sys.modules['tflite_micro'] = None\n"
        "from edgerun.cli import main\n"
        f"sys.exit(main(['model', 'check-mcu', {str(model)!r}, '--arena', '64k']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 2, proc.stderr
    assert "check-mcu needs the tflite-micro wheel: pip install 'edgerun[mcu-check]'" in proc.stderr
    assert "cannot parse" not in proc.stderr


def test_the_pure_python_cobs_frames_like_the_c_extension():
    """pip may resolve ``cobs`` to pure Python (the 1.2.0 wheel, or 1.2.2 built without a compiler): edgelink's
    framing must not depend on which. Random payloads, zero bytes and 254-byte runs, both ways."""
    from cobs.cobs import _cobs_py as pure

    from edgerun.mcu import protocol

    rng = random.Random(7)
    payloads = [b"", b"\0", b"\0" * 300, bytes(range(1, 255)) * 2]
    payloads += [bytes(rng.choice([0, rng.randrange(256)]) for _ in range(rng.randrange(600))) for _ in range(200)]
    for payload in payloads:
        encoded = pure.encode(payload)
        assert protocol.cobs.encode(payload) == encoded
        assert protocol.cobs.decode(encoded) == pure.decode(encoded) == payload


def test_the_cobs_comment_claims_no_c_extension_unconditionally():
    text = (REPO / "setup.cfg").read_text()
    comment = text[: text.index("    cobs>=")].rsplit("mcu =", 1)[1]
    assert "COBS (C extension)" not in comment and "pure Python" in comment

"""deploy/balena without a Docker daemon: compose files against the Compose specification's JSON schema
(vendored by check-jsonschema), Dockerfiles through hadolint, and the variables they set through the node's own
config validation."""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from edgerun.config import load_config
from tests.deploy.conftest import DEPLOY, REPO

BALENA = DEPLOY / "balena"
DEVICE_CLASSES = sorted(p.parent.name for p in BALENA.glob("*/Dockerfile.template"))
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (setup.cfg's test extra)")
    return str(path)


def compose(device_class: str) -> dict:
    return YAML(typ="safe").load((BALENA / device_class / "docker-compose.yml").read_text())


def test_every_device_class_is_there():
    assert DEVICE_CLASSES == ["coral", "jetson-orin", "raspberrypi"]


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_compose_file_matches_the_compose_spec_schema(device_class):
    proc = subprocess.run(
        [
            tool("check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(BALENA / device_class / "docker-compose.yml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_catches_a_bad_compose_file(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(
        (BALENA / "raspberrypi/docker-compose.yml").read_text().replace("restart: always", "restart: [always]")
    )
    proc = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "restart" in proc.stdout


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_dockerfile_is_hadolint_clean(device_class):
    dockerfile = BALENA / device_class / "Dockerfile.template"
    proc = subprocess.run([tool("hadolint"), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    # Every ignored rule says why on the line above it.
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert lines[i - 1].startswith("# ") and "hadolint" not in lines[i - 1], f"{dockerfile}:{i + 1}"


def test_hadolint_is_live(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    proc = subprocess.run([tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_compose_builds_this_device_class_and_keeps_state(device_class):
    service = compose(device_class)["services"]["edgerun"]
    dockerfile = REPO / service["build"]["dockerfile"]
    assert dockerfile == BALENA / device_class / "Dockerfile.template"
    assert service["build"]["context"] == "."  # the repository root: the Dockerfile copies edgerun/
    assert "edgerun-data:/data" in service["volumes"]  # models and OTA state persist across releases
    assert "/opt/edgerun/healthcheck.py" in service["healthcheck"]["test"]
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"COPY (?!--from)(.+) \S+$", line)
        if m:
            for src in m.group(1).split():
                assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src}"


def balena_variables(device_class: str) -> dict[str, str]:
    """Every EDGERUN_ variable a device of this class gets: Dockerfile ENV, compose environment, fleet defaults."""
    text = (BALENA / device_class / "Dockerfile.template").read_text()
    env = dict(re.findall(r"(EDGERUN_[A-Z_]+)=(\S*)", text.split("\nENV ", 1)[1] if "\nENV " in text else ""))
    env.update({k: str(v) for k, v in compose(device_class)["services"]["edgerun"]["environment"].items()})
    balena = YAML(typ="safe").load((BALENA / "balena.yml").read_text())
    for item in balena["data"]["applicationEnvironmentVariables"]:
        env.update({k: str(v) for k, v in item.items()})
    return env


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_the_image_config_and_variables_validate(monkeypatch, device_class):
    """node.toml with every variable the image, compose file and fleet set: the node would start with it."""
    env = balena_variables(device_class)
    assert env["EDGERUN_SERVICE_HTTP_PORT"] == "8089"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(BALENA / "node.toml")
    # In the container the health check and the station reach /healthz from outside: every address.
    assert ipaddress.ip_address(cfg.service.http_host).is_unspecified and cfg.sinks.mqtt.host == "mqtt.example.lan"
    assert cfg.engine.order[0] == {"raspberrypi": "tflite", "jetson-orin": "tensorrt", "coral": "edgetpu"}[device_class]

"""deploy/balena without a Docker daemon: compose files against the Compose specification's JSON schema
(vendored by check-jsonschema), Dockerfiles through hadolint, and the variables they set through the node's own
config validation."""

from __future__ import annotations

import configparser
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from edgerun.config import load_config
from edgerun.testing.ports import free_port
from tests.deploy.conftest import DEPLOY, REPO, wait_http

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
        (BALENA / "raspberrypi/docker-compose.yml").read_text().replace("restart: on-failure", "restart: [on-failure]")
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


# -- the container's start: supervise.py, the restart policy, the baked model, the service user -----------------


def dockerfile_lines(device_class: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    text = (BALENA / device_class / "Dockerfile.template").read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def container_command(device_class: str) -> list[str]:
    """The image's ENTRYPOINT + CMD, run here: files the Dockerfile COPYs from the repository at their repository
    path, python as this interpreter, the edgerun console script as ``python -m edgerun``."""
    lines = dockerfile_lines(device_class)
    copied = {}
    for line in lines:
        m = re.match(r"COPY (?!--from)(\S+) (\S+)$", line)
        if m:
            copied[m.group(2)] = str(REPO / m.group(1))
    argv: list[str] = []
    for word in ("ENTRYPOINT", "CMD"):
        found = [json.loads(line.split(None, 1)[1]) for line in lines if line.startswith(word + " ")]
        argv += found[-1] if found else []
    command: list[str] = []
    for arg in argv:
        if arg in ("python", "python3"):
            command.append(sys.executable)
        elif arg == "edgerun":
            command += [sys.executable, "-m", "edgerun"]
        else:
            command.append(copied.get(arg, arg))
    return command


def engine_restarts(policy: str, exit_code: int, restarts_so_far: int) -> bool:
    """Whether Docker's (and balenaEngine's) restart policy starts a container again after it exited."""
    name, _, limit = policy.partition(":")
    if name in ("always", "unless-stopped"):
        return True
    if name == "on-failure":
        return exit_code != 0 and (not limit or restarts_so_far < int(limit))
    assert name == "no", policy
    return False


def container_env(device_class: str, tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGERUN_") and k != "NOTIFY_SOCKET"}
    env.update(balena_variables(device_class))
    env.update(EDGERUN_CACHE=str(tmp / "cache"), STATE_DIRECTORY=str(tmp / "state"), PYTHONPATH=str(REPO), **extra)
    return env


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_a_container_with_no_model_stops_instead_of_restarting_forever(device_class, tmp_path):
    """The image's command started for real, as the engine would, with the model it names absent (as on a device
    whose EDGERUN_MODEL_BUNDLE points at nothing): the node exits 2, and the compose file's restart policy does
    not start it again."""
    policy = str(compose(device_class)["services"]["edgerun"]["restart"])
    command = container_command(device_class)
    env = container_env(device_class, tmp_path, EDGERUN_MODEL_BUNDLE=str(tmp_path / "no-model-here"))
    runs = []
    while len(runs) < 3:  # three starts would be a loop: on main (restart: always, no supervisor) there are three
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        runs.append(proc)
        if not engine_restarts(policy, proc.returncode, len(runs) - 1):
            break
    assert len(runs) == 1, [(p.returncode, p.stderr[-300:]) for p in runs]
    stderr = runs[0].stderr
    assert f"model.bundle: {tmp_path / 'no-model-here'} not found" in stderr, stderr
    assert "not restarting" in stderr, stderr


def test_supervise_keeps_a_crash_a_failure(tmp_path):
    """A node killed by a signal (a driver taking the process down) is restarted: the status stays non-zero."""
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    proc = subprocess.run([sys.executable, str(BALENA / "supervise.py"), *crash], timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    assert engine_restarts(str(compose("raspberrypi")["services"]["edgerun"]["restart"]), proc.returncode, 0)
    failed = subprocess.run([sys.executable, str(BALENA / "supervise.py"), sys.executable, "-c", "exit(1)"])
    assert failed.returncode == 1


def test_supervise_passes_the_engines_stop_on_and_the_node_stops_cleanly(tmp_path, blazeface_bundle):
    """`docker stop` signals PID 1 (supervise.py): the node gets the SIGTERM, drains, and the container exits 0."""
    port = free_port()
    env = container_env(
        "raspberrypi", tmp_path, EDGERUN_MODEL_BUNDLE=str(blazeface_bundle.root), EDGERUN_SOURCE_KIND="replay",
        EDGERUN_SINKS_MQTT_ENABLED="false", EDGERUN_SERVICE_HTTP_HOST="127.0.0.1", EDGERUN_SERVICE_HTTP_PORT=str(port),
    )  # fmt: skip
    proc = subprocess.Popen(container_command("raspberrypi"), env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", 90, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    assert "not restarting" not in stderr


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_the_image_bakes_the_model_its_config_names_and_runs_as_a_service_user(device_class):
    lines = dockerfile_lines(device_class)
    bundle = Path(load_config(BALENA / "node.toml").model.bundle)
    fetch = next(line for line in lines if "model fetch-demo" in line)
    assert f"fetch-demo {bundle.name}" in fetch and f"/models/{bundle.name} {bundle.parent}/" in fetch, fetch
    if any(line.startswith("FROM ") and " AS build" in line for line in lines[1:]) or lines[0].endswith(" AS build"):
        assert f"COPY --from=build {bundle.parent} {bundle.parent}" in lines  # into the final stage
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] == "10001:10001", users
    assert "--uid 10001" in next(line for line in lines if "useradd" in line)
    assert any(line.startswith("ENTRYPOINT ") and "supervise.py" in line for line in lines)


def dds_pin() -> str:
    """The cyclonedds version setup.cfg's [dds] extra pins (an exact ==, or the test fails naming the line)."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    lines = [line.strip() for line in parser["options.extras_require"]["dds"].splitlines() if line.strip()]
    pins = [line for line in lines if line.startswith("cyclonedds")]
    assert len(pins) == 1 and re.fullmatch(r"cyclonedds==[0-9.]+", pins[0]), pins
    return pins[0].split("==")[1]


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_the_dds_binding_and_the_c_library_the_image_builds_are_one_version(device_class):
    """pip builds the binding against the C library the Dockerfile builds: a newer binding would not compile."""
    text = (BALENA / device_class / "Dockerfile.template").read_text()
    built = re.findall(r"^ARG CYCLONEDDS_VERSION=(\S+)$", text, re.M)
    assert built == [dds_pin()], (built, dds_pin())
    assert '--branch "${CYCLONEDDS_VERSION}"' in text and '".[dds]"' in text


def test_the_installing_page_builds_the_same_c_library():
    text = (REPO / "docs/installing.md").read_text()
    assert re.findall(r"git clone --branch (\S+) --depth 1 \S+/cyclonedds\b", text) == [dds_pin()]

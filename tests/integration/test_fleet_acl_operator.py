"""The operator's tools on the shipped access-controlled broker (deploy/mosquitto): a real mosquitto, TLS, the ACL.

``edgerun fleet publish`` and ``halt`` log in as the operator and are taken; the same commands under a node's
identity are refused by the broker and say so in one line (no release retained); ``fleet status`` logs in as the
station and sees the release verified; anonymous, the tools fail in one line naming the refusal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from edgerun.fleet.rollout import read_topics
from edgerun.ota.transport_mqtt import release_topic
from tests.integration.test_mqtt_fleet_acl import _run_broker, pytestmark  # noqa: F401 - same skips and timeout
from tests.unit.test_ota_release import Fleet, head_variant

MODEL = "blazeface_short"


def login(fleet_broker: Any, identity: str) -> tuple[list[str], dict[str, str]]:
    user, password = fleet_broker.credentials[identity]
    return (
        [
            "--mqtt-user",
            user,
            "--mqtt-password-env",
            "EDGERUN_TEST_MQTT_PASSWORD",
            "--mqtt-tls-ca",
            str(fleet_broker.ca),
        ],
        {**os.environ, "EDGERUN_TEST_MQTT_PASSWORD": password},
    )


def edgerun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgerun", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def acl_broker() -> Any:
    """The shipped deploy/mosquitto config on a free loopback port (as in test_mqtt_fleet_acl)."""
    with tempfile.TemporaryDirectory(prefix="edgerun-fleet-broker-") as tmp:
        yield from _run_broker(Path(tmp))


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Fleet, Path]:
    fleet = Fleet(tmp_path / "fleet")
    fleet.write_keys()
    key_file = tmp_path / "release.key"
    key_file.write_text(fleet.release_keys[0].to_text())
    return fleet, key_file


def test_the_operator_publishes_and_halts_and_a_node_identity_cannot(
    acl_broker: Any, keys: Any, tmp_path: Path, blazeface_bundle: Any
) -> None:
    from edgerun.config import MqttSinkConfig

    broker = acl_broker
    fleet, key_file = keys
    mqtt = f"127.0.0.1:{broker.port}"
    v2 = head_variant(blazeface_bundle, tmp_path / "v2", 2)
    publish = [
        "fleet",
        "publish",
        str(v2.root),
        "--percent",
        "10",
        "--keys",
        str(fleet.release_dir),
        "--signing-key",
        str(key_file),
        "--fleet-seconds",
        "0",
        "--mqtt",
        mqtt,
    ]

    # Anonymous: the broker refuses the login, and the tool says so in one line.
    done = edgerun(*publish, "--mqtt-tls-ca", str(broker.ca))
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert "refused" in done.stderr or "timed out" in done.stderr, done.stderr

    # A node's identity: the broker refuses its publishes on the release topics (PUBACK 135).
    args, env = login(broker, "drone-a")
    done = edgerun(*publish, *args, env=env)
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert "the broker refused edgerun/fleet/releases/" in done.stderr, done.stderr
    station_cfg = MqttSinkConfig(
        username=broker.credentials["station"][0], password=broker.credentials["station"][1], tls_ca=str(broker.ca)
    )
    retained = read_topics("127.0.0.1", broker.port, [release_topic(MODEL)], cfg=station_cfg)
    assert release_topic(MODEL) not in retained

    # The operator: published, then halted.
    args, env = login(broker, "operator")
    done = edgerun(*publish, *args, env=env)
    assert done.returncode == 0, done.stderr
    done = edgerun(
        "fleet",
        "halt",
        "--mqtt",
        mqtt,
        "--signing-key",
        str(key_file),
        "--root-key",
        fleet.root_pub_paths[0],
        *args,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert f"{MODEL} v2: halted at 0%" in done.stdout

    # The station's identity reads it back, verified against the root key.
    args, env = login(broker, "station")
    done = edgerun(
        "fleet", "status", "--mqtt", mqtt, "--seconds", "1", "--root-key", fleet.root_pub_paths[0], *args, env=env
    )
    assert done.returncode == 0, done.stderr
    assert f"rollout {MODEL} v2: halted at 0%" in done.stdout and "UNVERIFIED" not in done.stdout, done.stdout

"""Never-connected is an error with its cause: real ``edgerun`` processes against a closed port and a real
mosquitto that refuses a wrong password.

Each command exits non-zero with one line naming the broker and why: 1 for a broker that may come back
(nothing listens), 2 for a login a person must fix (the broker refused it for good). The station must name a
refused login as such, not as the "Protocol error" disconnect paho reports after an MQTT 5 CONNACK refusal.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgerun.sinks.mosquitto import Mosquitto
from tests.integration.brokers import find_mosquitto, free_port, run_mosquitto

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(find_mosquitto() is None or shutil.which("mosquitto_passwd") is None,
                       reason="mosquitto is not installed (.ci/install-system-deps)"),
]  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
USER, PASSWORD = "alice", "correct horse"
REFUSED_LOGIN = ("(Not authorized)", "(Bad user name or password)")  # mosquitto's answer depends on its version


@pytest.fixture(scope="module")
def broker() -> Iterator[Mosquitto]:
    """A broker with one login; anonymous clients may still connect, a wrong password may not."""
    # Not under pytest's tmp_path (0700 root): a broker started as root reads its files as the mosquitto user.
    with tempfile.TemporaryDirectory(prefix="edgerun-cli-connect-") as tmp:
        passwd = Path(tmp) / "passwd"
        subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwd), USER, PASSWORD], check=True,
                       capture_output=True, timeout=30)  # fmt: skip
        os.chmod(passwd, 0o644)
        with run_mosquitto(workdir=tmp, extra=[f"password_file {passwd}"]) as running:
            yield running


def edgerun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgerun", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_listen_to_a_closed_port_exits_1_with_one_line() -> None:
    port = free_port()  # nothing listens on it
    proc = edgerun("listen", "--mqtt", f"127.0.0.1:{port}", "--seconds", "3")
    assert proc.returncode == 1
    assert proc.stderr == f"edgerun: error: listen: mqtt://127.0.0.1:{port}: connection refused\n"


def test_listen_with_a_wrong_password_exits_2_naming_the_refusal(broker: Mosquitto) -> None:
    """The login options every broker command shares (--mqtt-user, --mqtt-password-env)."""
    proc = edgerun("listen", "--mqtt", f"127.0.0.1:{broker.port}", "--seconds", "3", "--mqtt-user", USER,
                   "--mqtt-password-env", "LISTEN_PW", env={"LISTEN_PW": "wrong"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.removesuffix("\n")
    assert "\n" not in line
    assert line.startswith(f"edgerun: error: listen: mqtt://127.0.0.1:{broker.port}: refused the connection ")
    assert line.endswith(REFUSED_LOGIN), line


def test_listen_with_the_right_password_listens_and_exits_0(broker: Mosquitto) -> None:
    """listen's earlier spelling (--username, the password in EDGERUN_MQTT_PASSWORD) still logs in."""
    proc = edgerun("listen", "--mqtt", f"127.0.0.1:{broker.port}", "--seconds", "1", "--username", USER,
                   env={"EDGERUN_MQTT_PASSWORD": PASSWORD})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"listen: 127.0.0.1:{broker.port}: listening on edgerun/+/detections\n"


def test_listen_with_the_shared_password_file_listens(broker: Mosquitto, tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n")
    proc = edgerun("listen", "--mqtt", f"127.0.0.1:{broker.port}", "--seconds", "1", "--mqtt-user", USER,
                   "--mqtt-password-file", str(secret))  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_station_that_never_reached_its_broker_exits_1_naming_why() -> None:
    port = free_port()
    proc = edgerun("station", "--mqtt", f"127.0.0.1:{port}", "--bind", "127.0.0.1:0", "--seconds", "3")
    assert proc.returncode == 1, proc.stderr
    assert last_line(proc) == (
        f"edgerun: error: station: never connected: cannot reach mqtt://127.0.0.1:{port} (connection refused)"
    )


def test_station_with_a_wrong_password_stops_at_once_naming_the_refusal(broker: Mosquitto) -> None:
    proc = edgerun("station", "--mqtt", f"127.0.0.1:{broker.port}", "--bind", "127.0.0.1:0", "--seconds", "30",
                   "--mqtt-user", USER, "--mqtt-password-env", "WRONG", env={"WRONG": "wrong"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = last_line(proc)
    assert line.startswith(f"edgerun: error: mqtt://127.0.0.1:{broker.port} refused the connection "), line
    assert line.endswith(REFUSED_LOGIN), line
    assert "Protocol error" not in proc.stderr


@pytest.mark.parametrize("command", [["fleet", "status"], ["fleet", "objects"]])
def test_fleet_commands_name_a_closed_port(command: list[str]) -> None:
    port = free_port()
    proc = edgerun(*command, "--mqtt", f"127.0.0.1:{port}")
    assert proc.returncode == 1
    assert proc.stderr == f"edgerun: error: mqtt://127.0.0.1:{port}: connection refused\n"


def test_fleet_status_with_a_wrong_password_exits_2(broker: Mosquitto) -> None:
    proc = edgerun("fleet", "status", "--mqtt", f"127.0.0.1:{broker.port}", "--mqtt-user", USER,
                   "--mqtt-password-env", "WRONG", env={"WRONG": "wrong"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert last_line(proc).endswith(REFUSED_LOGIN)

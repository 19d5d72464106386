"""The camera in the shipped configs: balena binds every address, so /snapshot.jpg is off until a token is set."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.config import load_config
from edgerun.errors import ConfigError
from edgerun.preflight import check_snapshot
from edgerun.service.http import is_loopback, load_snapshot_token
from tests.deploy.conftest import DEPLOY
from tests.deploy.test_deploy_balena import BALENA, DEVICE_CLASSES, balena_variables


@pytest.mark.parametrize("device_class", DEVICE_CLASSES)
def test_balena_serves_no_snapshot_without_a_token(monkeypatch: pytest.MonkeyPatch, device_class: str) -> None:
    for key, value in balena_variables(device_class).items():
        monkeypatch.setenv(key, value)
    cfg = load_config(BALENA / "node.toml")
    assert not is_loopback(cfg.service.http_host) and cfg.service.snapshot_token_file == ""  # -> 403, logged once


def test_balena_with_a_token_file_on_the_data_volume(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = tmp_path / "snapshot.token"
    token.write_text("0123456789abcdef\n")
    for key, value in balena_variables("raspberrypi").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("EDGERUN_SERVICE_SNAPSHOT_TOKEN_FILE", str(token))
    cfg = load_config(BALENA / "node.toml")
    check_snapshot(cfg)
    assert load_snapshot_token(cfg.service.snapshot_token_file) == b"0123456789abcdef"
    monkeypatch.setenv("EDGERUN_SERVICE_SNAPSHOT_TOKEN_FILE", str(tmp_path / "missing.token"))
    with pytest.raises(ConfigError, match="service.snapshot_token_file"):
        check_snapshot(load_config(BALENA / "node.toml"))


def test_the_systemd_example_keeps_the_camera_on_loopback() -> None:
    cfg = load_config(DEPLOY / "node.example.toml")
    assert is_loopback(cfg.service.http_host) and cfg.service.snapshot_token_file == ""

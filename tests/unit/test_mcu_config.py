"""The [mcu] config section: defaults, strict keys, one-line errors naming the key."""

from __future__ import annotations

import pytest

from edgerun.config import parse_config
from edgerun.errors import ConfigError


def test_defaults_leave_the_mcu_link_off() -> None:
    cfg = parse_config({}).mcu
    assert cfg.enabled is False and cfg.baud == 921600 and cfg.ota_chunk == 236


def test_a_full_section_parses() -> None:
    cfg = parse_config(
        {
            "mcu": {
                "enabled": True,
                "port": "/dev/ttyUSB0",
                "baud": 115200,
                "labels": ["person"],
                "release_keys": ["/etc/edgerun/mcu.pub"],
                "ota_chunk": 128,
            }
        }
    ).mcu
    assert (cfg.port, cfg.baud, cfg.labels, cfg.ota_chunk) == ("/dev/ttyUSB0", 115200, ["person"], 128)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": True}, "mcu.port: required when mcu.enabled is true"),
        ({"bud": 9600}, "mcu.bud: unknown key"),
        ({"ota_chunk": 237}, "mcu.ota_chunk: expected int <= 236, got 237"),
        ({"baud": 0}, "mcu.baud: expected int >= 1, got 0"),
    ],
)
def test_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"mcu": section})
    assert str(err.value) == message
    assert err.value.exit_code == 2

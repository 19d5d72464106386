"""The checks a node runs before heavy work: each names the key and the file, and exits 2 (a person must fix it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.config import parse_config
from edgerun.errors import ConfigError, ModelError
from edgerun.preflight import preflight, unwritable

ROOT_KEY = "RWQf6LRCGA9i53mlYecO4IzT51TGPpvWucNSCh1CBM0QTaLn73Y7GFO3"  # minisign's documented example key


def test_a_good_config_passes(tmp_path, blazeface_bundle):
    preflight(
        parse_config(
            {
                "model": {"bundle": str(blazeface_bundle.root)},
                "sinks": {"jsonl": {"path": str(tmp_path / "out" / "d.jsonl")}},
            }
        )
    )


def test_missing_bundle_is_a_model_error_that_exits_2(tmp_path):
    with pytest.raises(ModelError, match=f"model.bundle: {tmp_path / 'nope'} not found") as err:
        preflight(parse_config({"model": {"bundle": str(tmp_path / "nope")}}))
    assert err.value.exit_code == 2


def test_root_key_file_that_is_missing_or_garbage(tmp_path):
    missing = tmp_path / "root.pub"
    cfg = {
        "ota": {
            "enabled": True,
            "root_keys": [str(missing)],
            "state_dir": str(tmp_path / "s"),
            "watch_dir": str(tmp_path),
        }
    }
    with pytest.raises(ConfigError, match=f"ota.root_keys: {missing}: cannot read public key"):
        preflight(parse_config(cfg))
    missing.write_bytes(b"\xff\xfe binary garbage")
    with pytest.raises(ConfigError, match="ota.root_keys: .*not a minisign public key"):
        preflight(parse_config(cfg))


def test_tls_files_are_loaded_before_anything_connects(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="sinks.mqtt.tls_ca: .*ca.pem is not a PEM CA file"):
        preflight(parse_config({"sinks": {"mqtt": {"enabled": True, "tls_ca": str(ca)}}}))
    # The same broker settings serve OTA over MQTT with the sink off: still checked.
    cfg = {
        "sinks": {"mqtt": {"tls_ca": str(ca)}},
        "ota": {"enabled": True, "mqtt": True, "root_keys": [ROOT_KEY], "state_dir": str(tmp_path / "s")},
    }
    with pytest.raises(ConfigError, match="sinks.mqtt.tls_ca"):
        preflight(parse_config(cfg))
    cert = tmp_path / "cert.pem"
    cert.write_text("nope")
    with pytest.raises(ConfigError, match="sinks.mqtt.tls_cert: .*cert.pem"):
        preflight(parse_config({"sinks": {"mqtt": {"enabled": True, "tls_cert": str(cert), "tls_key": str(cert)}}}))


def test_state_directories_must_be_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    under_a_file = blocker / "state"
    with pytest.raises(ConfigError, match=f"engine.state_dir: {under_a_file} cannot be created: {blocker} is not"):
        preflight(parse_config({"engine": {"order": ["edgetpu"], "state_dir": str(under_a_file)}}))
    # Only the CPU engine: no breadcrumbs are written, so the directory is not needed.
    preflight(parse_config({"engine": {"state_dir": str(under_a_file)}}))
    with pytest.raises(ConfigError, match="ota.state_dir: "):
        preflight(
            parse_config(
                {
                    "ota": {
                        "enabled": True,
                        "state_dir": str(under_a_file),
                        "root_keys": [ROOT_KEY],
                        "watch_dir": str(tmp_path),
                    }
                }
            )
        )
    with pytest.raises(ConfigError, match="sinks.jsonl.path: "):
        preflight(parse_config({"sinks": {"jsonl": {"path": str(under_a_file / "d.jsonl")}}}))


def test_inputs_named_in_the_config_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="source.path: .*photos not found"):
        preflight(parse_config({"source": {"kind": "images", "path": str(tmp_path / "photos")}}))
    with pytest.raises(ConfigError, match="source.replay.scene: .*ground.png not found"):
        preflight(parse_config({"source": {"replay": {"scene": str(tmp_path / "ground.png")}}}))


def test_unwritable_reasons(tmp_path):
    assert unwritable(tmp_path) == ""
    assert unwritable(tmp_path / "not" / "yet") == ""  # made on demand
    (tmp_path / "f").write_text("")
    assert unwritable(tmp_path / "f" / "x").startswith("cannot be created")
    assert Path("/proc/1").exists() and unwritable(Path("/proc/1/edgerun")) != ""  # procfs takes no new files

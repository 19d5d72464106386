"""balena device variables (EDGERUN_<SECTION>_<KEY>) onto config keys, validated like the TOML."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from edgerun.config import Config, load_config
from edgerun.config_env import overlay_env, resolve
from edgerun.errors import ConfigError


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[source]\nkind = "replay"\n[service]\nhttp_port = 8100\n')
    return path


def _leaf_paths(section: type, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for f in msgspec.structs.fields(section):
        tp = f.type
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            paths += _leaf_paths(tp, (*prefix, f.name))
        else:
            paths.append((*prefix, f.name))
    return paths


def test_every_config_key_has_exactly_its_own_variable():
    paths = _leaf_paths(Config)
    assert ("sinks", "mqtt", "host") in paths and ("service", "http_port") in paths
    for path in paths:
        words = "_".join(path).split("_")
        found = resolve(words, Config)
        assert found is not None and found[0] == path, path


@pytest.mark.parametrize(
    ("env", "check"),
    [
        ({"EDGERUN_SINKS_MQTT_HOST": "broker.lan"}, lambda c: c.sinks.mqtt.host == "broker.lan"),
        ({"EDGERUN_SINKS_MQTT_ENABLED": "true"}, lambda c: c.sinks.mqtt.enabled is True),
        ({"EDGERUN_SINKS_MQTT_ENABLED": "0"}, lambda c: c.sinks.mqtt.enabled is False),
        ({"EDGERUN_SERVICE_HTTP_PORT": "9100"}, lambda c: c.service.http_port == 9100),
        ({"EDGERUN_SOURCE_REPLAY_HFOV_DEG": "75.5"}, lambda c: c.source.replay.hfov_deg == 75.5),
        ({"EDGERUN_ENGINE_ORDER": "onnx, tflite"}, lambda c: c.engine.order == ["onnx", "tflite"]),
        ({"EDGERUN_ENGINE_ORDER": '["onnx", "tflite"]'}, lambda c: c.engine.order == ["onnx", "tflite"]),
        ({"EDGERUN_MODEL_SCORE_THRESHOLD": "0.6"}, lambda c: c.model.score_threshold == 0.6),
        # A string key keeps the text as it is, even when it would parse as a number.
        ({"EDGERUN_NODE_ID": "007"}, lambda c: c.node.id == "007"),
        ({"EDGERUN_SINKS_MQTT_PASSWORD": "p=1 #x"}, lambda c: c.sinks.mqtt.password == "p=1 #x"),
        # Not config: other EDGERUN_ variables are left alone.
        ({"EDGERUN_CACHE": "/data/cache", "EDGERUN_HTTP_PORT": "8089"}, lambda c: c.service.http_port == 8100),
    ],
)
def test_variables_set_config_keys(monkeypatch, config_file, env, check):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(config_file)
    assert check(cfg)


def test_a_variable_overrides_the_file(monkeypatch, config_file):
    assert load_config(config_file).service.http_port == 8100
    monkeypatch.setenv("EDGERUN_SERVICE_HTTP_PORT", "8200")
    assert load_config(config_file).service.http_port == 8200


NO_KEY = "names no config key (EDGERUN_<SECTION>_<KEY>, e.g. EDGERUN_SINKS_MQTT_HOST)"


@pytest.mark.parametrize(
    ("var", "value", "detail"),
    [
        ("EDGERUN_SERVICE_HTTP_PORT", "70000", "service.http_port: expected int <= 65535, got 70000"),
        ("EDGERUN_SERVICE_HTTP_PORT", "eighty", "service.http_port: expected int, got 'eighty'"),
        ("EDGERUN_SINKS_MQTT_ENABLED", "maybe", "sinks.mqtt.enabled: expected bool, got 'maybe'"),
        (
            "EDGERUN_PIPELINE_POLICY",
            "fast",
            "pipeline.policy: expected one of 'drop_oldest', 'drop_newest', 'block', got 'fast'",
        ),
        ("EDGERUN_ENGINE_ORDER", "tpu", "engine.order[0]: expected one of edgetpu, onnx, tensorrt, tflite, got 'tpu'"),
        ("EDGERUN_SINKS_MQTT_HOTS", "x", NO_KEY),
        ("EDGERUN_SINKS_MQTT", "x", NO_KEY),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(monkeypatch, config_file, var, value, detail):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_config(config_file)
    assert str(info.value) == f"{var}: {detail}"


def test_file_errors_still_name_the_file(monkeypatch, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[pipeline]\nqueue_depth = 0\n")
    monkeypatch.setenv("EDGERUN_SERVICE_HTTP_PORT", "9000")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: pipeline.queue_depth: expected int >= 1, got 0"


def test_overlay_does_not_change_the_parsed_file():
    data = {"sinks": {"mqtt": {"host": "a"}}}
    overlay = overlay_env(data, {"EDGERUN_SINKS_MQTT_HOST": "b"})
    assert overlay.data["sinks"]["mqtt"]["host"] == "b" and data["sinks"]["mqtt"]["host"] == "a"
    assert overlay.variables == {"sinks.mqtt.host": "EDGERUN_SINKS_MQTT_HOST"}


def test_run_exits_2_with_one_line(config_file):
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(config_file)],
        env={"PATH": "/usr/bin:/bin", "EDGERUN_SERVICE_HTTP_PORT": "70000"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    detail = "service.http_port: expected int <= 65535, got 70000"
    assert proc.stderr == f"edgerun: error: EDGERUN_SERVICE_HTTP_PORT: {detail}\n"

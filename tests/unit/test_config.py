from __future__ import annotations

import subprocess
import sys

import pytest

from edgerun.config import load_config, parse_config
from edgerun.errors import ConfigError


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pipeline": {"queue_depth": 0}}, "pipeline.queue_depth: expected int >= 1, got 0"),
        ({"pipeline": {"queue_depth": "2"}}, "pipeline.queue_depth: expected int, got '2'"),
        (
            {"pipeline": {"policy": "fast"}},
            "pipeline.policy: expected one of 'drop_oldest', 'drop_newest', 'block', got 'fast'",
        ),
        ({"pipeline": {"queue": 1}}, "pipeline.queue: unknown key"),
        ({"colour": 1}, "colour: unknown key"),
        ({"pipeline": 3}, "pipeline: expected table, got 3"),
        ({"sinks": {"mqtt": {"port": 70000}}}, "sinks.mqtt.port: expected int <= 65535, got 70000"),
        (
            {"engine": {"order": ["tflite", "tpu"]}},
            "engine.order[1]: expected one of edgetpu, onnx, tensorrt, tflite, got 'tpu'",
        ),
        ({"source": {"kind": "opencv"}}, "source.uri: required when source.kind is 'opencv' (or source.pipeline)"),
        (
            {"source": {"kind": "opencv", "uri": "0", "pipeline": "v4l2src ! appsink"}},
            "source.pipeline: give source.uri or source.pipeline, not both",
        ),
        ({"source": {"transport": "quic"}}, "source.transport: expected one of 'tcp', 'udp', 'auto', got 'quic'"),
        ({"source": {"open_timeout_s": 0}}, "source.open_timeout_s: expected float > 0.0, got 0"),
        ({"source": {"replay": {"hfov_deg": 200.0}}}, "source.replay.hfov_deg: expected float < 170.0, got 200.0"),
        ({"sinks": {"mqtt": {"tls_cert": "c.pem"}}}, "sinks.mqtt.tls_key: tls_cert and tls_key must be given together"),
    ],
)
def test_errors_name_the_key_path(data, message):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == message


def test_defaults_work_without_a_file():
    cfg = parse_config({})
    assert cfg.pipeline.queue_depth == 1
    assert cfg.pipeline.policy == "drop_oldest"
    assert cfg.service.http_host == "127.0.0.1"
    assert cfg.engine.order == ["tflite"]
    assert cfg.node_id  # falls back to the host name


def test_example_config_documents_every_key_and_loads():
    from pathlib import Path

    import msgspec
    import tomllib

    from edgerun.config import Config

    path = Path(__file__).resolve().parents[2] / "deploy" / "node.example.toml"
    cfg = load_config(path)
    assert cfg == parse_config({})  # the example shows the defaults
    example = tomllib.loads(path.read_text())
    full = msgspec.to_builtins(Config())

    def keys(table, prefix="", unset=False):
        out = set()
        for k, v in table.items():
            if isinstance(v, dict):
                out |= keys(v, prefix + k + ".", unset)
            if (v is None) == unset:
                out.add(prefix + k)
        return out

    missing = keys(full) - keys(example)
    assert not missing, f"keys not documented in node.example.toml: {sorted(missing)}"
    # Unset by default (TOML has no null): shown as a commented-out line.
    text = path.read_text()
    for key in keys(full, unset=True):
        assert f"# {key.rsplit('.', 1)[1]} = " in text, f"{key} is not shown commented out in node.example.toml"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[pipeline\nqueue_depth = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[pipeline]\nqueue_depth = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(wrong)
    assert str(info.value) == f"{wrong}: pipeline.queue_depth: expected int >= 1, got 0"


def test_cli_prints_one_line_and_exits_2(tmp_path):
    wrong = tmp_path / "node.toml"
    wrong.write_text("[pipeline]\nqueue_depth = 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(wrong)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"edgerun: error: {wrong}: pipeline.queue_depth: expected int >= 1, got 0"
    ]
    assert "Traceback" not in proc.stderr


# Any key the TOML parser accepts is named as TOML spells it: bare when it can be, else quoted with
# escapes, so a newline, quote, dot, backtick, control or non-ASCII character cannot break the line.
@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"node": {"a\nb": False}}, 'node."a\\nb": unknown key'),
        ({"node": {'say "hi"\\': 1}}, 'node."say \\"hi\\"\\\\": unknown key'),
        ({"node": {"a.b": 1}}, 'node."a.b": unknown key'),
        ({"node": {"\x00\t\x1b\x7f": 1}}, 'node."\\u0000\\t\\u001B\\u007F": unknown key'),
        ({"nöde\u2028": {}}, '"n\\u00F6de\\u2028": unknown key'),
        ({"": 1}, '"": unknown key'),
        ({"pipeline": {"": 1}}, 'pipeline."": unknown key'),
        ({"😀": 1}, '"\\U0001F600": unknown key'),
        # msgspec's own text reads as an error at $.node for both: the tables say where the key is.
        ({"a` - at `$.node": 1}, '"a` - at `$.node": unknown key'),
        ({"node": {"a` - at `$.node": 1}}, 'node."a` - at `$.node": unknown key'),
        (
            {"node": {"log_level": "a\nb"}},
            "node.log_level: expected one of 'debug', 'info', 'warning', 'error', got 'a\\nb'",
        ),
    ],
)
def test_odd_keys_are_named_safely_on_one_line(data, message):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == message
    assert str(info.value).isprintable()


def test_cli_odd_key_is_one_line_and_exits_2(tmp_path):
    """A fresh clone's property test found this: a key with a newline was an AssertionError traceback, exit 1."""
    odd = tmp_path / "x.toml"
    odd.write_bytes(b'[node]\n"a\\nb" = false\n')
    proc = subprocess.run(
        [sys.executable, "-m", "edgerun", "run", "-c", str(odd)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f'edgerun: error: {odd}: node."a\\nb": unknown key']
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("engine", "policy", "fallback", "want"),
    [
        ({}, "drop_oldest", False, (4, 1)),  # live camera: one interpreter on every core, lowest latency
        ({}, "block", False, (1, 4)),  # offline: a single-threaded replica per core, most frames per second
        ({}, "drop_oldest", True, (1, 4)),  # CPU fallback behind an accelerator: replicas
        ({"num_threads": 2}, "block", False, (2, 2)),
        ({"num_threads": 2}, "drop_oldest", False, (2, 1)),
        ({"replicas": 2}, "drop_oldest", False, (2, 2)),
        ({"num_threads": 3, "replicas": 3}, "block", True, (3, 3)),  # explicit settings win
    ],
)
def test_cpu_engine_layout(monkeypatch, engine, policy, fallback, want):
    from edgerun.engines.factory import cpu_engine_layout

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cfg = parse_config({"engine": engine, "pipeline": {"policy": policy}})
    assert cpu_engine_layout(cfg, fallback=fallback) == want

"""``edgerun station`` and ``edgerun fleet``: bad options are one line and exit 2, before anything starts."""

from __future__ import annotations

import json
import re

import pytest

from edgerun.cli import main
from edgerun.commands.options import parse_hostport
from edgerun.commands.station import load_truth, prepare_ground


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["station", "--mqtt", "127.0.0.1:99999"], "--mqtt: expected HOST:PORT, got '127.0.0.1:99999'"),
        (["station", "--mqtt", "127.0.0.1:1883", "--bind", "x:y"], "--bind: expected HOST:PORT, got 'x:y'"),
        (["station", "--mqtt", "h:1", "--node-http", "drone-1"], "--node-http: expected NODE=HOST:PORT"),
        (["station", "--mqtt", "h:1", "--ground", "/nonexistent.png"], "--ground /nonexistent.png: no such file"),
        (["station", "--mqtt", "h:1", "--ground-extent", "0,0,-1,5"], "--ground-extent: expected WEST,SOUTH,EAST,N"),
        (["station", "--mqtt", "h:1", "--signing-key", "/nonexistent.key"], "--signing-key: /nonexistent.key"),
        (["fleet", "promote", "--percent", "0", "--signing-key", "k"], "--percent: expected within (0, 100], got 0"),
        (["station"], "--mqtt HOST:PORT: say where the fleet's broker is"),
        (["station", "--mqtt", "h:1", "--db-max-mb", "0"], "--db-max-mb: must be positive, got 0"),
        (["station", "--mqtt", "h:1", "--db-max-age-days", "-1"], "--db-max-age-days: must be positive, got -1"),
        (
            ["station", "--mqtt", "127.0.0.1:1", "--bind", "127.0.0.1:0", "--db", "mysql://db/mission"],
            "--db mysql://db/mission: expected a SQLite file path or a postgresql:// URL",
        ),
        (["fleet", "retire", "a/b"], "NODE: 'a/b' is not a node id"),
        (
            ["station", "--mqtt", "h:1", "--bind", "[::]:8080"],
            "binding :: needs --users FILE (edgerun station passwd) or --public-view for a read-only page",
        ),
        (["station", "--mqtt", "h:1", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["station", "--mqtt", "h:1", "--node-net", "drones"], "--node-net: expected an address range"),
        (["station", "--mqtt", "h:1", "--snapshot-token-file", "/nonexistent"], "--snapshot-token-file /nonexistent:"),
        (
            ["station", "--mqtt", "127.0.0.1:1", "--bind", "127.0.0.1:0", "--users", "/nonexistent"],
            "--users /nonexistent: No such file",
        ),
        (
            [
                "station",
                "--mqtt",
                "127.0.0.1:1",
                "--bind",
                "127.0.0.1:0",
                "--tls-cert",
                "/nonexistent",
                "--tls-key",
                "k",
            ],
            "--tls-cert/--tls-key: No such file or directory: /nonexistent",
        ),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgerun: error: ") and message in err and err.count("\n") == 1


def test_truth_file_is_checked_item_by_item(tmp_path):
    good = tmp_path / "truth.json"
    good.write_text(json.dumps({"objects": [{"label": "face", "box_m": [1, 2, 3, 4]}]}))
    assert load_truth(str(good)) == [{"label": "face", "box_m": [1.0, 2.0, 3.0, 4.0]}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"label": "face", "box_m": [1, 2, 3]}]))
    with pytest.raises(Exception, match=r"objects\[0\]: expected"):
        load_truth(str(bad))
    scene = load_truth("replay:1")
    assert scene and all(0 <= t["box_m"][0] < t["box_m"][2] <= 40 for t in scene)


def test_hostport_and_ground_defaults(tmp_path):
    assert parse_hostport("broker", "--mqtt", 1883) == ("broker", 1883)
    assert parse_hostport("[::1]:8080", "--bind", 80) == ("::1", 8080)
    image = tmp_path / "g.png"
    image.write_bytes(b"\x89PNG")
    assert prepare_ground(str(image), "-10,-10,30,30", tmp_path) == (image, (-10.0, -10.0, 30.0, 30.0))
    assert prepare_ground(None, None, tmp_path) == (None, (0.0, 0.0, 40.0, 40.0))


def test_one_hostport_parser_keeps_each_callers_error():
    from edgerun.errors import ConfigError, EdgerunError
    from edgerun.fleet.service import parse_hostport as swarm_address
    from edgerun.listen import parse_host_port

    assert parse_hostport(":1883", "--mqtt", 1883) == ("127.0.0.1", 1883)
    assert parse_host_port("broker") == ("broker", 1883)
    with pytest.raises(EdgerunError, match="listen: --mqtt: port must be 1..65535, got 0") as listen_err:
        parse_host_port("broker:0")
    assert not isinstance(listen_err.value, ConfigError)  # listen exits 1, not the config error's 2
    assert swarm_address("[::1]:7946", "swarm.bind") == ("::1", 7946)
    for text in ("node-2", ":7946", "node-2:x", "node-2:+7946"):  # a swarm address names both host and port
        with pytest.raises(ConfigError, match=re.escape(f"swarm.seeds[0]: expected HOST:PORT, got '{text}'")):
            swarm_address(text, "swarm.seeds[0]")

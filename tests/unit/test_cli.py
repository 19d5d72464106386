"""The ``edgerun`` command line as a person meets it: verbosity in either position, help for every option.

The parser tests walk the real argparse tree that ``edgerun`` builds; the verbosity tests run real processes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.cli import build_parser, main, subcommand_parsers
from edgerun.commands.options import log_level
from edgerun.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    top = build_parser()
    return [(top.prog, top)] + [(p.prog, p) for p in subcommand_parsers(top)]


# -- verbosity ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "default", "expected"),
    [
        (["doctor"], "warning", "warning"),
        (["-v", "doctor"], "warning", "info"),
        (["doctor", "-v"], "warning", "info"),
        (["-v", "doctor", "-v"], "warning", "debug"),  # counted in both positions
        (["doctor", "-vvv"], "warning", "debug"),  # no further than debug
        (["-q", "doctor"], "info", "warning"),
        (["doctor", "--quiet", "--quiet"], "info", "error"),
        (["--log-level", "debug", "doctor"], "warning", "debug"),
        (["doctor", "--log-level", "error"], "warning", "error"),
        (["--log-level", "debug", "doctor", "--log-level", "error"], "warning", "error"),  # the later one wins
        (["-q", "doctor", "--log-level", "info"], "warning", "info"),  # the level named beats -q
        (["ota", "keygen", "-v", "-p", "k.pub", "-s", "k.key"], "warning", "info"),  # nested subcommands take it too
    ],
)
def test_log_level_is_taken_before_and_after_the_subcommand(argv: list[str], default: str, expected: str) -> None:
    assert log_level(build_parser().parse_args(argv), default) == expected


def station_stderr(before: list[str], after: list[str]) -> str:
    """A station against a closed port for one second: it warns that it cannot reach the broker, then fails."""
    command = ["station", "--mqtt", f"127.0.0.1:{free_port()}", "--bind", "127.0.0.1:0", "--seconds", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "edgerun", *before, *command, *after],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 1, done.stderr
    return done.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("position", ["before", "after"])
def test_quiet_drops_the_warnings_but_not_the_error(position: str) -> None:
    assert " WARNING edgerun.station.subscriber: station: cannot reach " in station_stderr([], [])
    quiet = station_stderr(["-qq"], []) if position == "before" else station_stderr([], ["-qq"])
    assert "WARNING" not in quiet
    assert quiet.strip().splitlines()[-1].startswith("edgerun: error: station: never connected: cannot reach")


# -- help --------------------------------------------------------------------------------------


def test_every_option_has_a_help_text() -> None:
    missing = [
        f"{prog} {'/'.join(action.option_strings)}"
        for prog, parser in every_parser()
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS and not (action.help or "").strip()
    ]
    assert missing == []


def help_of(*command: str) -> str:
    parser = build_parser()
    for name in command:
        parser = next(p for p in subcommand_parsers(parser) if p.prog.endswith(f" {name}"))
    return " ".join(parser.format_help().split())  # one line: argparse wraps at the terminal's width


def test_help_shows_defaults_that_tell_something() -> None:
    assert "--seconds SECONDS fly the scene this long, then print the summary (default: 20.0)" in help_of("demo")
    assert "--percent PERCENT share of the fleet that takes the release (default: 100.0)" in help_of("ota", "publish")
    assert "(default: None)" not in help_of("ota", "publish")  # an unset option says nothing
    assert "(default: False)" not in help_of("doctor")


@pytest.mark.parametrize(
    ("old", "new", "dest", "value"),
    [
        (["ota", "keygen", "-p", "k.pub", "--seckey", "k.key", "-f"], ["--seckey", "-f"], "force", True),
        (["ota", "keygen", "-p", "k.pub", "--seckey", "k.key"], ["--seckey"], "signing_key", "k.key"),
        (["ota", "sign", "--seckey", "k.key", "-m", "f"], ["--seckey"], "signing_key", "k.key"),
        (["ota", "keys", "--release-key", "r", "--version", "1", "--output", "k.json"], ["--output"], "out", "k.json"),
        (["ota", "publish", "--bundle", "b", "--to", "d", "--rollout-percent", "5"], ["--rollout-"], "percent", 5.0),
        (["fleet", "objects", "--output", "o.kml"], ["--output"], "out", "o.kml"),
    ],
)
def test_old_spellings_still_work_and_help_hides_them(old: list[str], new: list[str], dest: str, value: object) -> None:
    """Documented scripts keep working; help shows one spelling per idea (--force, --signing-key, --percent, --out)."""
    assert getattr(build_parser().parse_args(old), dest) == value
    shown = help_of(*old[:2])
    for spelling in new:
        assert f"{spelling} " not in shown and f"{spelling}," not in shown, shown


def test_a_required_option_given_by_neither_spelling_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ota", "sign", "-m", "file"])
    assert exited.value.code == 2
    assert "edgerun ota sign: error: the following arguments are required: -s/--signing-key" in capsys.readouterr().err

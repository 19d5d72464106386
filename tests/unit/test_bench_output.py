"""Where ``edgerun bench`` puts its result: -o FILE gets the JSON and stdout a table, --json puts the JSON on
stdout, and the old ``--json FILE`` still writes the file (the Makefile and docs typed it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgerun.bench.pipeline import emit_result, format_table
from edgerun.cli import build_parser
from edgerun.commands.bench import cmd_bench

RESULT = {"model": "m", "bare_invoke_fps": 12.5, "rounds": {"bare": [12.0, 13.0]}}


def _args(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["bench", *argv])
    args.json_stdout = args.json_file is True  # as cmd_bench sets it
    return args


def test_out_file_gets_json_and_stdout_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    emit_result(RESULT, _args("-o", str(out)), summary=format_table([RESULT]))
    assert json.loads(out.read_text()) == RESULT
    printed = capsys.readouterr()
    assert printed.out.startswith("| model |") and "12.5" in printed.out
    assert '"rounds"' not in printed.out, "the JSON is not printed a second time"
    assert str(out) in printed.err


def test_json_switch_prints_json_beside_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    emit_result(RESULT, _args("--json", "-o", str(out)), summary="table")
    assert json.loads(capsys.readouterr().out) == RESULT
    assert json.loads(out.read_text()) == RESULT


def test_old_json_file_spelling_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "old.json"
    emit_result(RESULT, _args("--json", str(out)), summary="TABLE")
    assert json.loads(out.read_text()) == RESULT
    assert capsys.readouterr().out.strip() == "TABLE"


def test_no_destination_prints_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    emit_result(RESULT, _args(), summary="TABLE")
    assert json.loads(capsys.readouterr().out) == RESULT


def test_table_of_result_files_through_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    out.write_text(json.dumps(RESULT))
    assert cmd_bench(build_parser().parse_args(["bench", "--table", str(out)])) == 0
    assert "| m | 12.5 |" in capsys.readouterr().out

"""``edgerun bench --offload-codec`` in its short form: real photos, real models, numbers that hold together."""

from __future__ import annotations

import json

from edgerun.bench.offload_codec import CODECS, MODELS, PHOTOS, run_offload_codec_bench
from edgerun.cli import build_parser
from edgerun.commands.bench import cmd_bench


def test_every_model_photo_and_codec_is_measured_and_consistent():
    result = run_offload_codec_bench(repeats=1)
    rows = result["rows"]
    assert len(rows) == len(MODELS) * len(PHOTOS) * len(CODECS)
    by = {(r["model"], r["photo"], r["codec"]): r for r in rows}
    inputs = {r["model"]: r["input"] for r in rows}
    assert inputs == {"blazeface_short": "128x128", "pose_detector": "224x224"}
    for model in MODELS:
        for photo in PHOTOS:
            jpeg, raw, floats = (by[(model, photo, name)] for name in CODECS)
            # The sealed frame adds the request and envelope to the payload, and nothing else.
            for row in (jpeg, raw, floats):
                assert 0 < row["bytes"] < row["frame_bytes"] < row["bytes"] + 200
                assert row["encode_ms"] > 0 and row["decode_ms"] > 0
            # zstd is exact: the model finds exactly what it finds on the image itself.
            assert raw["max_box_shift"] == 0.0 and raw["detections"] == raw["detections_exact"]
            assert floats["raw_bytes"] == 4 * raw["raw_bytes"]
            assert jpeg["bytes"] < raw["bytes"] < raw["raw_bytes"]
            assert raw["bytes"] < floats["bytes"]
    # Whole round trips through a real client and server on loopback, for both wire codecs.
    assert [hop["input"] for hop in result["hop_loopback"]] == ["128x128", "224x224"]
    for hop in result["hop_loopback"]:
        assert 0 < hop["jpeg_ms_p50"] <= hop["jpeg_ms_p90"] and 0 < hop["zstd_ms_p50"] <= hop["zstd_ms_p90"]


def test_the_bench_command_writes_its_json(tmp_path, capsys):
    out = tmp_path / "codec.json"
    args = build_parser().parse_args(["bench", "--offload-codec", "--seconds", "1", "-o", str(out)])
    assert cmd_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "offload_codec" and result["repeats"] == 5
    assert set(result["summary"]) == {f"{m}/{c}" for m in MODELS for c in CODECS}
    assert "blazeface_short/jpeg" in capsys.readouterr().out  # the table a person reads

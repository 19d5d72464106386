"""``edgerun demo`` end to end: the replayed flight, scored, published locally over every sink."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_publishes_locally_and_scores_itself(tmp_path, blazeface_bundle):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgerun",
            "demo",
            "--drones",
            "1",
            "--seconds",
            "4",
            "--out",
            str(out),
            "--local-broker",
            "--dds",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("frames", "fps", "latency_p50_ms", "latency_p99_ms", "detections", "dropped", "recall"):
        assert key in summary
    assert summary["frames"] > 20 and summary["detections"] > 0
    assert summary["recall"] is not None and summary["recall"] >= 0.9
    lines = [json.loads(x) for x in (out / "detections.jsonl").read_text().splitlines()]
    batches = [x for x in lines if x["schema"] == "edgerun.detections/1"]
    assert len(batches) == summary["frames"]
    # Listeners in other processes received what the node published over MQTT and DDS.
    received = summary["received"]
    assert received["mqtt"] >= summary["frames"] - 2 and received["dds"] >= summary["frames"] - 2
    assert (out / "snapshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recall 1.000" in proc.stdout or "recall 0.9" in proc.stdout


def test_swarm_demo_flies_three_drones_and_reports_each_face_once(tmp_path, blazeface_bundle):
    """The default ``make demo``: three node processes gossiping, publishing to a private broker and DDS."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgerun",
            "demo",
            "--seconds",
            "14",
            "--out",
            str(out),
            "--local-broker",
            "--dds",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drones"] == 3 and set(summary["per_drone"]) == {"drone-1", "drone-2", "drone-3"}
    assert all(d["frames"] > 20 and d["recall"] >= 0.9 for d in summary["per_drone"].values()), summary
    assert summary["objects_seen"] >= 2 and summary["object_recall"] >= 0.9, summary
    assert summary["duplicate_reports"] == 0, summary
    assert summary["fleet_objects"] >= summary["objects_found"]
    assert all(code == 0 for code in summary["exit_codes"].values())
    # The listeners in other processes heard all three drones over MQTT and DDS.
    received = summary["received"]
    frames = summary["frames"]
    assert received["mqtt"] >= frames - 6 and received["dds"] >= frames - 6, (received, frames)
    assert (out / "snapshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "duplicate reports" in proc.stdout
    # Every fleet object is a place on Earth near the face it stands for (the scene's anchor is real lat/lon).
    located = summary["located"]
    assert len(located) == summary["fleet_objects"], summary
    for obj in located:
        assert 53.0 < obj["lat"] < 53.2 and -4.2 < obj["lon"] < -4.0, obj
        assert obj["truth_distance_m"] <= 3.0, obj
        assert f"{obj['lat']:.7f}, {obj['lon']:.7f}" in proc.stdout

"""Scoring a recorded HIL run, and the report drawn from it.

The recorded run is written here by hand, field for field what the runner and the observer write
(``run.json``, observation rows), over the real replayed scene: which faces a node had in view comes
from the scene's geometry at each batch's frame number, as in a real run.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from edgerun.config import parse_config
from edgerun.sources.replay import ReplaySource
from hil.report import write_report
from hil.scenario import parse_scenario
from hil.scoring import score_records

T0 = 1_000_000.0
REPLAY = {"seed": 1, "width": 640, "height": 480, "path_offset_m": 0.0, "east_offset_m": 0.0}


def scenario(**criteria):
    return parse_scenario(
        {
            "name": "rec",
            "duration_s": 40,
            "nodes": [{"id": "a"}, {"id": "b"}],
            "criteria": {"max_unexpected_exits": 0, **criteria},
        }
    )


def batch(node, seq, t, *, engine="tflite", version=1, latency_s=0.05):
    payload = {
        "schema": "edgerun.detections/1",
        "node": node,
        "seq": seq,
        "ts": t - latency_s,
        "frame": {"width": 640, "height": 480, "source": "replay"},
        "model": {"name": "blazeface_short", "version": version, "engine": engine},
        "latency_ms": 10.0,
        "detections": [],
    }
    return {"t": t, "topic": f"edgerun/{node}/detections", "payload": payload}


def fleet_object(oid, east, north, owner="a", t=T0 + 5):
    return {
        "t": t,
        "topic": "edgerun/fleet/objects",
        "payload": {
            "schema": "edgerun.object/1",
            "id": oid,
            "label": "face",
            "east_m": east,
            "north_m": north,
            "owner": owner,
        },
    }


@pytest.fixture(scope="module")
def truth():
    source = ReplaySource(parse_config({"source": {"kind": "replay", "replay": REPLAY}}).source.replay)
    source.open()
    points = source.scene.ground_points
    source.close()
    return points


def recorded(truth, *, silence_b=(0, 0), objects=None, faults=(), b_engine=lambda t: "tflite", b_version=lambda t: 1):
    """Node a publishes frames 0..199 at 5 fps (four faces come into view); b likewise, except a gap."""
    rows = []
    for seq in range(200):
        t = T0 + seq * 0.2
        rows.append(batch("a", seq, t))
        if not silence_b[0] <= seq * 0.2 < silence_b[1]:
            rows.append(batch("b", seq, t, engine=b_engine(t), version=b_version(t)))
    rows += objects if objects is not None else [fleet_object("o12", *truth[12]), fleet_object("o13", *truth[13])]
    nodes = {
        n: {
            "replay": REPLAY,
            "starts": [T0 - 5],
            "exits": [{"t": T0 + 40.5, "code": 0, "expected": True, "why": "stopped at the end of the run"}],
        }
        for n in ("a", "b")
    }
    run = {"scenario": "rec", "t0": T0, "t_end": T0 + 40, "mode": "netns", "nodes": nodes, "faults": list(faults)}
    return run, rows


def test_recall_duplicates_and_a_clean_run_pass(truth):
    run, rows = recorded(truth)
    result = score_records(
        run, rows, scenario(min_object_recall=0.5, max_duplicate_ratio=0.05, max_outage_s=2), local={}
    )
    fleet = result["fleet"]
    assert fleet["objects_seen"] == 4 and {12, 13, 14} <= set(fleet["seen_truth"])  # in view in frames 0..199
    assert fleet["objects_found"] == 2 and fleet["object_recall"] == 0.5
    assert fleet["duplicate_reports"] == 0
    assert result["per_node"]["a"]["latency_p50_ms"] == pytest.approx(50.0, abs=0.5)
    assert result["verdict"]["passed"], result["verdict"]["line"]
    assert result["verdict"]["line"].startswith("PASS rec")


def test_a_second_report_of_one_target_is_a_duplicate_and_fails_by_how_much(truth):
    east, north = truth[12]
    objects = [
        fleet_object("o12", east, north),
        fleet_object("o12b", east + 0.5, north, owner="b"),
        fleet_object("o13", *truth[13]),
    ]
    run, rows = recorded(truth, objects=objects)
    result = score_records(run, rows, scenario(max_duplicate_ratio=0.05), local={})
    assert result["fleet"]["duplicate_reports"] == 1 and result["fleet"]["duplicate_ratio"] == 0.5
    assert not result["verdict"]["passed"]
    assert "duplicate_ratio 0.5 vs limit 0.05 (missed by 0.45)" in result["verdict"]["line"]


def test_a_silence_the_faults_do_not_explain_fails_and_a_broker_restart_explains_it(truth):
    run, rows = recorded(truth, silence_b=(10, 18))
    result = score_records(run, rows, scenario(max_outage_s=5), local={})
    b = result["per_node"]["b"]
    assert b["max_outage_s"] == pytest.approx(8.2, abs=0.3) and b["max_outage_at_s"] == pytest.approx(9.8, abs=0.3)
    assert re.search(r"max_outage_s \(b\) 8\.\d+ s vs limit 5 s \(missed by 3\.\d+ s\)", result["verdict"]["line"])

    broker = {
        "index": 0,
        "kind": "broker_restart",
        "at_s": 9.5,
        "node": "",
        "t_start": T0 + 9.5,
        "t_end": T0 + 16.5,
        "happened": True,
        "injectable": True,
        "detail": "",
    }
    run, rows = recorded(truth, silence_b=(10, 18), faults=[broker])
    result = score_records(run, rows, scenario(max_outage_s=5), local={})
    assert result["per_node"]["b"]["max_outage_s"] < 1.0
    assert result["verdict"]["passed"], result["verdict"]["line"]


def test_failover_time_and_ota_convergence(truth):
    hang = {
        "index": 0,
        "kind": "accelerator_hang",
        "at_s": 10,
        "node": "b",
        "t_start": T0 + 10,
        "t_end": T0 + 20,
        "happened": True,
        "injectable": True,
        "detail": "",
    }
    release = {
        "index": 1,
        "kind": "ota_release",
        "at_s": 25,
        "node": "",
        "version": 2,
        "t_start": T0 + 25,
        "happened": True,
        "injectable": True,
        "detail": "",
    }
    run, rows = recorded(
        truth,
        faults=[hang, release],
        silence_b=(10, 11.2),
        # its CPU first, then a neighbour's engine (offload, #25) until the accelerator is back
        b_engine=lambda t: "tflite" if T0 + 10 <= t < T0 + 15 else "remote:a" if T0 + 15 <= t < T0 + 20 else "hilaccel",
        b_version=lambda t: 2 if t >= T0 + 31 else 1,
    )
    criteria = {"max_failover_s": 1.0, "max_ota_convergence_s": 30, "min_offloaded_after_failover": 30}
    result = score_records(run, rows, scenario(**criteria), local={})
    assert result["failovers"] == [
        {
            "node": "b",
            "fault": 0,
            "kind": "accelerator_hang",
            "failover_s": 1.2,
            # 11.2 s .. 20 s at 5 fps: 19 on its CPU, 25 from a, the one at 20 s on the accelerator again
            "during_fault": {"batches": 45, "offloaded": 25, "local": 20, "helpers": ["a"]},
            "first_offloaded_s": 5.0,
            "offloaded_before_fault": 0,
        }
    ]
    ota = result["ota"]
    assert ota["per_node_s"]["b"] == pytest.approx(6.0, abs=0.01) and ota["per_node_s"]["a"] is None
    assert ota["convergence_s"] is None  # node a never took v2
    line = result["verdict"]["line"]
    assert "failover_s b (fault 0) 1.2 s vs limit 1 s (missed by 0.2 s)" in line
    assert "batches a neighbour inferred for b during fault 0 25 vs limit 30 (missed by 5)" in line
    assert "ota_convergence_s: not measured" in line and "nodes not on the new model at the end 1" in line


def test_batches_lost_beyond_the_counted_drops_and_a_fault_that_did_not_happen(truth):
    run, rows = recorded(truth)
    ignored = {
        "index": 0,
        "kind": "camera_loss",
        "at_s": 5,
        "node": "a",
        "duration_s": 5,
        "t_start": T0 + 5,
        "happened": False,
        "injectable": True,
        "detail": "a kept publishing batches after its camera was taken away (ignored the command)",
    }
    run["faults"] = [ignored]
    observed = {(r["payload"]["seq"], r["payload"]["ts"]) for r in rows if r["payload"].get("node") == "a"}
    local_a = [r["payload"] for r in rows if r["payload"].get("node") == "a"]
    local_a += [{**local_a[-1], "seq": 500 + k, "ts": T0 + 30 + k} for k in range(3)]  # written, never delivered
    # ... and two captured while the observer itself was off the broker: not seen, but not counted as lost; the
    # broker went down at 19.9 s, the observer noticed at 20 s (a sar-5 run had a batch captured in between).
    local_a.append({**local_a[-1], "seq": 600, "ts": T0 + 20.5})
    local_a.append({**local_a[-1], "seq": 601, "ts": T0 + 19.95})
    run["faults"].append({"index": 1, "kind": "broker_restart", "at_s": 19.9, "duration_s": 2, "t_start": T0 + 19.9,
                          "t_end": T0 + 21.9, "happened": True, "injectable": True})  # fmt: skip
    rows = rows + [{"t": T0 + 20, "observer": "disconnected"}, {"t": T0 + 22, "observer": "connected"}]
    assert len(observed) == 200
    dropped = {'edgerun_sink_dropped_total{sink="mqtt"}': 1.0}
    scrapes = [{"t": T0 + 39, "scrape": "a", "ok": True, "metrics": dropped}]
    result = score_records(run, rows + scrapes, scenario(max_unaccounted_loss=0), local={"a": local_a, "b": []})
    loss = result["per_node"]["a"]["loss"]
    assert (loss["missing"], loss["counted_dropped"], loss["unaccounted"]) == (3, 1, 2)
    assert loss["observer_blind"] == 2 and loss["local"] == 205
    line = result["verdict"]["line"]
    assert "unaccounted_loss (batches) 2 vs limit 0" in line
    assert "fault 0 camera_loss a happened: no (a kept publishing batches after its camera was taken away" in line


def test_report_is_one_self_contained_page_with_every_plot(tmp_path, truth):
    release = {
        "index": 0,
        "kind": "ota_release",
        "at_s": 25,
        "node": "",
        "version": 2,
        "t_start": T0 + 25,
        "happened": True,
        "injectable": True,
        "detail": "",
    }
    run, rows = recorded(truth, faults=[release], b_version=lambda t: 2 if t >= T0 + 31 else 1)
    rows += [
        {
            "t": T0 + s,
            "scrape": n,
            "ok": True,
            "members": {"a": "alive", "b": "alive" if s < 20 else "suspect"},
            "metrics": {},
        }
        for s in range(40)
        for n in ("a", "b")
    ]
    sc = scenario(min_object_recall=0.9)
    result = score_records(run, rows, sc, local={})
    page = write_report(tmp_path, sc, result)
    text = page.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 5  # latency CDF, fps, map, membership, OTA versions
    assert all(base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n" for b64 in images)
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from a network
    assert "object_recall" in text and "FAIL rec" in text  # recall 2/4 < 0.9
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["verdict"] == result["verdict"]
    assert saved["series"]["alive_members"]["b"][-1] == [39.0, 1]
    assert saved["series"]["version"]["b"][-1][1] == 2


def test_faults_a_real_board_cannot_take_are_listed_not_failed(truth):
    from types import SimpleNamespace

    from hil.live import LiveView
    from hil.timeline import Timeline

    sc = parse_scenario(
        {
            "name": "bench",
            "duration_s": 40,
            "broker": {"address": "10.0.0.2:1883"},
            "nodes": [{"id": "a"}, {"id": "board", "address": "http://10.0.0.7:8089"}],
            "faults": [
                {"at_s": 5, "kind": "kill", "node": "board", "duration_s": 3},
                {"at_s": 6, "kind": "partition", "groups": [["a"], ["board"]], "duration_s": 3},
                {"at_s": 7, "kind": "broker_restart", "duration_s": 2},
                {"at_s": 8, "kind": "ota_release"},
            ],
        }
    )
    rig = SimpleNamespace(scenario=sc, lab=None, mode_reason="an external broker (real boards)", nodes={})
    timeline = Timeline(rig, LiveView(Path("/nonexistent")))  # type: ignore[arg-type]  # a rig of the fields read
    reasons = [(r.injectable, r.why_not) for r in timeline.records]
    assert reasons[0] == (
        False,
        "board is a real board: driven over MQTT and HTTP only (no control socket, no signals)",
    )
    assert reasons[1] == (False, "no network namespaces (an external broker (real boards))")
    assert reasons[2] == (False, "the broker is external (broker.address): the rig does not own it")
    assert reasons[3] == (True, "")  # an OTA release reaches a board over MQTT
    run, rows = recorded(truth)
    run["faults"] = [r.to_json() for r in timeline.records[:3]]
    result = score_records(run, rows, scenario(), local={})
    assert len(result["not_injectable"]) == 3
    assert result["not_injectable"][0] == (
        "kill at 5 s on board: board is a real board: driven over MQTT and HTTP only (no control socket, no signals)"
    )
    assert result["verdict"]["passed"], result["verdict"]["line"]


def test_an_interrupted_run_never_passes():
    from hil.scoring import verdict

    held = [{"name": "object_recall", "limit": 0.9, "value": 0.95, "passed": True, "missed_by": None, "unit": ""}]
    assert verdict(held, "sar-5")["passed"]
    cut = verdict(held, "sar-5", interrupted=True)
    assert not cut["passed"]
    assert cut["line"] == "FAIL sar-5 (interrupted: partial run): the 1 criteria held until it was cut short"


def truth_boxes(seq):
    """The true faces in view at frame ``seq`` and their boxes, as the scoring computes them (15 fps)."""
    cfg = parse_config({"source": {"kind": "replay", "fps": 15.0, "replay": REPLAY}}).source
    source = ReplaySource(cfg.replay, fps=cfg.fps)
    source.open()
    try:
        ids, boxes = source.visible(source.pose_at(seq), 640, 480)
    finally:
        source.close()
    return dict(zip(ids.tolist(), boxes.tolist()))


def test_faces_never_reported_are_split_into_detector_misses_and_dedup_losses(truth):
    run, rows = recorded(truth)
    seen = {}
    for seq in range(200):
        for face, box in truth_boxes(seq).items():
            if face not in (12, 13) and box[3] - box[1] >= 40:
                seen.setdefault(face, []).append((seq, box))
    lost, killed = sorted(seen)[:2]  # four faces in view, two reported: a detects one of the other two, b the other
    for node, face in (("a", lost), ("b", killed)):
        seq, box = seen[face][0]
        row = next(r for r in rows if r["payload"].get("node") == node and r["payload"].get("seq") == seq)
        row["payload"]["detections"] = [{"label": "face", "score": 0.9, "box": box}]
    # b is SIGKILLed a second after its detection: it could not decide; a lived on and never reported its face.
    t_det = next(r["payload"]["ts"] for r in rows if r["payload"].get("node") == "b" and r["payload"]["detections"])
    run["nodes"]["b"]["exits"].insert(0, {"t": t_det + 1.0, "code": -9, "expected": True, "why": "kill fault"})
    result = score_records(run, rows, scenario(max_dedup_losses=0), local={})
    fleet = result["fleet"]
    assert fleet["never_detected"] == []
    causes = {e["truth"]: e["cause"] for e in fleet["detected_not_reported"]}
    assert causes == {lost: "dedup", killed: "its only finders died before deciding"}
    assert fleet["dedup_losses"] == 1 and fleet["decide_s"] == pytest.approx(1.5 + 2.0 + 0.2)  # node defaults
    check = next(c for c in result["criteria"] if c["name"].startswith("faces detected but not reported"))
    assert check["value"] == 1 and not check["passed"]
    # Without any detection, the two are the detector's misses: every frame they were in view, and how tall.
    run, rows = recorded(truth)
    fleet = score_records(run, rows, scenario(max_dedup_losses=0), local={})["fleet"]
    assert fleet["dedup_losses"] == 0 and fleet["detected_not_reported"] == []
    missed = {e["truth"]: e for e in fleet["never_detected"]}
    assert set(missed) == {lost, killed}
    first = missed[lost]["frames"][0]
    assert first["seq"] == seen[lost][0][0] and first["height_px"] == pytest.approx(
        seen[lost][0][1][3] - seen[lost][0][1][1], abs=0.1
    )
    assert missed[lost]["frames_in_view"] == 2 * len(seen[lost])  # both nodes fly the same path

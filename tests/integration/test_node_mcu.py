"""A node with an MCU on a serial port: the real C firmware (edgelink-sim on a pty) feeds the node's sinks."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.conftest import free_port
from tests.integration.brokers import wait_for
from tests.integration.test_mcu_sim import pytestmark, running_sim, sim_binary  # noqa: F401 - fixture

COUNT = 200


def test_mcu_detections_reach_the_nodes_sinks_and_metrics(sim_binary: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "detections.jsonl"
    http = free_port()
    args = ("--rate", "200", "--count", str(COUNT), "--baud", "921600", "--device-id", "0xBEEF")
    with running_sim(sim_binary, tmp_path / "flash", *args) as (_, port):
        cfg = tmp_path / "node.toml"
        cfg.write_text(
            f"""[node]
id = "node-with-mcu"
[source]
kind = "replay"
fps = 5
[sinks.jsonl]
path = "{out}"
[service]
http_port = {http}
[mcu]
enabled = true
port = "{port}"
labels = ["person", "vehicle", "animal"]
reconnect_s = 0.1
"""
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgerun", "run", "-c", str(cfg), "--seconds", "60"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

        def from_mcu() -> list[dict]:
            rows = []
            for line in out.read_text().splitlines() if out.exists() else []:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("schema") == "edgerun.detections/1" and row["frame"]["source"].startswith("mcu:"):
                    rows.append(row)
            return rows

        try:
            assert wait_for(lambda: sum(len(r["detections"]) for r in from_mcu()) >= COUNT, timeout=60), (
                proc.poll(),
                len(from_mcu()),
            )
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5) as resp:
                metrics = resp.read().decode()
        finally:
            proc.terminate()
            proc.wait(30)
    rows = from_mcu()
    assert {r["frame"]["source"] for r in rows} == {"mcu:0000beef"}
    assert {d["label"] for r in rows for d in r["detections"]} <= {"person", "vehicle", "animal"}
    assert f'edgerun_mcu_connected{{port="{port}"}} 1.0' in metrics
    frames = [line for line in metrics.splitlines() if line.startswith("edgerun_mcu_frames_total{")]
    assert frames and float(frames[0].split()[1]) >= COUNT
    # The camera's own batches still flow beside the MCU's.
    camera = [json.loads(x) for x in out.read_text().splitlines() if '"source":"replay' in x]
    assert camera and proc.returncode == 0

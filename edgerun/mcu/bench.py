"""MCU link benchmark: edgelink-sim on a pty, paced to a baud rate, into a real JSON Lines sink; writes JSON.

    python -m edgerun.mcu.bench --rates 200 1000 5000 --seconds 10 --baud 921600 --json bench-results/mcu.json

For each rate the sim generates ``rate * seconds`` detections; the report accounts for each one:
dropped by the MCU (transmit buffer full, in its heartbeat: ``mcu_sent + mcu_dropped == generated``),
lost on the wire (every frame the MCU numbered that never arrived whole is a sequence gap; the host
decoder also counts why it dropped each damaged frame), dropped by the sink's outbox, or written.
``unaccounted`` is the detections the MCU sent that neither arrived nor fall in a counted gap: it must
be 0. ``--corrupt-every N`` has the sim damage every Nth frame on the wire to show the counting works.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgerun.config import JsonlSinkConfig, McuConfig
from edgerun.mcu.bridge import McuBridge
from edgerun.sinks.jsonl import JsonlSink

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SIM = REPO / "firmware_mcu" / "build" / "edgelink-sim"


async def run_rate(
    sim: Path, rate: float, seconds: float, baud: int, workdir: Path, corrupt_every: int = 0
) -> dict[str, Any]:
    count = int(rate * seconds)
    out = workdir / f"mcu-{int(rate)}-{corrupt_every}.jsonl"
    sink = JsonlSink(JsonlSinkConfig(path=str(out), outbox=4096), "bench")
    await sink.start()
    proc = subprocess.Popen(
        [
            str(sim),
            "--storage",
            str(workdir / "flash"),
            "--slot-size",
            "65536",
            "--pty",
            "--rate",
            str(rate),
            "--count",
            str(count),
            "--baud",
            str(baud),
            "--corrupt-every",
            str(corrupt_every),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().split()[1]
        first: list[float] = []
        last: list[float] = []

        def submit(batch: Any) -> None:
            now = time.monotonic()
            if not first:
                first.append(now)
            last[:] = [now]
            sink.submit(batch, now)

        bridge = McuBridge(McuConfig(enabled=True, port=port, baud=baud), "bench", submit, release_keys=[])
        await bridge.start()
        deadline = time.monotonic() + seconds * 3 + 10
        while time.monotonic() < deadline:
            hb = bridge.link.heartbeat
            # Done when the MCU has reported every detection and its last report has arrived.
            if hb is not None and hb.detections_sent + hb.detections_dropped >= count:
                if bridge.detections + bridge.link.counters.lost >= hb.detections_sent:
                    break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        c = bridge.counters()
        await bridge.stop()
    finally:
        proc.terminate()
        proc.wait(5)
    await sink.close(5.0)
    written = sum(len(json.loads(line)["detections"]) for line in out.read_text().splitlines())
    elapsed = (last[0] - first[0]) if first and last else 0.0
    missing = c["mcu_detections_sent"] - c["detections"]
    return {
        "rate_requested_per_s": rate,
        "corrupt_every": corrupt_every,
        "detections_generated": count,
        "mcu_sent": c["mcu_detections_sent"],
        "mcu_dropped_tx_full": c["mcu_detections_dropped"],
        "host_received": c["detections"],
        "host_lost_frames_seq_gaps": c["lost_frames"],
        "host_dropped_frames": c["dropped_frames"],
        "sink_written": written,
        "sink_dropped_outbox": sink.stats.dropped,
        "mcu_accounted": c["mcu_detections_sent"] + c["mcu_detections_dropped"] == count,
        "sink_accounted": written + sink.stats.dropped == c["detections"],
        "unaccounted": max(0, missing - c["lost_frames"]),
        "received_per_s": round(c["detections"] / elapsed, 1) if elapsed > 0 else None,
        "wire_bytes_in": c["bytes_in"],
        "wire_bytes_per_s": round(c["bytes_in"] / elapsed, 1) if elapsed > 0 else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="edgerun-mcu-bench-") as tmp:
        for rate in args.rates:
            results.append(await run_rate(Path(args.sim), rate, args.seconds, args.baud, Path(tmp)))
        if args.corrupt_every:
            results.append(
                await run_rate(Path(args.sim), args.rates[0], args.seconds, args.baud, Path(tmp), args.corrupt_every)
            )
    return {
        "bench": "mcu_link",
        "baud": args.baud,
        "baud_limit_bytes_per_s": args.baud / 10,
        "seconds_per_rate": args.seconds,
        "transport": "pty, sim paces its output to the baud rate (8N1: 10 bits per byte)",
        "sink": "jsonl",
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgerun.mcu.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sim", default=str(DEFAULT_SIM), help="edgelink-sim binary (make -C firmware_mcu sim)")
    parser.add_argument("--rates", type=float, nargs="+", default=[200.0, 1000.0, 5000.0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--baud", type=int, default=921600)
    parser.add_argument(
        "--corrupt-every",
        type=int,
        default=100,
        help="one more run at the first rate with every Nth frame damaged (0: none)",
    )
    parser.add_argument("--json", default="", help="write the report here (default: stdout only)")
    args = parser.parse_args(argv)
    if not Path(args.sim).exists():
        print(f"{args.sim}: not built; run make -C firmware_mcu sim", file=sys.stderr)
        return 2
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    ok = all(r["unaccounted"] == 0 and r["mcu_accounted"] and r["sink_accounted"] for r in report["results"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the station's store costs: database growth per hour of the demo swarm's mission, and insert throughput.

* ``mission``: the demo's drones (``edgerun demo --drones N``: real node processes over the replayed
  scene, gossiping, reporting fleet objects) publish to a private mosquitto for ``--seconds``; a station
  (in this process, no page) keeps the mission in a fresh SQLite file. Reported: rows written per table,
  the stored bytes (what ``--db-max-mb`` bounds) and the SQLite file's used pages, each per hour of mission
  (growth over the window, scaled). Pictures are kept once per object (the latest), so they add at most
  64 KiB per object found, not per hour; ``image_bytes_per_object_max`` says so.
* ``insert``: batches of synthetic rows (object versions, events; 100 a batch, as a busy flush) written
  by ``StationStore.write`` into a fresh SQLite file (and a PostgreSQL database with ``--pg URL``):
  rows per second of the writer thread.

    python -m edgerun.bench.station_store --seconds 60 --json store.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgerun.station.store import Batch, StationStore


def _sizes(db: str) -> dict[str, Any]:
    store = StationStore(db)
    try:
        store.open()
        return {"counts": store.counts(), "stored_bytes": store.stored_bytes(), "file_bytes": store.file_bytes()}
    finally:
        store.close()


async def _station(db: str, mqtt_port: int, seconds: float) -> dict[str, Any]:
    from edgerun.station.station import Station, StationOptions

    station = Station(StationOptions(mqtt_port=mqtt_port, db=db, session_expiry_s=0))
    await station.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        await station.stop()
    return {"received": station.model.received, "dropped": dict(station.model.dropped)}


def mission(seconds: float, drones: int, work: Path) -> dict[str, Any]:
    from edgerun.demo_swarm import drone_configs, start_drones, stop_drones
    from edgerun.sinks.mosquitto import run_mosquitto

    db = str(work / "station.db")
    with run_mosquitto() as broker:
        (work / "drones").mkdir()
        fleet = drone_configs(work / "drones", drones, mqtt=f"127.0.0.1:{broker.port}")
        warmup = 15.0  # the nodes load their model and join the swarm before the window starts
        start_drones(fleet, seconds + warmup + 10.0)
        try:
            asyncio.run(_station(db, broker.port, warmup))
            before = _sizes(db)
            heard = asyncio.run(_station(db, broker.port, seconds))
            after = _sizes(db)
        finally:
            for drone in fleet:
                if drone.proc is not None and drone.proc.poll() is None:
                    drone.proc.terminate()
            stop_drones(fleet)
    per_hour = 3600.0 / seconds
    growth = {k: after["counts"][k] - before["counts"][k] for k in after["counts"]}
    return {
        "drones": drones,
        "window_s": seconds,
        "messages_received": heard["received"],
        "rows_written": growth,
        "rows_per_hour": {k: round(v * per_hour) for k, v in growth.items() if v},
        "stored_bytes_per_hour": round((after["stored_bytes"] - before["stored_bytes"]) * per_hour),
        "file_bytes_per_hour": round(((after["file_bytes"] or 0) - (before["file_bytes"] or 0)) * per_hour),
        "objects_found": after["counts"]["objects"],
        "image_bytes_per_object_max": 64 * 1024,
        "file_bytes_end": after["file_bytes"],
    }


def _rows(n: int, start: int) -> Batch:
    now = time.time()
    versions, events = [], []
    for i in range(start, start + n):
        oid = f"{i // 4:016x}"
        versions.append(
            {
                "id": oid,
                "label": "face",
                "east_m": 12.5,
                "north_m": 30.25,
                "lat": 53.117,
                "lon": -4.129,
                "alt_m": 100.0,
                "uncertainty_m": 0.5,
                "first_seen": now - 10,
                "last_seen": now + i,
                "score": 0.93,
                "owner": "drone-1",
                "seen_by": ["drone-1", "drone-2"],
                "seen_count": 2,
                "received": now + i,
            }
        )
        events.append(
            {
                "key": f"k{i}",
                "ts": now + i,
                "node": "drone-1",
                "kind": "health",
                "text": "health running",
                "level": "info",
            }
        )
    return Batch(object_versions=versions, events=events)


def insert(db: str, rows: int, batch: int = 100) -> dict[str, Any]:
    store = StationStore(db)
    store.open()
    try:
        batches = [_rows(batch, start) for start in range(0, rows, batch)]
        t0 = time.perf_counter()
        for b in batches:
            store.write(b)
        elapsed = time.perf_counter() - t0
    finally:
        store.close()
    written = 2 * rows  # a version and an event per row
    return {"rows": written, "batch": batch, "seconds": round(elapsed, 3), "rows_per_s": round(written / elapsed)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="the mission window measured")
    parser.add_argument("--drones", type=int, default=3, help="the demo's swarm size")
    parser.add_argument("--rows", type=int, default=20000, help="insert: synthetic rows of each kind")
    parser.add_argument("--pg", default=None, metavar="URL", help="insert: also into this PostgreSQL database")
    parser.add_argument("--skip-mission", action="store_true", help="insert throughput only")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="edgerun-bench-store-"))
    try:
        result: dict[str, Any] = {"bench": "station_store"}
        result["insert_sqlite"] = insert(str(work / "insert.db"), args.rows)
        if args.pg:
            result["insert_postgresql"] = insert(args.pg, args.rows)
        if not args.skip_mission:
            result["mission"] = mission(args.seconds, args.drones, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

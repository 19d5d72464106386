"""What the station's alerts cost the fleet model, measured in one run so the ratio compares across noisy machines.

Fleet object messages (``--objects`` objects, ``--versions`` reports of each, as their owners publish them) are
ingested by two models: one where every label alerts (the default) and one where no label does (the alert book
looks at the label and stops: the model without alert bookkeeping). Runs alternate, ``--runs`` of each; reported:
the median microseconds per object message of each, their ratio, the snapshot's ``alerts`` list in bytes (what
a page's first message carries more) and the cost of one acknowledgement in the model.

    python -m edgerun.bench.station_alerts --json alerts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from edgerun.station.model import FleetModel

T0 = 1_800_000_000.0


def _messages(objects: int, versions: int) -> list[bytes]:
    return [
        json.dumps(
            {
                "schema": "edgerun.object/2",
                "id": f"{i:016x}",
                "label": "person",
                "lat": 47.0 + i * 1e-5,
                "lon": 8.0,
                "first_seen": T0,
                "last_seen": T0 + v,
                "score": 0.5 + (v % 5) / 10,
                "owner": "drone-1",
                "seen_by": ["drone-1"],
            }
        ).encode()
        for v in range(versions)
        for i in range(objects)
    ]


def _ingest(messages: list[bytes], labels: frozenset[str] | None) -> tuple[float, FleetModel]:
    model = FleetModel(alert_labels=labels)
    start = time.perf_counter()
    for k, payload in enumerate(messages):
        model.ingest("edgerun/fleet/objects", payload, T0 + k)
    return (time.perf_counter() - start) / len(messages) * 1e6, model


def run(objects: int = 200, versions: int = 10, runs: int = 7) -> dict[str, Any]:
    messages = _messages(objects, versions)
    with_alerts, without = [], []
    model = FleetModel()
    for _ in range(runs):
        us, model = _ingest(messages, None)
        with_alerts.append(us)
        without.append(_ingest(messages, frozenset({"no such label"}))[0])
    start = time.perf_counter()
    for object_id in list(model.objects):
        model.ack(object_id, "operator:bench", T0 + 1e5)
    ack_us = (time.perf_counter() - start) / len(model.objects) * 1e6
    alerts = model.snapshot(T0 + 2e5)["alerts"]
    alerts_bytes = len(json.dumps(alerts, separators=(",", ":")))
    median_with, median_without = statistics.median(with_alerts), statistics.median(without)
    return {
        "objects": objects,
        "versions": versions,
        "runs": runs,
        "us_per_object_message_with_alerts": round(median_with, 2),
        "us_per_object_message_without_alerts": round(median_without, 2),
        "ratio": round(median_with / median_without, 3),
        "us_per_ack": round(ack_us, 2),
        "alerts": len(alerts),
        "acknowledged": sum(1 for a in alerts if a["acked_by"] == "operator:bench"),
        "snapshot_alerts_bytes": alerts_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=200)
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the result here too")
    args = parser.parse_args(argv)
    result = run(args.objects, args.versions, args.runs)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

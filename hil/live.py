"""What the runner knows of the fleet while a scenario runs, read from the observer's recording as it grows.

The fault checks ("did the failover happen?") and the progress line read this; the report reads the whole
recording afterwards (``hil.scoring``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgerun.testing.jsonl_reader import JsonlTail
from edgerun.wire import DETECTIONS_SCHEMA, OBJECT_SCHEMA, OBJECT_SCHEMA_V1


@dataclass
class NodeView:
    last_batch_t: float = 0.0  # receive wall time of its latest batch
    last_ts_offset: float | None = None  # its latest batch's capture stamp minus the receive time (clock skew)
    engine: str = ""
    version: int = 0
    batches: int = 0
    members: dict[str, str] = field(default_factory=dict)
    members_t: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)


class LiveView:
    def __init__(self, observations: Path) -> None:
        self._tail = JsonlTail(observations)
        self.nodes: dict[str, NodeView] = defaultdict(NodeView)
        self.objects: set[str] = set()
        self.observer_events: list[tuple[float, str]] = []  # (t, "connected" | "disconnected")

    def update(self) -> None:
        for row in self._tail.new_rows():
            t = float(row.get("t", 0.0))
            if "scrape" in row:
                if row.get("ok"):
                    view = self.nodes[row["scrape"]]
                    view.members, view.members_t = row.get("members") or {}, t
                    view.metrics = row.get("metrics") or {}
                continue
            if "observer" in row:
                self.observer_events.append((t, row["observer"]))
                continue
            payload = row.get("payload")
            if not isinstance(payload, dict):
                continue
            schema = payload.get("schema")
            if schema == DETECTIONS_SCHEMA:
                view = self.nodes[str(payload.get("node"))]
                view.last_batch_t = max(view.last_batch_t, t)
                view.batches += 1
                if isinstance(payload.get("ts"), (int, float)):
                    view.last_ts_offset = float(payload["ts"]) - t
                model = payload.get("model") or {}
                view.engine, view.version = str(model.get("engine", "")), int(model.get("version") or 0)
            elif schema in (OBJECT_SCHEMA, OBJECT_SCHEMA_V1):
                self.objects.add(str(payload.get("id")))
            elif str(row.get("topic", "")).endswith("/events"):
                self.nodes[str(payload.get("node"))].events.append({"t": t, **payload})

    def events_since(self, node: str, t: float, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.nodes[node].events if e["t"] >= t and e.get("kind") == kind]

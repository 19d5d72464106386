"""The run's observer: one process that records what an operator could see of the fleet, with receive times.

``python -m hil.observer --broker HOST:PORT --node NAME=URL ... --out observations.jsonl``

* an MQTT subscriber on the broker: every batch (``edgerun/+/detections``), event, fleet object, swarm
  view and status message, one JSON line each: ``{"t": receive wall time, "topic": ..., "payload": ...}``;
* once a second, each node's ``/metrics`` (every ``edgerun_*`` sample but histogram buckets) and
  ``/healthz`` (its swarm view: member -> state): ``{"t": ..., "scrape": node, "ok": ..., "metrics": ...,
  "members": ..., "state": ...}``.

It runs where it can reach the broker and the nodes: inside the broker's network namespace when the rig
uses namespaces, on the host otherwise (and for real boards). SIGTERM ends it cleanly.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from edgerun import wire
from edgerun.hostport import parse_hostport
from edgerun.mqtt_client import MQTT_CLEAN_START_FIRST_ONLY, connect_in_background, new_client

TOPICS = (
    wire.node_topic("+", "detections"),
    wire.node_topic("+", "events"),
    wire.FLEET_OBJECTS_TOPIC,
    wire.FLEET_OBJECTS_RETAINED,  # each object's latest, retained: what was published while the observer was away
    wire.node_topic("+", "swarm"),
    wire.node_topic("+", "status"),
)
SCRAPE_TIMEOUT_S = 0.8


class Recorder:
    """Appends JSON lines from several threads; each line is flushed, so a killed run keeps what it saw."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.lines = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()


def parse_metrics(text: str) -> dict[str, float]:
    """``name{label="v",...}`` -> value for every edgerun_* sample except histogram buckets."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("edgerun_") or sample.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return samples


def scrape(name: str, url: str) -> dict[str, Any]:
    record: dict[str, Any] = {"t": time.time(), "scrape": name, "ok": False}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
            record["metrics"] = parse_metrics(resp.read().decode("utf-8", "replace"))
        with urllib.request.urlopen(f"{url}/healthz", timeout=SCRAPE_TIMEOUT_S) as resp:
            health = json.loads(resp.read())
    except urllib.error.HTTPError as err:  # /healthz answers 503 while degraded, with the same body
        try:
            health = json.loads(err.read())
        except ValueError:
            return record
    except (OSError, ValueError):
        return record
    record["ok"] = True
    record["state"] = health.get("state") or health.get("status")
    members = (health.get("swarm") or {}).get("members") or []
    record["members"] = {m.get("name"): m.get("state") for m in members if isinstance(m, dict)}
    return record


def run_observer(broker: str, nodes: dict[str, str], out: Path, stop: threading.Event) -> int:
    recorder = Recorder(out)
    host, port = parse_hostport(broker, "--broker")

    def on_message(client: Any, userdata: Any, message: Any) -> None:
        t = time.time()
        try:
            payload: Any = msgspec.json.decode(message.payload)
        except (msgspec.DecodeError, RecursionError):  # kept as text: the record shows what was sent
            payload = message.payload.decode("utf-8", "replace")[:200]
        recorder.write({"t": t, "topic": message.topic, "payload": payload})

    def on_connect(client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        client.subscribe([(topic, 1) for topic in TOPICS])
        recorder.write({"t": time.time(), "observer": "connected"})

    def on_disconnect(client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        recorder.write({"t": time.time(), "observer": "disconnected"})

    client = new_client(id_prefix="hil-observer", reconnect=(0.2, 1.0))
    client.on_message, client.on_connect, client.on_disconnect = on_message, on_connect, on_disconnect
    # A session that outlives a broker restart (the broker persists it): what the nodes publish between the
    # broker coming back and this client resubscribing is queued for it, not lost to the record.
    connect_in_background(
        client,
        host,
        port,
        keepalive=10,
        session_expiry_s=3600,
        clean_start=MQTT_CLEAN_START_FIRST_ONLY,
    )
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            next_tick = time.monotonic()
            while not stop.is_set():
                for record in pool.map(lambda item: scrape(*item), nodes.items()):
                    recorder.write(record)
                next_tick += 1.0
                stop.wait(max(0.0, next_tick - time.monotonic()))
    finally:
        client.loop_stop()
        client.disconnect()
        recorder.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hil.observer")
    parser.add_argument("--broker", required=True, help="HOST:PORT")
    parser.add_argument("--node", action="append", default=[], help="NAME=http://HOST:PORT (repeat)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    nodes = dict(item.split("=", 1) for item in args.node)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return run_observer(args.broker, nodes, args.out, stop)


if __name__ == "__main__":
    sys.exit(main())

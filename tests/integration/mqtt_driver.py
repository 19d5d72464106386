"""A stand-in node for the MQTT tests: an asyncio loop whose MqttSink publishes synthetic batches.

Run as a real subprocess so a test can ``kill -9`` it and watch the broker
publish the sink's last will. Prints ``READY`` once connected; SIGTERM closes
the sink cleanly (which publishes ``offline`` itself) and exits 0.

    python tests/integration/mqtt_driver.py --port 1883 --node drone-7 --rate 20
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from brokers import make_batch

from edgerun.config import MqttSinkConfig
from edgerun.sinks.mqtt import MqttSink


async def drive(args: argparse.Namespace) -> int:
    cfg = MqttSinkConfig(
        enabled=True,
        host="127.0.0.1",
        port=args.port,
        qos_detections=args.qos,
        keepalive_s=5,
        metrics_interval_s=0.0,
        reconnect_min_s=0.05,
        reconnect_max_s=0.5,
    )
    sink = MqttSink(cfg, args.node)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await sink.start()
    deadline = time.monotonic() + 30
    while not sink.stats.connected:
        if time.monotonic() > deadline:
            print(f"NOT CONNECTED: {sink.status_reason}", flush=True)
            await sink.close(0.5)
            return 1
        await asyncio.sleep(0.02)
    print("READY", flush=True)
    seq = 0
    period = 1.0 / args.rate
    while not stop.is_set():
        sink.submit(make_batch(seq, node_id=args.node), time.monotonic())
        seq += 1
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass
    await sink.close(2.0)
    print(f"CLOSED sent={sink.stats.sent}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--node", default="driver-node")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--qos", type=int, default=0)
    return asyncio.run(drive(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())

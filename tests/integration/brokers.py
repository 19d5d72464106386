"""Helpers for the sink integration tests: brokers, certificates, DDS config, synthetic batches.

A plain module (not a conftest) so it can be imported by test modules and by
the driver scripts they start as subprocesses. Everything talks to 127.0.0.1
only; DDS is always confined to the loopback interface with multicast off.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.sinks.dds import loopback_config
from edgerun.sinks.mosquitto import BrokerTls, Mosquitto, find_mosquitto, run_mosquitto
from edgerun.testing.ports import free_port
from edgerun.types import DetectionBatch, Detections, FrameMeta, Pose

__all__ = [
    "PYTHON",
    "BrokerTls",
    "Certs",
    "Collector",
    "Mosquitto",
    "collecting",
    "dds_domain_id",
    "find_mosquitto",
    "free_port",
    "loopback_config",
    "make_batch",
    "make_certs",
    "make_other_ca",
    "python_env",
    "run_mosquitto",
    "wait_for",
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.02) -> bool:
    """Poll until ``predicate()`` is true; generous timeouts because CI machines are noisy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def dds_domain_id() -> int:
    """A random domain id so concurrent test runs on one machine never see each other."""
    return random.SystemRandom().randint(1, 230)


def make_batch(
    seq: int,
    *,
    node_id: str = "test-node",
    n: int = 2,
    keypoints: int = 0,
    pose: bool = True,
    t_capture: float | None = None,
) -> DetectionBatch:
    """A synthetic batch with ``n`` detections whose values depend on ``seq`` (so each is recognisable)."""
    rng = np.random.default_rng(seq)
    x1 = rng.uniform(0, 500, n)
    y1 = rng.uniform(0, 380, n)
    boxes = np.stack([x1, y1, x1 + rng.uniform(10, 100, n), y1 + rng.uniform(10, 90, n)], axis=1).astype(np.float32)
    kp = rng.uniform(0, 480, (n, keypoints, 2)).astype(np.float32) if keypoints else None
    det = Detections(
        boxes=boxes,
        scores=rng.uniform(0.5, 1.0, n).astype(np.float32),
        class_ids=(np.arange(n) % 2).astype(np.int32),
        keypoints=kp,
    )
    now = time.monotonic() if t_capture is None else t_capture
    meta = FrameMeta(
        seq=seq,
        source="replay",
        width=640,
        height=480,
        wall_time=time.time(),
        t_capture=now,
        pose=Pose(1.5, -2.25, 6.0, 10.0, 2.0, 0.5, 60.0) if pose else None,
    )
    return DetectionBatch(
        node_id=node_id,
        meta=meta,
        detections=det,
        labels=("face", "person"),
        model_name="synthetic",
        model_version=3,
        engine="tflite",
    )


@dataclass
class Certs:
    """A test PKI: one CA signing a server (localhost, 127.0.0.1) and a client certificate."""

    dir: Path
    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key.name,
        "-out",
        crt.name,
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-addext",
        "subjectKeyIdentifier=hash",
        cwd=d,
    )
    return crt, key


def _make_leaf(d: Path, name: str, ca: Path, ca_key: Path, usage: str) -> tuple[Path, Path]:
    crt, key, csr, ext = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\n"
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key.name,
        "-out",
        csr.name,
        "-subj",
        f"/CN={name}",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr.name,
        "-CA",
        ca.name,
        "-CAkey",
        ca_key.name,
        "-CAcreateserial",
        "-out",
        crt.name,
        "-days",
        "2",
        "-extfile",
        ext.name,
        cwd=d,
    )
    return crt, key


def make_certs(directory: Path) -> Certs:
    """Generate a CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _make_ca(directory, "edgerun-test-ca")
    server_cert, server_key = _make_leaf(directory, "server", ca, ca_key, "serverAuth")
    client_cert, client_key = _make_leaf(directory, "client", ca, ca_key, "clientAuth")
    return Certs(directory, ca, ca_key, server_cert, server_key, client_cert, client_key)


def make_other_ca(directory: Path) -> Path:
    """A CA that signed nothing the broker uses: trusting it must fail the handshake."""
    directory.mkdir(parents=True, exist_ok=True)
    crt, _ = _make_ca(directory, "unrelated-ca")
    return crt


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    properties: dict[str, Any]
    t: float


@dataclass
class Collector:
    """A paho MQTT 5 subscriber in its own thread that records every message.

    ``session=True`` keeps a persistent session (clean start off, long expiry)
    so messages published while it is reconnecting wait for it at the broker.
    """

    port: int
    topics: list[str]
    qos: int = 1
    session: bool = False
    client_id: str = field(default_factory=lambda: f"collector-{random.SystemRandom().randrange(1 << 30)}")
    messages: list[Received] = field(default_factory=list)
    subscribed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._lock = threading.Lock()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=MQTTProtocolVersion.MQTTv5)
        client.reconnect_delay_set(0.05, 0.5)

        def on_connect(c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
            if not rc.is_failure:
                c.subscribe([(t, self.qos) for t in self.topics])

        def on_subscribe(c: Any, u: Any, mid: Any, rcs: Any, props: Any) -> None:
            self.subscribed.set()

        def on_message(c: Any, u: Any, msg: Any) -> None:
            props = {}
            if msg.properties is not None:
                for name in ("ContentType", "MessageExpiryInterval", "UserProperty", "PayloadFormatIndicator"):
                    if hasattr(msg.properties, name):
                        props[name] = getattr(msg.properties, name)
            with self._lock:
                self.messages.append(Received(msg.topic, bytes(msg.payload), bool(msg.retain), props, time.monotonic()))

        client.on_connect = on_connect
        client.on_subscribe = on_subscribe
        client.on_message = on_message
        self._client = client
        self._props = Properties(PacketTypes.CONNECT)
        if self.session:
            self._props.SessionExpiryInterval = 600

    def start(self, timeout: float = 20.0) -> Collector:
        self._client.connect_async(
            "127.0.0.1", self.port, keepalive=5, clean_start=not self.session, properties=self._props
        )
        self._client.loop_start()
        if not self.subscribed.wait(timeout):
            raise AssertionError(f"collector did not subscribe to 127.0.0.1:{self.port} within {timeout} s")
        return self

    def stop(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.messages)

    def on(self, topic: str) -> list[Received]:
        return [m for m in self.snapshot() if m.topic == topic]

    def json_on(self, topic: str) -> list[dict[str, Any]]:
        return [json.loads(m.payload) for m in self.on(topic)]


@contextmanager
def collecting(port: int, topics: list[str], **kwargs: Any) -> Iterator[Collector]:
    collector = Collector(port, topics, **kwargs).start()
    try:
        yield collector
    finally:
        collector.stop()


def python_env() -> dict[str, str]:
    """Environment for Python subprocesses: this repo first on the path, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("CYCLONEDDS_URI", None)  # every participant in these tests gets its loopback config explicitly
    return env


PYTHON = sys.executable

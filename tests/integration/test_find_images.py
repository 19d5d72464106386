"""The picture of each find, from real node processes to a real mosquitto.

Three drones of the demo's swarm layout fly the replayed scene, each in a swarm of its own (so each owns
what it finds): ``drone-1`` with loose bounds (a better view may go out every second), ``rate-1`` with one
picture per object a minute, and ``bytes-1`` with 1 byte a second for all its pictures (after its first
picture the bucket holds no second one). A subscriber checks what an operator's station relies on: a
retained JPEG per owned object that decodes, at most 320 px a side and 64 KiB, its user properties naming
the owner; a better view published again with a higher score; and a flood held to each bound, every
held-back crop counted in /metrics and nothing sent that the node did not count.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import cv2
import numpy as np
import pytest
import tomli_w

from edgerun import wire
from edgerun.demo_swarm import drone_configs, start_drones, stop_drones
from tests.conftest import free_port
from tests.integration.brokers import Received, collecting, run_mosquitto, wait_for

FAST_TIMING = {"probe_interval_s": 0.3, "probe_timeout_s": 0.15, "gossip_interval_s": 0.1, "suspicion_mult": 3}
LOOSE = {"min_interval_s": 1.0, "better_by": 0.01}
PER_OBJECT = {"min_interval_s": 60.0, "better_by": 0.0}
BYTES = {"max_bytes": 8192, "max_bytes_per_s": 1}


def metrics(port: int) -> str:
    """The node's /metrics text; empty while its HTTP service is not up yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def image_meta(msg: Received) -> wire.ObjectImageMeta:
    return wire.ObjectImageMeta.from_properties(msg.properties.get("UserProperty", []))


@pytest.fixture(scope="module")
def flight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finds")
    with run_mosquitto() as broker:
        crew = []
        for name, bounds in (("drone-1", LOOSE), ("rate-1", PER_OBJECT), ("bytes-1", BYTES)):
            (tmp / name).mkdir()
            (drone,) = drone_configs(tmp / name, 1, mqtt=f"127.0.0.1:{broker.port}")
            drone.node_id = name
            drone.config["node"]["id"] = name
            drone.config["service"]["http_port"] = free_port()
            drone.config["swarm"]["timing"] = dict(FAST_TIMING)
            drone.config["swarm"]["images"] = dict(bounds)
            drone.config["source"]["fps"] = 8  # three nodes on a shared CI machine
            (drone.out_dir / "node.toml").write_text(tomli_w.dumps(drone.config))
            crew.append(drone)
        with collecting(broker.port, [wire.FLEET_OBJECTS_TOPIC, wire.FLEET_OBJECT_IMAGES]) as collector:
            started = time.monotonic()
            start_drones(crew, seconds=120)
            try:
                yield broker, crew, collector, started
            finally:
                for drone in crew:
                    if drone.proc is not None and drone.proc.poll() is None:
                        drone.proc.terminate()
                stop_drones(crew)


def images_by(collector: Any, node: str) -> dict[str, list[Received]]:
    out: dict[str, list[Received]] = {}
    for msg in collector.snapshot():
        if msg.topic.endswith("/image") and image_meta(msg).node == node:
            out.setdefault(msg.topic.split("/")[-2], []).append(msg)
    return out


def test_each_owned_find_gets_a_retained_jpeg_that_decodes_within_its_bounds(flight):
    broker, crew, collector, _ = flight
    assert wait_for(lambda: len(images_by(collector, "drone-1")) >= 2, timeout=90, interval=0.5), [
        drone.out_dir.joinpath("node.log").read_text()[-2000:] for drone in crew
    ]
    objects = {o["id"]: o for o in collector.json_on(wire.FLEET_OBJECTS_TOPIC)}
    for object_id, messages in images_by(collector, "drone-1").items():
        assert objects[object_id]["owner"] == "drone-1"  # only the owner sends a picture of an object
        for msg in messages:
            assert msg.properties["ContentType"] == "image/jpeg"
            assert len(msg.payload) <= wire.OBJECT_IMAGE_MAX_BYTES
            picture = cv2.imdecode(np.frombuffer(msg.payload, np.uint8), cv2.IMREAD_COLOR)
            assert picture is not None and 0 < max(picture.shape[:2]) <= wire.OBJECT_IMAGE_MAX_SIDE_PX
            meta = image_meta(msg)
            x0, y0, x1, y1 = meta.box
            assert 0 <= x0 < x1 <= 640 and 0 <= y0 < y1 <= 480
            assert objects[object_id]["first_seen"] - 1.0 <= meta.ts <= objects[object_id]["ts"] + 60.0
    # A subscriber that comes later gets each picture from the broker, retained: the latest one sent.
    latest = {oid: msgs[-1] for oid, msgs in images_by(collector, "drone-1").items()}
    oid, last = sorted(latest.items())[0]
    with collecting(broker.port, [wire.object_image_topic(oid)]) as late:
        assert wait_for(lambda: late.snapshot(), timeout=10)
        first = late.snapshot()[0]
    assert first.retain
    assert image_meta(first).score >= image_meta(last).score  # this one, or a better view sent since


def test_a_better_view_is_published_again_with_a_higher_score(flight):
    _, _, collector, _ = flight

    def republished() -> list[list[float]]:
        runs = [[image_meta(m).score for m in msgs] for msgs in images_by(collector, "drone-1").values()]
        return [scores for scores in runs if len(scores) >= 2]

    assert wait_for(lambda: bool(republished()), timeout=90, interval=0.5), images_by(collector, "drone-1")
    for scores in republished():
        assert all(b >= a + LOOSE["better_by"] - 0.0005 for a, b in zip(scores, scores[1:])), scores


def port_of(crew: list[Any], name: str) -> int:
    return int(next(d for d in crew if d.node_id == name).config["service"]["http_port"])


def held_back(port: int, reason: str) -> float:
    return metric(metrics(port), "edgerun_find_images_skipped_total", f'{{reason="{reason}"}}')


def assert_sent_is_counted(collector: Any, port: int, node: str) -> None:
    """What the subscriber got is what the node counted: nothing went out uncounted, nothing counted was lost."""

    def received_is_counted() -> bool:
        text = metrics(port)
        got = [m for msgs in images_by(collector, node).values() for m in msgs]
        return (len(got), sum(len(m.payload) for m in got)) == (
            metric(text, "edgerun_find_images_published_total"),
            metric(text, "edgerun_find_images_bytes_total"),
        )

    assert wait_for(received_is_counted, timeout=10, interval=0.2), (images_by(collector, node), metrics(port))


def test_better_views_within_an_objects_interval_are_held_back_and_counted(flight):
    _, crew, collector, _ = flight
    port = port_of(crew, "rate-1")
    assert wait_for(lambda: held_back(port, "object_rate") > 0, timeout=90, interval=1.0), (
        {k: len(v) for k, v in images_by(collector, "rate-1").items()},
        metrics(port)[-1500:],
    )
    pictures = images_by(collector, "rate-1")
    assert pictures and all(len(msgs) == 1 for msgs in pictures.values()), {k: len(v) for k, v in pictures.items()}
    assert_sent_is_counted(collector, port, "rate-1")


def test_a_flood_of_pictures_is_held_to_the_byte_rate_and_counted(flight):
    _, crew, collector, started = flight
    port = port_of(crew, "bytes-1")
    assert wait_for(lambda: held_back(port, "bytes_rate") > 0, timeout=90, interval=1.0), (
        {k: len(v) for k, v in images_by(collector, "bytes-1").items()},
        metrics(port)[-1500:],
    )
    text = metrics(port)
    assert metric(text, "edgerun_find_images_published_total") >= 1
    # Never more than the bucket (one full picture) plus the rate since the node started.
    elapsed = time.monotonic() - started
    assert metric(text, "edgerun_find_images_bytes_total") <= BYTES["max_bytes"] + BYTES["max_bytes_per_s"] * elapsed
    pictures = images_by(collector, "bytes-1")
    assert all(len(m.payload) <= BYTES["max_bytes"] for msgs in pictures.values() for m in msgs)
    assert_sent_is_counted(collector, port, "bytes-1")

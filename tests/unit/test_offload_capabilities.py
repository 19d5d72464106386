"""Offload capabilities in member metadata: the capacity estimate and its coarse steps, how a change goes out
(urgent, quiet or not at all), the 512-byte cap, and the helper candidates read from (untrusted) member
metadata."""

from __future__ import annotations

import math

import msgspec
import pytest

from edgerun.fleet.member_meta import MAX_META_BYTES, MemberMeta, MetaUpdate, decode_meta, encode_meta
from edgerun.fleet.service import META_FAR_M, META_QUIET_MIN_S, meta_update_kind
from edgerun.offload.capabilities import candidates_from_members, capabilities_due, quantised_capacity, spare_fps
from swarm.membership import Member, MemberState

HASH = "0123456789abcdef"


def test_spare_fps_is_what_the_engine_can_run_less_what_it_already_runs() -> None:
    # two calls in parallel at 50 ms each: 40 fps, of which 12.5 are the node's own and 5 served for others
    assert spare_fps(2, 50.0, own_fps=12.5, served_fps=5.0) == 22.5
    assert spare_fps(1, 30.0, own_fps=0.0, served_fps=0.0) == 33.3  # rounded
    assert spare_fps(1, 100.0, own_fps=8.0, served_fps=4.0) == 0.0  # over capacity: nothing spare, not negative
    for infer_ms in (0.0, -1.0, float("nan"), float("inf")):  # not measured yet, or nonsense
        assert spare_fps(1, infer_ms, own_fps=0.0, served_fps=0.0) == 0.0
    assert spare_fps(0, 10.0, own_fps=0.0, served_fps=0.0) == 0.0


def caps(**kw: object) -> MemberMeta:
    base: dict[str, object] = dict(
        model="pose_detector", serve_hash=HASH, serve_port=7950, spare_fps=10.0, infer_ms=40.0, queue=2
    )
    base.update(kw)
    return MemberMeta(**base)  # type: ignore[arg-type]


def test_capacity_is_advertised_in_coarse_steps_that_promise_less() -> None:
    q = quantised_capacity(caps(spare_fps=11.9, infer_ms=31.0, queue=3))
    assert (q.spare_fps, q.infer_ms, q.queue) == (8.0, 50.0, 4)  # spare down, time and queue up
    assert (q.model, q.serve_hash, q.serve_port) == ("pose_detector", HASH, 7950)  # the rest untouched
    # noise within a step is no news: 20.0 .. 29.9 fps spare all read 20
    assert {quantised_capacity(caps(spare_fps=f)).spare_fps for f in (20.0, 24.3, 29.9)} == {20.0}
    assert quantised_capacity(caps(spare_fps=0.7)).spare_fps == 0.0  # under a frame a second: nothing spare
    assert quantised_capacity(caps(spare_fps=9000.0)).spare_fps == 500.0
    assert quantised_capacity(caps(infer_ms=0.0)).infer_ms == 0.0  # not measured yet stays so
    assert quantised_capacity(caps(infer_ms=1234.5)).infer_ms == 1235.0  # past the last step: whole ms, up
    assert quantised_capacity(caps(queue=0)).queue == 0
    # nonsense is left for the reader to refuse (candidates_from_members), never raises here
    assert quantised_capacity(caps(spare_fps=float("nan"))).spare_fps == 0.0
    assert math.isnan(quantised_capacity(caps(infer_ms=float("nan"))).infer_ms)


def test_what_is_served_is_urgent_and_capacity_quiet_at_most_every_30_s_on_a_step() -> None:
    last = caps()
    assert capabilities_due(caps(), None, 0.0, 0.0) is MetaUpdate.URGENT  # never published
    assert capabilities_due(caps(serve_port=0, serve_hash=""), last, 100.0, 100.1) is MetaUpdate.URGENT  # stopped
    assert capabilities_due(caps(serve_hash="fedcba9876543210"), last, 100.0, 100.1) is MetaUpdate.URGENT  # OTA
    # the first measured time per frame: the node is ready to help (once a start), and its loss
    assert capabilities_due(caps(), caps(infer_ms=0.0, spare_fps=0.0), 100.0, 100.1) is MetaUpdate.URGENT
    assert capabilities_due(caps(infer_ms=0.0, spare_fps=0.0), last, 100.0, 100.1) is MetaUpdate.URGENT
    assert capabilities_due(caps(spare_fps=30.0), last, 100.0, 129.9) is MetaUpdate.NONE
    assert capabilities_due(caps(spare_fps=30.0), last, 100.0, 130.0) is MetaUpdate.QUIET
    assert capabilities_due(caps(spare_fps=11.9, infer_ms=36.0), last, 100.0, 500.0) is MetaUpdate.NONE  # same steps
    assert capabilities_due(caps(spare_fps=0.0), last, 100.0, 130.0) is MetaUpdate.QUIET  # full: still quiet


POSE = dict(east=1.0, north=2.0, yaw=0.0)


def test_the_node_sends_what_others_act_on_at_once_and_the_rest_quietly() -> None:
    """FleetMember's rule: model, engine, health, what is served and a pose that appears urgent; pose moves,
    fps and capacity quiet."""
    sent = (caps(fps=10.0, **POSE), 0.0)
    assert meta_update_kind(caps(fps=10.0, **POSE), None, 0.0) is MetaUpdate.URGENT
    assert meta_update_kind(caps(fps=10.0, **POSE), sent, 1000.0) is MetaUpdate.NONE  # nothing changed
    for urgent in (
        dict(model="other"),
        dict(version=4),
        dict(engine="onnx"),
        dict(fallback=True),
        dict(health="degraded"),
        dict(serve_port=0),
    ):
        assert meta_update_kind(caps(fps=10.0, **{**POSE, **urgent}), sent, 0.5) is MetaUpdate.URGENT, urgent
    # fps, capacity and a short move wait for META_QUIET_MIN_S, then go quietly
    for quiet in (dict(fps=14.0), dict(spare_fps=30.0), dict(east=15.0), dict(yaw=40.0)):
        meta = caps(**{"fps": 10.0, **POSE, **quiet})
        assert meta_update_kind(meta, sent, META_QUIET_MIN_S - 0.1) is MetaUpdate.NONE, quiet
        assert meta_update_kind(meta, sent, META_QUIET_MIN_S) is MetaUpdate.QUIET, quiet
    # a far move or turn goes (quietly) at once; a pose that appears or goes is urgent
    assert meta_update_kind(caps(fps=10.0, east=1.0, north=2.0 + META_FAR_M + 0.1, yaw=0.0), sent, 2.0) is (
        MetaUpdate.QUIET
    )
    assert meta_update_kind(caps(fps=10.0, east=1.0, north=2.0, yaw=-46.0), sent, 2.0) is MetaUpdate.QUIET
    assert meta_update_kind(caps(fps=10.0, east=1.0, north=2.0, yaw=350.0), sent, 2.0) is MetaUpdate.NONE  # 10 deg
    assert meta_update_kind(caps(fps=10.0), sent, 2.0) is MetaUpdate.URGENT  # no place to draw it any more
    assert meta_update_kind(caps(fps=10.0, **POSE), (caps(fps=10.0), 0.0), 2.0) is MetaUpdate.URGENT  # first
    # capacity noise within its steps is no news, however long it lasts
    assert meta_update_kind(caps(fps=10.0, spare_fps=11.0, infer_ms=36.0, **POSE), sent, 1000.0) is MetaUpdate.NONE


def longest_meta() -> MemberMeta:
    """The longest values a node can gossip: strings at the cuts encode_meta applies, numbers at their widest."""
    return MemberMeta(
        model="m" * 64,
        version=2**63 - 1,
        engine="e" * 32,
        fallback=True,
        health="h" * 32,
        fps=1234.5,  # the node rounds fps to tenths: the wire's unit
        east=-123456.78,
        north=123456.78,
        up=12345.67,
        yaw=-179.9,
        hfov=179.9,
        serve_hash="f" * 16,
        serve_port=65535,
        spare_fps=12345.6,
        infer_ms=12345.6,
        queue=2**31,
    )


def test_the_longest_metadata_with_capabilities_fits_the_512_byte_cap_whole() -> None:
    meta = longest_meta()
    data = encode_meta(meta)
    assert len(data) <= MAX_META_BYTES
    assert decode_meta(data) == meta  # nothing cut
    # over-long strings are cut to those lengths, and the capabilities survive the cut
    long = msgspec.structs.replace(meta, model="m" * 400, health="h" * 200, serve_hash="f" * 100)
    cut = decode_meta(encode_meta(long))
    assert cut is not None and cut.model == "m" * 64 and cut.serve_hash == "f" * 16
    assert (cut.serve_port, cut.spare_fps, cut.infer_ms, cut.queue) == (65535, 12345.6, 12345.6, 2**31)


def test_metadata_without_capabilities_costs_nothing_and_an_older_node_shows_the_member_without_it() -> None:
    plain = encode_meta(MemberMeta(model="blazeface", engine="tflite", fps=10.0))
    served = encode_meta(caps(fps=10.0))
    assert len(plain) < len(served)  # a node that serves nobody sends zeros, not capabilities
    assert plain.endswith(b"\xa0\x00\x00\x00\x00")  # serve_hash "", port, spare, infer, queue: 1 byte each

    class OldMemberMeta(msgspec.Struct, omit_defaults=True):  # what a version 1 node decodes metadata as
        v: int = 1
        model: str = ""
        fps: float = 0.0

    # A version 1 node cannot read a version 2 array: its decode_meta catches the error and shows the member
    # without metadata (never dropped); the member's state and address are gossip's, not the metadata's.
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(served, type=OldMemberMeta)


def member(name: str, meta: bytes, state: MemberState = MemberState.ALIVE, host: str = "10.0.0.9") -> Member:
    return Member(name, (host, 7946), state, 1, meta, 0.0)


def test_candidates_are_live_members_serving_my_model_and_bad_metadata_is_skipped() -> None:
    raw = msgspec.msgpack.Encoder()

    def crafted(**fields: object) -> bytes:  # what a broken or hostile peer could gossip
        return raw.encode({"v": 1, "sh": HASH, "sp": 7950, "sf": 5.0, "im": 20.0, "q": 0, **fields})

    members = [
        member("me", encode_meta(caps())),
        member("helper", encode_meta(caps(spare_fps=5.0, infer_ms=20.0, queue=1)), host="10.0.0.2"),
        member("other-model", encode_meta(caps(serve_hash="fedcba9876543210"))),
        member("serves-nobody", encode_meta(MemberMeta(model="pose_detector"))),
        member("no-port", encode_meta(caps(serve_port=0))),
        member("dead", encode_meta(caps()), MemberState.DEAD),
        member("suspect", encode_meta(caps()), MemberState.SUSPECT),
        member("left", encode_meta(caps()), MemberState.LEFT),
        member("garbage", b"\xc1\xff not msgpack"),
        member("empty", b""),
        member("wrong-types", crafted(sp="7950")),
        member("port-too-big", crafted(sp=70000)),
        member("nan-spare", crafted(sf=float("nan"))),
        member("negative-infer", crafted(im=-5.0)),
        member("inf-infer", crafted(im=float("inf"))),
        member("negative-queue", crafted(q=-1)),
        member("hostile-but-valid", crafted(), host="10.0.0.3"),
    ]
    rtts = {"helper": 12.5}
    got = candidates_from_members(members, "me", HASH, rtts.get)
    assert [(c.name, c.addr, c.spare_fps, c.infer_ms, c.queue, c.rtt_ms) for c in got] == [
        ("helper", ("10.0.0.2", 7950), 5.0, 20.0, 1, 12.5),
        ("hostile-but-valid", ("10.0.0.3", 7950), 5.0, 20.0, 0, None),
    ]
    assert candidates_from_members(members, "me", "", rtts.get) == []  # this node serves no model itself


@pytest.mark.parametrize("garbage", [b"\x00", b"\x91\x01", b"\xdf\xff\xff\xff\xff", bytes(range(256)) * 2])
def test_undecodable_metadata_never_raises(garbage: bytes) -> None:
    assert candidates_from_members([member("x", garbage)], "me", HASH, lambda _: 1.0) == []


def test_metadata_travels_in_the_units_the_node_rounds_to_and_older_maps_still_decode() -> None:
    meta = MemberMeta(model="pose_detector", version=3, engine="tflite", health="running", fps=14.66, east=27.761)
    data = encode_meta(meta)
    back = decode_meta(data)
    assert back is not None and (back.fps, back.east) == (14.7, 27.76)  # tenths of a frame, centimetres
    older = msgspec.msgpack.encode(msgspec.structs.replace(meta, v=1))  # a version 1 node's map with named keys
    assert len(data) < 0.6 * len(older)
    assert decode_meta(older) == msgspec.structs.replace(meta, v=1)

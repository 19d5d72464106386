"""Offload capabilities in member metadata: the capacity estimate, when a change is gossiped, the 512-byte cap,
and the helper candidates read from (untrusted) member metadata."""

from __future__ import annotations

import msgspec
import pytest

from edgerun.fleet.member_meta import MAX_META_BYTES, MemberMeta, decode_meta, encode_meta
from edgerun.fleet.service import meta_worth_gossiping
from edgerun.offload.capabilities import candidates_from_members, capabilities_due, capabilities_moved, spare_fps
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


def test_a_capability_moved_when_it_changed_by_more_than_a_fifth() -> None:
    last = caps()
    assert not capabilities_moved(caps(), last)
    assert not capabilities_moved(caps(spare_fps=12.0, infer_ms=32.0), last)  # exactly 20 %: not more
    assert capabilities_moved(caps(spare_fps=12.5), last)
    assert capabilities_moved(caps(spare_fps=7.9), last)
    assert capabilities_moved(caps(infer_ms=49.0), last)
    assert capabilities_moved(caps(queue=3), last)
    assert capabilities_moved(caps(serve_port=7951), last)
    assert capabilities_moved(caps(serve_hash="fedcba9876543210"), last)
    # small figures move by noise: below one frame a second (one ms, one request) nothing is news
    assert not capabilities_moved(caps(spare_fps=0.6), caps(spare_fps=0.4))
    assert capabilities_moved(caps(spare_fps=1.5), caps(spare_fps=0.0))  # a helper with room again
    assert capabilities_moved(caps(spare_fps=0.0), caps(spare_fps=5.0))  # full


def test_capacity_goes_out_at_most_every_5_s_and_what_is_served_at_once() -> None:
    last = caps()
    assert capabilities_due(caps(), None, 0.0, 0.0)  # never published
    assert not capabilities_due(caps(spare_fps=20.0), last, 100.0, 104.9)
    assert capabilities_due(caps(spare_fps=20.0), last, 100.0, 105.0)
    assert not capabilities_due(caps(spare_fps=11.0), last, 100.0, 200.0)  # 10 %: never on its own
    assert capabilities_due(caps(serve_port=0, serve_hash=""), last, 100.0, 100.1)  # stopped serving
    assert capabilities_due(caps(serve_hash="fedcba9876543210"), last, 100.0, 100.1)  # OTA swapped the model


def test_the_node_gossips_its_meta_for_capacity_within_its_other_rules() -> None:
    """FleetMember's rule: a static camera's fps changes wait for the 30 s refresh, its capacity for 5 s."""
    sent = (caps(fps=10.0, east=1.0, north=2.0, yaw=0.0), 0.0)
    assert not meta_worth_gossiping(caps(fps=14.0, east=1.0, north=2.0, yaw=0.0), sent, 6.0)
    assert not meta_worth_gossiping(caps(spare_fps=30.0, east=1.0, north=2.0, yaw=0.0), sent, 4.0)
    assert meta_worth_gossiping(caps(spare_fps=30.0, east=1.0, north=2.0, yaw=0.0), sent, 5.0)
    assert meta_worth_gossiping(caps(serve_port=0, east=1.0, north=2.0, yaw=0.0), sent, 0.5)
    assert meta_worth_gossiping(caps(fps=14.0, east=1.0, north=2.0, yaw=0.0), sent, 30.0)


def longest_meta() -> MemberMeta:
    """The longest values a node can gossip: strings at the cuts encode_meta applies, numbers at their widest."""
    return MemberMeta(
        model="m" * 64,
        version=2**63 - 1,
        engine="e" * 32,
        fallback=True,
        health="h" * 32,
        fps=1234.56,
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


def test_metadata_without_capabilities_is_as_before_and_old_nodes_read_new_metadata() -> None:
    plain = MemberMeta(model="blazeface", engine="tflite", fps=10.0)
    assert b"sh" not in encode_meta(plain)  # defaults are omitted: a node that serves nobody pays nothing

    class OldMemberMeta(msgspec.Struct, omit_defaults=True):  # the fields before #25
        v: int = 1
        model: str = ""
        fps: float = 0.0

    old = msgspec.msgpack.decode(encode_meta(caps(fps=3.0)), type=OldMemberMeta)
    assert (old.model, old.fps) == ("pose_detector", 3.0)


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

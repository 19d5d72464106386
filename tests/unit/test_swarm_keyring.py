"""The swarm keyring: sealing, rotation without a flag day, rejection of forged, replayed and truncated packets."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.keyring import (
    KEY_BYTES,
    KIND_DATAGRAM,
    KIND_STREAM_REQUEST,
    OVERHEAD,
    Keyring,
    KeyringError,
    generate_key,
)

NOW = 1_800_000_000.0


def test_seal_open_round_trip_and_overhead_bound():
    ring = Keyring([generate_key()])
    packet = ring.seal("drone-1", b"hello", NOW)
    assert len(packet) - len(b"hello") <= OVERHEAD
    assert b"hello" not in packet
    assert Keyring(ring.keys).open(packet, NOW + 0.1) == ("drone-1", b"hello")


def test_rotation_install_use_remove_without_flag_day():
    old, new = generate_key(), generate_key()
    a, b = Keyring([old]), Keyring([old])
    # Step 1: b installs the new key; a still seals with old, b still opens.
    b.install(new)
    assert b.open(a.seal("a", b"1", NOW), NOW)[1] == b"1"
    # Step 2: b switches primary; a (old only) cannot open yet, so a installs first in a real rollout.
    a.install(new)
    b.use(new)
    assert a.open(b.seal("b", b"2", NOW), NOW)[1] == b"2"
    assert b.open(a.seal("a", b"3", NOW + 1), NOW + 1)[1] == b"3"  # a still on old: b tries every key
    a.use(new)
    # Step 3: old removed everywhere; a packet sealed with old alone is now forged.
    a.remove(old)
    b.remove(old)
    assert a.keys == [new] and b.keys == [new]
    straggler = Keyring([old]).seal("c", b"4", NOW + 2)
    with pytest.raises(KeyringError) as err:
        b.open(straggler, NOW + 2)
    assert err.value.reason == "forged"


def test_primary_cannot_be_removed_and_use_needs_install():
    key = generate_key()
    ring = Keyring([key])
    with pytest.raises(KeyringError, match="primary"):
        ring.remove(key)
    with pytest.raises(KeyringError, match="not installed"):
        ring.use(generate_key())
    with pytest.raises(KeyringError, match="32 bytes"):
        ring.install(b"short")


def _reason(ring: Keyring, packet: bytes, now: float = NOW, kind: int = KIND_DATAGRAM) -> str:
    with pytest.raises(KeyringError) as err:
        ring.open(packet, now, kind=kind)
    return err.value.reason


def test_forged_packets_are_rejected():
    key = generate_key()
    sender, receiver = Keyring([key]), Keyring([key])
    packet = bytearray(sender.seal("drone-1", b"alive inc=3", NOW))
    tampered_body = bytes(packet[:-1]) + bytes([packet[-1] ^ 1])
    assert _reason(receiver, tampered_body) == "forged"
    # The sender name and the counter are authenticated: rewriting them breaks the tag.
    renamed = bytes(packet).replace(b"drone-1", b"drone-2")
    assert _reason(receiver, renamed) == "forged"
    assert _reason(receiver, Keyring([generate_key()]).seal("drone-1", b"x", NOW)) == "forged"
    # The untouched packet still opens: the rejections above left no state behind.
    assert receiver.open(bytes(packet), NOW) == ("drone-1", b"alive inc=3")


def test_replayed_packets_are_rejected():
    key = generate_key()
    sender, receiver = Keyring([key]), Keyring([key], reorder_window_s=5.0, max_age_s=60.0)
    first = sender.seal("drone-1", b"a", NOW)
    second = sender.seal("drone-1", b"b", NOW)  # same clock reading: the counter still moves on
    assert receiver.open(second, NOW)[1] == b"b"
    assert receiver.open(first, NOW)[1] == b"a"  # reordered inside the window is fine, once
    assert _reason(receiver, first) == "replay"
    assert _reason(receiver, second) == "replay"
    later = sender.seal("drone-1", b"c", NOW + 10)
    assert receiver.open(later, NOW + 10)[1] == b"c"
    # Sealed before the window behind the newest accepted packet: replay even though never seen.
    old_unseen = Keyring([key]).seal("drone-1", b"d", NOW + 1)
    assert _reason(receiver, old_unseen, NOW + 10) == "replay"
    # A recorded packet played to a receiver that never saw the sender, long after: stale.
    assert _reason(Keyring([key]), first, NOW + 3600) == "stale"


def test_a_restarted_sender_is_accepted_again():
    key = generate_key()
    receiver = Keyring([key])
    assert receiver.open(Keyring([key]).seal("drone-1", b"before", NOW), NOW)[1] == b"before"
    restarted = Keyring([key])  # fresh counter state: it starts from its wall clock
    assert receiver.open(restarted.seal("drone-1", b"after", NOW + 2), NOW + 2)[1] == b"after"


def test_truncated_and_mislabelled_packets_are_rejected():
    ring = Keyring([generate_key()])
    packet = ring.seal("drone-1", b"payload", NOW)
    assert _reason(ring, packet[:10]) == "short"
    assert _reason(ring, b"") == "short"
    assert _reason(ring, packet[:-1]) == "forged"  # the tag no longer matches
    assert _reason(ring, bytes([9]) + packet[1:]) == "version"
    assert _reason(ring, packet, kind=KIND_STREAM_REQUEST) == "kind"
    assert _reason(ring, packet[:2] + bytes([200]) + packet[3:]) == "header"


def test_seen_set_is_bounded():
    key = generate_key()
    sender, receiver = Keyring([key]), Keyring([key], max_seen_per_sender=8)
    packets = [sender.seal("n", b"%d" % i, NOW) for i in range(20)]
    for packet in packets:
        receiver.open(packet, NOW)
    for packet in packets:  # forgotten ones fall under the floor: still rejected
        assert _reason(receiver, packet) == "replay"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_open_of_any_bytes_raises_only_keyring_error(data):
    ring = Keyring([bytes(KEY_BYTES)])
    try:
        ring.open(data, NOW)
    except KeyringError as exc:
        assert exc.reason in {"short", "version", "kind", "header", "forged", "replay", "stale"}


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.integers(min_value=0, max_value=199))
def test_open_of_any_prefix_of_a_real_packet_raises_only_keyring_error(body, cut):
    ring = Keyring([bytes(KEY_BYTES)])
    packet = ring.seal("drone", body, NOW)
    with pytest.raises(KeyringError):
        Keyring([bytes(KEY_BYTES)]).open(packet[: min(cut, len(packet) - 1)], NOW)


def test_key_file_load_and_errors(tmp_path):
    keys = [generate_key(), generate_key()]
    path = tmp_path / "swarm.key"
    Keyring(keys).save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert Keyring.load(path).keys == keys
    path.write_text("# comment\n\n" + base64.b64encode(keys[1]).decode() + "\n")
    assert Keyring.load(path).primary == keys[1]

    cases = {
        "missing.key": (None, "not found"),
        "empty.key": ("\n# nothing\n", "holds no key"),
        "short.key": (base64.b64encode(b"x" * 16).decode() + "\n", ":1: key is 16 bytes"),
        "garbage.key": (base64.b64encode(keys[0]).decode() + "\n!!not base64!!\n", ":2: not a base64 key"),
    }
    for name, (text, message) in cases.items():
        bad = tmp_path / name
        if text is not None:
            bad.write_text(text)
        with pytest.raises(KeyringError) as err:
            Keyring.load(bad)
        assert str(err.value).startswith(str(bad)) and message in str(err.value)
        assert isinstance(err.value, ValueError)

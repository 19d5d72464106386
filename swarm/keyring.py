"""Authenticated encryption of swarm packets under a keyring, with replay rejection.

Every packet is an envelope::

    version(1) | kind(1) | sender_len(1) | sender | counter(8, big endian) | nonce(24) | ciphertext + tag(16)

sealed with XChaCha20-Poly1305 (libsodium through pynacl); everything before the nonce is the authenticated
header (AEAD associated data), so a forger can neither read nor change it. XChaCha's 192-bit nonce is safe to
draw at random per packet, so senders keep no nonce state.

Keys rotate without a flag day, as in memberlist: the primary key seals, every installed key is tried on open;
``install`` a new key everywhere, ``use`` it as primary everywhere, then ``remove`` the old one.

Unlike memberlist, a recorded packet cannot be replayed: the counter is the sender's wall clock in microseconds
(strictly increasing per sender, so a restarted sender continues above its old packets), and the receiver keeps,
per sender, the highest counter seen and the counters accepted inside a reorder window. A counter that was already
accepted, that is older than the window, or whose time is further than ``max_age_s`` from the receiver's clock is
rejected as "replay"/"stale".
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from nacl import bindings
from nacl.exceptions import CryptoError

KEY_BYTES = 32
VERSION = 1
NONCE_BYTES = bindings.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES
TAG_BYTES = bindings.crypto_aead_xchacha20poly1305_ietf_ABYTES
MAX_SENDER_BYTES = 64
_FIXED_HEADER = 3  # version, kind, sender_len
_COUNTER_BYTES = 8
# Bytes the envelope adds to a plaintext at most (a sender name of MAX_SENDER_BYTES).
OVERHEAD = _FIXED_HEADER + MAX_SENDER_BYTES + _COUNTER_BYTES + NONCE_BYTES + TAG_BYTES
_MIN_PACKET = _FIXED_HEADER + 1 + _COUNTER_BYTES + NONCE_BYTES + TAG_BYTES

# What a packet is for: a datagram cannot be replayed as a stream or offload request or reply, nor the other way round.
KIND_DATAGRAM = 1
KIND_STREAM_REQUEST = 2
KIND_STREAM_REPLY = 3
# An offload hop (edgerun.offload): a frame sent to a helper and its detections back.
KIND_OFFLOAD_REQUEST = 4
KIND_OFFLOAD_REPLY = 5
_KINDS = (KIND_DATAGRAM, KIND_STREAM_REQUEST, KIND_STREAM_REPLY, KIND_OFFLOAD_REQUEST, KIND_OFFLOAD_REPLY)

# Reasons open() gives, so a transport can count drops by reason.
REASONS = ("short", "version", "kind", "header", "forged", "replay", "stale")


class KeyringError(ValueError):
    """A key file or a key is unusable, or a packet was rejected; ``reason`` is a short word to count by."""

    def __init__(self, message: str, reason: str = "key") -> None:
        super().__init__(message)
        self.reason = reason


def generate_key() -> bytes:
    """A new random swarm key."""
    return secrets.token_bytes(KEY_BYTES)


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode("ascii")


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise KeyringError(f"a swarm key must be {KEY_BYTES} bytes, got {size}")
    return bytes(key)


class _SenderWindow:
    """Counters accepted from one sender: the highest, and those inside the reorder window (bounded)."""

    __slots__ = ("highest", "floor", "seen", "order")

    def __init__(self) -> None:
        self.highest = 0
        self.floor = 0  # everything at or below is rejected (raised when the seen set overflows)
        self.seen: set[int] = set()
        self.order: deque[int] = deque()


class Keyring:
    """The swarm's keys (the first is primary) and the per-sender replay state of this receiver."""

    def __init__(
        self,
        keys: list[bytes],
        *,
        reorder_window_s: float = 15.0,
        max_age_s: float = 60.0,
        max_senders: int = 4096,
        max_seen_per_sender: int = 4096,
    ) -> None:
        if not keys:
            raise KeyringError("a keyring needs at least one key")
        self._keys: list[bytes] = []
        for key in keys:
            key = _check_key(key)
            if key not in self._keys:
                self._keys.append(key)
        self._window_us = int(reorder_window_s * 1e6)
        self._max_age_us = int(max_age_s * 1e6)
        self._max_senders = max_senders
        self._max_seen = max_seen_per_sender
        self._senders: OrderedDict[str, _SenderWindow] = OrderedDict()
        self._last_counter = 0

    # -- key files ---------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> Keyring:
        """Reads a key file: one base64 key per line, the first is primary; blank lines and # comments ignored.

        ``options`` are the Keyring's own keyword arguments (reorder_window_s, max_age_s ...).
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            raise KeyringError(f"{path}: swarm key file not found", "file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyringError(f"{path}: cannot read swarm key file: {exc}", "file") from None
        keys: list[bytes] = []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                key = base64.b64decode(line, validate=True)
            except (binascii.Error, ValueError):
                raise KeyringError(f"{path}:{number}: not a base64 key", "file") from None
            if len(key) != KEY_BYTES:
                raise KeyringError(f"{path}:{number}: key is {len(key)} bytes, a swarm key is {KEY_BYTES}", "file")
            keys.append(key)
        if not keys:
            raise KeyringError(f"{path}: swarm key file holds no key", "file")
        return cls(keys, **options)

    def save(self, path: str | Path) -> None:
        """Writes the keys (primary first) readable by the owner only."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.writelines(encode_key(key) + "\n" for key in self._keys)

    # -- rotation ----------------------------------------------------------------------------------------------

    @property
    def keys(self) -> list[bytes]:
        return list(self._keys)

    @property
    def primary(self) -> bytes:
        return self._keys[0]

    def install(self, key: bytes) -> None:
        """Accepts packets sealed with ``key`` from now on (the primary still seals)."""
        key = _check_key(key)
        if key not in self._keys:
            self._keys.append(key)

    def use(self, key: bytes) -> None:
        """Makes an installed key the primary."""
        key = _check_key(key)
        if key not in self._keys:
            raise KeyringError("cannot use a key that is not installed")
        self._keys.remove(key)
        self._keys.insert(0, key)

    def remove(self, key: bytes) -> None:
        """Stops accepting ``key``; the primary cannot be removed."""
        key = _check_key(key)
        if key == self._keys[0]:
            raise KeyringError("cannot remove the primary key; use another key first")
        if key in self._keys:
            self._keys.remove(key)

    # -- packets -----------------------------------------------------------------------------------------------

    def seal(self, sender: str, plaintext: bytes, now_wall: float, *, kind: int = KIND_DATAGRAM) -> bytes:
        name = sender.encode("utf-8")
        if not name or len(name) > MAX_SENDER_BYTES:
            raise KeyringError(f"sender name must be 1..{MAX_SENDER_BYTES} bytes of UTF-8")
        counter = max(self._last_counter + 1, int(now_wall * 1e6))
        self._last_counter = counter
        header = bytes((VERSION, kind, len(name))) + name + counter.to_bytes(_COUNTER_BYTES, "big")
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, header, nonce, self._keys[0])
        return header + nonce + sealed

    def open(self, packet: bytes, now_wall: float, *, kind: int = KIND_DATAGRAM) -> tuple[str, bytes]:
        """Returns (sender, plaintext) or raises KeyringError whose reason is one of REASONS."""
        if len(packet) < _MIN_PACKET:
            raise KeyringError(f"packet of {len(packet)} bytes is shorter than an envelope", "short")
        if packet[0] != VERSION:
            raise KeyringError(f"envelope version {packet[0]} is not {VERSION}", "version")
        if packet[1] != kind:
            raise KeyringError(f"envelope kind {packet[1]} where {kind} was expected", "kind")
        name_len = packet[2]
        if name_len == 0 or name_len > MAX_SENDER_BYTES:
            raise KeyringError(f"sender name length {name_len} out of range", "header")
        header_end = _FIXED_HEADER + name_len + _COUNTER_BYTES
        if len(packet) < header_end + NONCE_BYTES + TAG_BYTES:
            raise KeyringError("packet shorter than its header says", "short")
        header = bytes(packet[:header_end])
        nonce = bytes(packet[header_end : header_end + NONCE_BYTES])
        sealed = bytes(packet[header_end + NONCE_BYTES :])
        plaintext = None
        for key in self._keys:
            try:
                plaintext = bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(sealed, header, nonce, key)
                break
            except CryptoError:
                continue
        if plaintext is None:
            raise KeyringError("no installed key opens the packet", "forged")
        try:
            sender = header[_FIXED_HEADER : _FIXED_HEADER + name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise KeyringError("sender name is not UTF-8", "header") from None
        counter = int.from_bytes(header[header_end - _COUNTER_BYTES : header_end], "big")
        self._accept_counter(sender, counter, int(now_wall * 1e6))
        return sender, plaintext

    def _accept_counter(self, sender: str, counter: int, now_us: int) -> None:
        if abs(now_us - counter) > self._max_age_us:
            raise KeyringError(f"packet from {sender} is {abs(now_us - counter) / 1e6:.1f} s off this clock", "stale")
        window = self._senders.get(sender)
        if window is None:
            window = _SenderWindow()
            self._senders[sender] = window
            if len(self._senders) > self._max_senders:
                self._senders.popitem(last=False)
        else:
            self._senders.move_to_end(sender)
        if counter <= window.floor or counter <= window.highest - self._window_us or counter in window.seen:
            raise KeyringError(f"packet from {sender} was already accepted or is too old", "replay")
        window.seen.add(counter)
        window.order.append(counter)
        if counter > window.highest:
            window.highest = counter
        low = window.highest - self._window_us
        while window.order and (window.order[0] <= low or len(window.order) > self._max_seen):
            old = window.order.popleft()
            window.seen.discard(old)
            if old > low:
                window.floor = max(window.floor, old)  # forgotten inside the window: reject it and all below

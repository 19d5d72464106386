"""The offload hop's wire: a frame sent to a helper and its detections back, in one place.

One persistent TCP connection per (origin, helper), full duplex; every frame is ``length(4, big endian) |
envelope`` and the envelope is the swarm keyring's (``swarm.keyring``: XChaCha20-Poly1305, sender, replay
counter) of kind ``KIND_OFFLOAD_REQUEST`` or ``KIND_OFFLOAD_REPLY``, so a gossip packet can never be replayed as
an offload request or reply. Inside is one msgpack array: ``InferRequest`` or ``InferReply``.

TCP and not UDP: a model-size JPEG is 5-20 KB, 4-13 IP packets on a 1500 MTU mesh (docs/offload.md). As
datagrams, one lost fragment loses the frame (10 % loss: 0.9^10, about a third of the frames arrive); TCP
repairs a lost segment within about one round trip and pipelines frames in its window, and the per-frame
deadline bounds what a stall costs.

Untrusted bytes: the length prefix is checked before a byte of the body is read, the envelope is opened before
the plaintext is looked at, and every field is bounded by the Structs' own constraints. Parsing raises
``OffloadProtocolError`` whose ``reason`` is one short word to count by; the client and server drop and count,
never let it reach the loop.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated

import msgspec
import numpy as np

from edgerun.types import Detections
from swarm.keyring import KIND_OFFLOAD_REPLY, KIND_OFFLOAD_REQUEST, Keyring, KeyringError

LENGTH_BYTES = 4
MAX_REQUEST_BYTES = 2 << 20  # a 640 x 640 input that zstd cannot shrink (1.2 MB) fits
MAX_REPLY_BYTES = 256 << 10  # 1000 BlazeFace faces (6 keypoints) are 72 KB; detections_to_reply trims to fit
MAX_IMAGE_SIDE = 4096
MAX_DETECTIONS = 1000
MAX_KEYPOINTS = 64
MAX_BUDGET_MS = 60_000  # a frame older than a minute is no longer worth sending
CODECS = ("jpeg", "zstd")
STATUSES = ("ok", "busy", "expired", "model", "error", "bad")
_REPLY_SLACK = 1024  # the envelope (at most 131 bytes) and the msgpack array around the arrays
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

_Id = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Side = Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGE_SIDE)]
_Millis = Annotated[float, msgspec.Meta(ge=0.0, le=3_600_000.0)]  # NaN and inf fail both bounds


class OffloadProtocolError(ValueError):
    """A frame or message that breaks the protocol; ``reason`` is a short word to count drops by."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class OffloadError(Exception):
    """An offloaded frame that was not done remotely; ``reason`` says why (the caller serves it locally).

    late, lost, refused, window, protocol (the client's words), or busy, expired, model, error (the helper's)."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


class InferRequest(msgspec.Struct, array_like=True):
    """One frame for the helper: the model-size BGR uint8 image, encoded by ``codec``."""

    id: _Id  # per connection, increasing; the client assigns it
    model: Annotated[str, msgspec.Meta(pattern=r"\A[0-9a-f]{16}\Z")]  # the served model's hash, 16 hex chars
    codec: Annotated[str, msgspec.Meta(max_length=16)]  # one of CODECS; another is answered "bad"
    height: _Side
    width: _Side
    budget_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_BUDGET_MS)]  # time left when sent; 0: already spent
    traceparent: Annotated[str, msgspec.Meta(max_length=55)]  # "" or W3C 00-<trace>-<span>-<flags>
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_REQUEST_BYTES)]


class InferReply(msgspec.Struct, array_like=True):
    """The helper's answer; on "ok" the detections as raw little-endian arrays, normalised to the model input."""

    id: _Id
    status: Annotated[str, msgspec.Meta(max_length=16)]  # one of STATUSES
    boxes: bytes = b""  # float32 n x 4, x1 y1 x2 y2
    scores: bytes = b""  # float32 n
    class_ids: bytes = b""  # int32 n
    keypoints: bytes = b""  # float32 n x k x 2, or empty
    k: Annotated[int, msgspec.Meta(ge=0, le=MAX_KEYPOINTS)] = 0
    infer_ms: _Millis = 0.0  # the helper's engine time
    queue_ms: _Millis = 0.0  # time the request waited on the helper


_request_decoder = msgspec.msgpack.Decoder(InferRequest)
_reply_decoder = msgspec.msgpack.Decoder(InferReply)
_encoder = msgspec.msgpack.Encoder()


def encode_request(request: InferRequest) -> bytes:
    return _encoder.encode(request)


def encode_reply(reply: InferReply) -> bytes:
    return _encoder.encode(reply)


def decode_request(plaintext: bytes) -> InferRequest:
    try:
        return _request_decoder.decode(plaintext)
    except msgspec.DecodeError as exc:
        raise OffloadProtocolError(f"not an offload request: {_field_named(exc, InferRequest)}", "malformed") from None


def decode_reply(plaintext: bytes) -> InferReply:
    try:
        return _reply_decoder.decode(plaintext)
    except msgspec.DecodeError as exc:
        raise OffloadProtocolError(f"not an offload reply: {_field_named(exc, InferReply)}", "malformed") from None


def _field_named(exc: msgspec.DecodeError, struct: type[msgspec.Struct]) -> str:
    """msgspec's message with the array index of an array_like Struct replaced by the field's name."""
    names = struct.__struct_fields__

    def name(match: re.Match[str]) -> str:
        index = int(match.group(1))
        return f"`{names[index]}`" if index < len(names) else match.group(0)

    return re.sub(r"`\$\[(\d+)\]`", name, str(exc), count=1)


def valid_traceparent(value: str) -> bool:
    """A W3C trace context of version 00 (or "" for none)."""
    return value == "" or TRACEPARENT.fullmatch(value) is not None


# -- detections <-> reply ---------------------------------------------------------------------------------------


def detections_to_reply(request_id: int, detections: Detections, infer_ms: float, queue_ms: float) -> InferReply:
    """An "ok" reply carrying ``detections`` (normalised model-input coordinates, as ``Decoder.decode`` returns)."""
    kp = detections.keypoints
    k = 0 if kp is None else int(kp.shape[1])
    fits = min(MAX_DETECTIONS, (MAX_REPLY_BYTES - _REPLY_SLACK) // (24 + 8 * k))
    if len(detections) > fits:
        # The most confident ones: a reply over the bounds would be dropped whole by the origin.
        detections = detections.select(np.argsort(-detections.scores, kind="stable")[:fits])
        kp = detections.keypoints
    return InferReply(
        id=request_id,
        status="ok",
        boxes=np.ascontiguousarray(detections.boxes, "<f4").tobytes(),
        scores=np.ascontiguousarray(detections.scores, "<f4").tobytes(),
        class_ids=np.ascontiguousarray(detections.class_ids, "<i4").tobytes(),
        keypoints=b"" if kp is None else np.ascontiguousarray(kp, "<f4").tobytes(),
        k=k,
        infer_ms=_millis(infer_ms),
        queue_ms=_millis(queue_ms),
    )


def _millis(value: float) -> float:
    return round(min(max(value, 0.0), 3_600_000.0), 3) if math.isfinite(value) else 0.0


def reply_to_detections(reply: InferReply) -> Detections:
    """The detections an "ok" reply carries, checked: one n across the arrays, n <= MAX_DETECTIONS, finite values."""
    if reply.status != "ok":
        raise OffloadProtocolError(f"reply status is {reply.status!r}, not 'ok'", "status")
    if len(reply.scores) % 4:
        raise OffloadProtocolError(f"scores of {len(reply.scores)} bytes are not float32s", "shape")
    n = len(reply.scores) // 4
    if n > MAX_DETECTIONS:
        raise OffloadProtocolError(f"{n} detections, at most {MAX_DETECTIONS}", "shape")
    if len(reply.boxes) != n * 16 or len(reply.class_ids) != n * 4:
        raise OffloadProtocolError(
            f"{n} scores but {len(reply.boxes)} bytes of boxes and {len(reply.class_ids)} of class ids", "shape"
        )
    if len(reply.keypoints) != n * reply.k * 8:
        raise OffloadProtocolError(
            f"{len(reply.keypoints)} bytes of keypoints for {n} detections of {reply.k} keypoints", "shape"
        )
    boxes = np.frombuffer(reply.boxes, "<f4").reshape(n, 4).astype(np.float32)
    scores = np.frombuffer(reply.scores, "<f4").astype(np.float32)
    class_ids = np.frombuffer(reply.class_ids, "<i4").astype(np.int32)
    keypoints = None
    if reply.k:
        keypoints = np.frombuffer(reply.keypoints, "<f4").reshape(n, reply.k, 2).astype(np.float32)
    finite = np.isfinite(boxes).all() and np.isfinite(scores).all()
    if not finite or (keypoints is not None and not np.isfinite(keypoints).all()):
        raise OffloadProtocolError("a box, score or keypoint is not finite", "value")
    # astype copied each array: the caller may map them to source pixels in place.
    return Detections(boxes=boxes, scores=scores, class_ids=class_ids, keypoints=keypoints)


# -- envelopes ----------------------------------------------------------------------------------------------------


def seal_frame(keyring: Keyring, sender: str, plaintext: bytes, now_wall: float, kind: int) -> bytes:
    """``length | envelope`` ready to write."""
    envelope = keyring.seal(sender, plaintext, now_wall, kind=kind)
    return len(envelope).to_bytes(LENGTH_BYTES, "big") + envelope


def open_request(keyring: Keyring, envelope: bytes, now_wall: float) -> tuple[str, InferRequest]:
    """(sender, request) of one received frame body; raises OffloadProtocolError.

    A keyring rejection raises ``EnvelopeRejected`` with the keyring's reason (forged, replay, stale, short ...);
    "malformed" is an authenticated sender's undecodable message."""
    sender, plaintext = open_envelope(keyring, envelope, now_wall, KIND_OFFLOAD_REQUEST)
    return sender, decode_request(plaintext)


def open_reply(keyring: Keyring, envelope: bytes, now_wall: float) -> tuple[str, InferReply]:
    sender, plaintext = open_envelope(keyring, envelope, now_wall, KIND_OFFLOAD_REPLY)
    return sender, decode_reply(plaintext)


class EnvelopeRejected(OffloadProtocolError):
    """The keyring would not open the envelope: forged, replayed, stale or not an envelope at all. The
    connection that carried it is closed."""


def open_envelope(keyring: Keyring, envelope: bytes, now_wall: float, kind: int) -> tuple[str, bytes]:
    """(sender, plaintext); raises EnvelopeRejected with the keyring's reason."""
    try:
        return keyring.open(envelope, now_wall, kind=kind)
    except KeyringError as exc:
        raise EnvelopeRejected(str(exc), exc.reason) from None


# -- framing ------------------------------------------------------------------------------------------------------


class FrameParser:
    """Length-prefixed frames out of a byte stream, read straight into buffers of the declared size (sans-I/O).

    Fits ``asyncio.BufferedProtocol``: ``get_buffer`` is where the next bytes go, ``buffer_updated(n)`` says how
    many came and returns a frame body once one is complete. The prefix is checked against ``max_frame`` and the
    body charged to ``charge`` (a shared budget; False: no room) before a buffer of its size exists, so a peer
    cannot make this side hold more than it declared and was allowed. After a refusal ``error`` names it
    ("oversized", "empty", "budget") and the parser swallows everything that follows.
    """

    __slots__ = ("max_frame", "_charge", "_header", "_body", "_have", "_sink", "error", "charged")

    def __init__(self, max_frame: int, charge: Callable[[int], bool] | None = None) -> None:
        self.max_frame = max_frame
        self._charge = charge
        self._header = bytearray(LENGTH_BYTES)
        self._body: bytearray | None = None
        self._have = 0
        self._sink = bytearray(4096)
        self.error: str | None = None
        self.charged = 0  # the body being read (given back by the owner when the frame is done)

    @property
    def in_frame(self) -> bool:
        """Part of a frame has arrived (the prefix started or a body is being read)."""
        return self._body is not None or self._have > 0

    def get_buffer(self) -> memoryview:
        if self.error is not None:
            return memoryview(self._sink)
        target = self._header if self._body is None else self._body
        return memoryview(target)[self._have :]

    def buffer_updated(self, nbytes: int) -> bytes | None:
        if self.error is not None:
            return None
        self._have += nbytes
        if self._body is None:
            if self._have < LENGTH_BYTES:
                return None
            length = int.from_bytes(self._header, "big")
            self._have = 0
            if length == 0:
                self.error = "empty"
                return None
            if length > self.max_frame:
                self.error = "oversized"
                return None
            if self._charge is not None and not self._charge(length):
                self.error = "budget"
                return None
            self.charged = length
            self._body = bytearray(length)
            return None
        if self._have < len(self._body):
            return None
        body, self._body, self._have = bytes(self._body), None, 0
        return body

    def feed(self, data: bytes) -> list[bytes]:
        """The frames completed by ``data`` (copies it through ``get_buffer``; for tests and simple callers).

        Stops at the first refusal (``error`` set); the rest of ``data`` is ignored."""
        frames = []
        view = memoryview(data)
        while view and self.error is None:
            buffer = self.get_buffer()
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            view = view[n:]
            frame = self.buffer_updated(n)
            if frame is not None:
                frames.append(frame)
        return frames

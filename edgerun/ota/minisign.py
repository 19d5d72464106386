"""minisign's key and signature files, with Ed25519 from libsodium (pynacl).

An operator can sign a release with ``minisign -S`` on an offline laptop and
the node verifies it; ``minisign -V`` verifies what ``edgerun ota sign`` wrote.
The formats (https://jedisct1.github.io/minisign/), each a comment line and a
base64 line:

* public key: ``"Ed" | key id (8) | public key (32)``
* secret key: ``"Ed" | kdf ("Sc" scrypt, or two zero bytes: not encrypted) | "B2" |
  salt (32) | opslimit (8, LE) | memlimit (8, LE) | key id (8) | secret key (64) |
  checksum (32, BLAKE2b-256 of "Ed" | key id | secret key)``; with scrypt, the
  last 104 bytes are XORed with a key stream derived from the password.
* signature: ``"ED" | key id | Ed25519(BLAKE2b-512(file))`` (prehashed, minisign's
  default since 0.11) or legacy ``"Ed" | key id | Ed25519(file)``, then the line
  ``trusted comment: ...`` and ``Ed25519(signature | trusted comment)``.

A ``.minisig`` file here may hold several signatures one after another (k-of-n
signing); ``minisign -V`` checks the first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import nacl.exceptions
import nacl.signing

from edgerun.ota.errors import SignatureError

ALG_LEGACY = b"Ed"
ALG_PREHASHED = b"ED"
KDF_SCRYPT = b"Sc"
KDF_NONE = b"\0\0"
CHK_BLAKE2B = b"B2"
UNTRUSTED_PREFIX = "untrusted comment: "
TRUSTED_PREFIX = "trusted comment: "
KEY_ID_LEN = 8
PUBLIC_KEY_BLOB = 2 + KEY_ID_LEN + 32
SECRET_KEY_BLOB = 2 + 2 + 2 + 32 + 8 + 8 + KEY_ID_LEN + 64 + 32
SIGNATURE_BLOB = 2 + KEY_ID_LEN + 64
TRUSTED_COMMENT_MAX = 8192  # minisign's TRUSTEDCOMMENTMAXBYTES, with its prefix
MAX_FILE = 64 * 1024  # no key or signature file we accept is anywhere near this
SCRYPT_OPSLIMIT = 33554432  # minisign's crypto_pwhash_scryptsalsa208sha256_OPSLIMIT_SENSITIVE
SCRYPT_MEMLIMIT = 1073741824


def _b64(line: str, size: int, what: str) -> bytes:
    try:
        raw = base64.b64decode(line.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(f"{what}: not base64") from None
    if len(raw) != size:
        raise SignatureError(f"{what}: expected {size} bytes, got {len(raw)}")
    return raw


def _lines(text: str, what: str) -> list[str]:
    if len(text) > MAX_FILE:
        raise SignatureError(f"{what}: larger than {MAX_FILE} bytes")
    return [line.rstrip("\r") for line in text.split("\n")]


def key_id_hex(key_id: bytes) -> str:
    """How minisign prints a key id: the 8 bytes as a little-endian number in hex."""
    return f"{int.from_bytes(key_id, 'little'):016X}"


@dataclass(frozen=True)
class PublicKey:
    key_id: bytes
    key: bytes
    comment: str = field(default="", compare=False)

    @property
    def id_hex(self) -> str:
        return key_id_hex(self.key_id)

    @classmethod
    def parse(cls, text: str, what: str = "public key") -> PublicKey:
        """A public key file, or just its base64 line (``minisign -P``)."""
        lines = [line for line in _lines(text, what) if line.strip()]
        comment = ""
        if lines and lines[0].startswith(UNTRUSTED_PREFIX):
            comment = lines.pop(0)[len(UNTRUSTED_PREFIX) :]
        if not lines:
            raise SignatureError(f"{what}: no key line")
        raw = _b64(lines[0], PUBLIC_KEY_BLOB, what)
        if raw[:2] != ALG_LEGACY:
            raise SignatureError(f"{what}: unsupported algorithm {raw[:2]!r}")
        return cls(raw[2:10], raw[10:], comment)

    @classmethod
    def load(cls, path: str | Path) -> PublicKey:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise SignatureError(f"{path}: cannot read public key ({err.strerror})") from None
        except UnicodeDecodeError:
            raise SignatureError(f"{path}: not a minisign public key") from None
        return cls.parse(text, str(path))

    def line(self) -> str:
        return base64.b64encode(ALG_LEGACY + self.key_id + self.key).decode()

    def to_text(self) -> str:
        return f"{UNTRUSTED_PREFIX}minisign public key {self.id_hex}\n{self.line()}\n"

    def verify_raw(self, signature: bytes, message: bytes) -> bool:
        try:
            nacl.signing.VerifyKey(self.key).verify(message, signature)
        except (nacl.exceptions.BadSignatureError, ValueError):
            return False
        return True


@dataclass(frozen=True)
class SecretKey:
    key_id: bytes
    secret: bytes  # libsodium's 64-byte form: seed | public key

    @property
    def public_key(self) -> PublicKey:
        return PublicKey(self.key_id, self.secret[32:])

    @classmethod
    def generate(cls) -> SecretKey:
        signing = nacl.signing.SigningKey.generate()
        return cls(os.urandom(KEY_ID_LEN), bytes(signing) + bytes(signing.verify_key))

    def _checksum(self) -> bytes:
        return hashlib.blake2b(ALG_LEGACY + self.key_id + self.secret, digest_size=32).digest()

    @classmethod
    def parse(cls, text: str, password: bytes | None = None, what: str = "secret key") -> SecretKey:
        lines = [line for line in _lines(text, what) if line.strip()]
        if len(lines) < 2 or not lines[0].startswith(UNTRUSTED_PREFIX):
            raise SignatureError(f"{what}: not a minisign secret key")
        raw = _b64(lines[1], SECRET_KEY_BLOB, what)
        if raw[:2] != ALG_LEGACY or raw[4:6] != CHK_BLAKE2B:
            raise SignatureError(f"{what}: unsupported algorithm")
        kdf, salt = raw[2:4], raw[6:38]
        ops, mem = int.from_bytes(raw[38:46], "little"), int.from_bytes(raw[46:54], "little")
        body = raw[54:]
        if kdf == KDF_SCRYPT:
            if password is None:
                raise SignatureError(f"{what}: encrypted; a password is needed")
            body = bytes(a ^ b for a, b in zip(body, _scrypt_stream(password, salt, ops, mem)))
        elif kdf != KDF_NONE:
            raise SignatureError(f"{what}: unsupported key derivation {kdf!r}")
        key = cls(body[:8], body[8:72])
        checksum = body[72:104]
        # minisign 0.11 writes an all-zero checksum for keys made with -W (no password).
        if checksum != key._checksum() and not (kdf == KDF_NONE and checksum == bytes(32)):
            raise SignatureError(f"{what}: checksum mismatch (wrong password or damaged key)")
        if bytes(nacl.signing.SigningKey(key.secret[:32]).verify_key) != key.secret[32:]:
            raise SignatureError(f"{what}: public half does not match the secret half")
        return key

    @classmethod
    def load(cls, path: str | Path, password: bytes | None = None) -> SecretKey:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise SignatureError(f"{path}: cannot read secret key ({err.strerror})") from None
        except UnicodeDecodeError:
            raise SignatureError(f"{path}: not a minisign secret key") from None
        return cls.parse(text, password, str(path))

    def to_text(self, password: bytes | None = None) -> str:
        body = self.key_id + self.secret + self._checksum()
        if password is None:
            head = ALG_LEGACY + KDF_NONE + CHK_BLAKE2B + bytes(32) + bytes(16)
            comment = "minisign secret key (not encrypted)"
        else:
            salt = os.urandom(32)
            stream = _scrypt_stream(password, salt, SCRYPT_OPSLIMIT, SCRYPT_MEMLIMIT)
            body = bytes(a ^ b for a, b in zip(body, stream))
            head = (
                ALG_LEGACY
                + KDF_SCRYPT
                + CHK_BLAKE2B
                + salt
                + SCRYPT_OPSLIMIT.to_bytes(8, "little")
                + SCRYPT_MEMLIMIT.to_bytes(8, "little")
            )
            comment = "minisign encrypted secret key"
        return f"{UNTRUSTED_PREFIX}{comment}\n{base64.b64encode(head + body).decode()}\n"

    def sign(
        self,
        data: bytes,
        trusted_comment: str | None = None,
        untrusted_comment: str = "signature from minisign secret key",
        prehash: bool = True,
    ) -> Signature:
        """Sign ``data``; prehashed (BLAKE2b-512) like ``minisign -S``, or legacy like ``-S -l``."""
        if trusted_comment is None:
            trusted_comment = f"timestamp:{int(time.time())}"
        _check_comment(trusted_comment, "trusted comment")
        _check_comment(untrusted_comment, "untrusted comment")
        signing = nacl.signing.SigningKey(self.secret[:32])
        message = _prehash(data) if prehash else data
        sig = signing.sign(message).signature
        global_sig = signing.sign(sig + trusted_comment.encode("utf-8")).signature
        return Signature(
            ALG_PREHASHED if prehash else ALG_LEGACY, self.key_id, sig, trusted_comment, global_sig, untrusted_comment
        )


def _scrypt_stream(password: bytes, salt: bytes, opslimit: int, memlimit: int) -> bytes:
    import nacl.pwhash.scrypt

    try:
        return nacl.pwhash.scrypt.kdf(104, password, salt, opslimit=opslimit, memlimit=memlimit)
    except Exception as err:  # pynacl raises several types for out-of-range limits
        raise SignatureError(f"secret key: cannot derive the key from the password ({err})") from None


def _prehash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=64).digest()


def _check_comment(comment: str, what: str) -> None:
    if "\n" in comment or "\r" in comment:
        raise SignatureError(f"{what}: must be one line")
    if len(comment.encode("utf-8")) >= TRUSTED_COMMENT_MAX - len(TRUSTED_PREFIX):
        raise SignatureError(f"{what}: too long")


@dataclass(frozen=True)
class Signature:
    algorithm: bytes  # ALG_PREHASHED or ALG_LEGACY
    key_id: bytes
    signature: bytes
    trusted_comment: str
    global_signature: bytes
    untrusted_comment: str = ""

    @property
    def key_id_hex(self) -> str:
        return key_id_hex(self.key_id)

    def to_text(self) -> str:
        blob = base64.b64encode(self.algorithm + self.key_id + self.signature).decode()
        return (
            f"{UNTRUSTED_PREFIX}{self.untrusted_comment}\n{blob}\n"
            f"{TRUSTED_PREFIX}{self.trusted_comment}\n{base64.b64encode(self.global_signature).decode()}\n"
        )

    def verify(self, data: bytes, key: PublicKey) -> None:
        """Raise SignatureError unless this signs ``data`` and its trusted comment with ``key``."""
        if key.key_id != self.key_id:
            raise SignatureError(f"signature is by key {self.key_id_hex}, not {key.id_hex}")
        message = _prehash(data) if self.algorithm == ALG_PREHASHED else data
        if not key.verify_raw(self.signature, message):
            raise SignatureError(f"signature by key {self.key_id_hex} does not match the file")
        if not key.verify_raw(self.global_signature, self.signature + self.trusted_comment.encode("utf-8")):
            raise SignatureError(f"trusted comment signed by key {self.key_id_hex} was altered")


def parse_signatures(text: str, what: str = "signature") -> list[Signature]:
    """Every signature in a ``.minisig`` file (one, or several concatenated)."""
    lines = [line for line in _lines(text, what) if line.strip()]
    if not lines:
        raise SignatureError(f"{what}: empty")
    if len(lines) % 4:
        raise SignatureError(f"{what}: expected 4 lines per signature, got {len(lines)} lines")
    out = []
    for i in range(0, len(lines), 4):
        untrusted, blob_line, trusted, global_line = lines[i : i + 4]
        if not untrusted.startswith(UNTRUSTED_PREFIX):
            raise SignatureError(f"{what}: line {i + 1} should start with {UNTRUSTED_PREFIX!r}")
        if not trusted.startswith(TRUSTED_PREFIX):
            raise SignatureError(f"{what}: line {i + 3} should start with {TRUSTED_PREFIX!r}")
        blob = _b64(blob_line, SIGNATURE_BLOB, what)
        if blob[:2] not in (ALG_PREHASHED, ALG_LEGACY):
            raise SignatureError(f"{what}: unsupported signature algorithm {blob[:2]!r}")
        comment = trusted[len(TRUSTED_PREFIX) :]
        _check_comment(comment, f"{what}: trusted comment")
        out.append(
            Signature(
                blob[:2],
                blob[2:10],
                blob[10:],
                comment,
                _b64(global_line, 64, what),
                untrusted[len(UNTRUSTED_PREFIX) :],
            )
        )
    return out


def comment_fields(comment: str) -> dict[str, str]:
    """``key:value`` pairs of a trusted comment, split on tabs or spaces (minisign uses tabs)."""
    fields = {}
    for token in comment.replace("\t", " ").split(" "):
        key, sep, value = token.partition(":")
        if sep and key:
            fields[key] = value
    return fields

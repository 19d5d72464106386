"""Signed model releases for MCU nodes, in the same minisign format as the node's own OTA releases.

An MCU cannot parse JSON, so its manifest is 64 fixed bytes (``firmware_mcu/include/modelslot.h``)::

    "EMM1" | model_version:u32 | image_size:u32 | flags:u32 | image_sha256[32] | model_name[16]

``manifest.bin`` is signed with a release key exactly as ``edgerun ota sign`` / ``minisign -S`` sign a
file (prehashed Ed25519, trusted comment naming the model and version), so ``minisign -Vm manifest.bin``
verifies it too. The node checks the whole minisign signature, the trusted comment and the image hash;
the MCU checks the same Ed25519 signature (``crypto_sign_verify_detached`` over BLAKE2b-512 of the
manifest) and hashes the image it stored.

A release directory holds ``manifest.bin``, ``manifest.bin.minisig`` and ``image.bin``.
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from edgerun.ota.errors import Rejected, SignatureError
from edgerun.ota.minisign import ALG_PREHASHED, PublicKey, SecretKey, Signature, comment_fields, parse_signatures
from edgerun.ota.store import atomic_write

MANIFEST = struct.Struct("<4sIII32s16s")
MAGIC = b"EMM1"
MAX_IMAGE = 16 * 1024 * 1024  # far above any MCU flash; a cap before anything is read
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,15}$")
MANIFEST_FILE = "manifest.bin"
SIGNATURE_FILE = "manifest.bin.minisig"
IMAGE_FILE = "image.bin"


@dataclass(frozen=True)
class McuManifest:
    name: str
    version: int
    size: int
    sha256: bytes

    def encode(self) -> bytes:
        return MANIFEST.pack(MAGIC, self.version, self.size, 0, self.sha256, self.name.encode("ascii"))

    @classmethod
    def parse(cls, data: bytes, what: str = MANIFEST_FILE) -> McuManifest:
        if len(data) != MANIFEST.size:
            raise Rejected("malformed", f"{what}: {len(data)} bytes, expected {MANIFEST.size}")
        magic, version, size, flags, sha, name = MANIFEST.unpack(data)
        if magic != MAGIC:
            raise Rejected("malformed", f"{what}: magic {magic!r}, expected {MAGIC!r}")
        if version < 1 or size < 1 or flags != 0:
            raise Rejected(
                "malformed", f"{what}: version {version}, size {size}, flags {flags}: expected >= 1, >= 1, 0"
            )
        try:
            text = name.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise Rejected("malformed", f"{what}: model name is not ASCII") from None
        return cls(text, version, size, sha)

    def trusted_comment(self, timestamp: int) -> str:
        return f"timestamp:{timestamp}\tfile:{MANIFEST_FILE}\tname:{self.name}\tversion:{self.version}"


@dataclass(frozen=True)
class McuRelease:
    """A release the node verified: what it relays to the MCU."""

    manifest: McuManifest
    manifest_bytes: bytes
    signature: Signature
    image: bytes

    @property
    def key_id(self) -> bytes:
        return self.signature.key_id


def build_mcu_release(image: bytes, name: str, version: int, out_dir: str | Path, key: SecretKey) -> Path:
    """Write ``out_dir/`` with the image, its manifest and the manifest's minisign signature."""
    if not NAME_RE.match(name):
        raise Rejected("config", f"MCU model name {name!r}: 1-16 characters of A-Z a-z 0-9 . _ -")
    if not 1 <= version <= 0xFFFFFFFF:
        raise Rejected("config", f"MCU model version {version}: expected 1..4294967295")
    if not 1 <= len(image) <= MAX_IMAGE:
        raise Rejected("config", f"MCU image: {len(image)} bytes, expected 1..{MAX_IMAGE}")
    manifest = McuManifest(name, version, len(image), hashlib.sha256(image).digest())
    data = manifest.encode()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sig = key.sign(data, manifest.trusted_comment(int(time.time())), prehash=True)
    atomic_write(out / IMAGE_FILE, image)
    atomic_write(out / MANIFEST_FILE, data)
    atomic_write(out / SIGNATURE_FILE, sig.to_text().encode())
    return out


def _read(path: Path, limit: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise Rejected("malformed", f"{path}: {size} bytes, at most {limit}")
        return path.read_bytes()
    except OSError as err:
        raise Rejected("malformed", f"{path}: cannot read ({err.strerror})") from None


def verify_mcu_release(directory: str | Path, keys: list[PublicKey]) -> McuRelease:
    """Check a release directory against the trusted release keys; raises ``Rejected`` naming what is wrong."""
    root = Path(directory)
    data = _read(root / MANIFEST_FILE, MANIFEST.size)
    text = _read(root / SIGNATURE_FILE, 64 * 1024).decode("utf-8", "replace")
    try:
        sigs = parse_signatures(text, str(root / SIGNATURE_FILE))
    except SignatureError as err:
        raise Rejected("bad_signature", str(err)) from None
    trusted = {k.key_id: k for k in keys}
    chosen: Signature | None = None
    why = ("unknown_key", f"{root / SIGNATURE_FILE}: signed by no trusted key")
    for sig in sigs:
        key = trusted.get(sig.key_id)
        if key is None:
            continue
        if sig.algorithm != ALG_PREHASHED:
            why = ("bad_signature", f"{root / SIGNATURE_FILE}: legacy signature; the MCU verifies prehashed (ED) only")
            continue
        try:
            sig.verify(data, key)
        except SignatureError as err:
            why = ("bad_signature", f"{root / MANIFEST_FILE}: {err}")
            continue
        chosen = sig
        break
    if chosen is None:
        raise Rejected(*why)
    manifest = McuManifest.parse(data, str(root / MANIFEST_FILE))
    fields = comment_fields(chosen.trusted_comment)
    if fields.get("name") != manifest.name or fields.get("version") != str(manifest.version):
        raise Rejected(
            "bad_signature",
            f"{root / SIGNATURE_FILE}: trusted comment says {fields.get('name')} v{fields.get('version')}, "
            f"the manifest {manifest.name} v{manifest.version}",
        )
    image = _read(root / IMAGE_FILE, MAX_IMAGE)
    if len(image) != manifest.size or hashlib.sha256(image).digest() != manifest.sha256:
        raise Rejected("hash_mismatch", f"{root / IMAGE_FILE}: does not match the signed size and SHA-256")
    return McuRelease(manifest, data, chosen, image)


def main(argv: list[str] | None = None) -> int:
    """``python -m edgerun.mcu.release IMAGE --name N --version V --key release.key --out DIR``."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m edgerun.mcu.release", description="sign an MCU model release")
    parser.add_argument("image", help="the model image the MCU stores (e.g. an int8 .tflite)")
    parser.add_argument("--name", required=True, help="model name, at most 16 characters")
    parser.add_argument("--version", type=int, required=True, help="model version; must be above the MCU's")
    parser.add_argument("--key", required=True, help="minisign secret key of a release key")
    parser.add_argument("--out", required=True, help="release directory to write")
    parser.add_argument("--password-env", help="the secret key's password is in this variable")
    args = parser.parse_args(argv)
    try:
        password = None
        if args.password_env:
            if args.password_env not in os.environ:
                raise SignatureError(f"--password-env {args.password_env}: the variable is not set")
            password = os.environ[args.password_env].encode()
        key = SecretKey.load(args.key, password)
        out = build_mcu_release(Path(args.image).read_bytes(), args.name, args.version, args.out, key)
    except (OSError, SignatureError, Rejected) as err:
        print(f"edgerun.mcu.release: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

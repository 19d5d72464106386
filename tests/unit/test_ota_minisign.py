"""minisign formats: round trips, malformed input, and interop with Debian's ``minisign`` both ways."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from edgerun.ota import minisign
from edgerun.ota.errors import SignatureError
from edgerun.ota.minisign import PublicKey, SecretKey, comment_fields, parse_signatures

MINISIGN = shutil.which("minisign")
needs_minisign = pytest.mark.skipif(MINISIGN is None, reason="minisign not installed (make system-deps)")


def test_sign_verify_round_trip_prehashed_and_legacy():
    key = SecretKey.generate()
    data = b"model bytes" * 100
    for prehash in (True, False):
        sig = key.sign(data, "name:m\tversion:3", prehash=prehash)
        (parsed,) = parse_signatures(sig.to_text())
        assert parsed == sig
        parsed.verify(data, key.public_key)
        with pytest.raises(SignatureError, match="does not match the file"):
            parsed.verify(data + b"!", key.public_key)
    assert comment_fields("timestamp:1\tname:m version:3") == {"timestamp": "1", "name": "m", "version": "3"}


def test_altered_trusted_comment_is_refused():
    key = SecretKey.generate()
    text = key.sign(b"x", "version:3").to_text().replace("version:3", "version:4")
    (sig,) = parse_signatures(text)
    with pytest.raises(SignatureError, match="trusted comment .* was altered"):
        sig.verify(b"x", key.public_key)


def test_key_files_round_trip_and_checks(monkeypatch):
    key = SecretKey.generate()
    assert SecretKey.parse(key.to_text()) == key
    assert PublicKey.parse(key.public_key.to_text()) == key.public_key
    assert PublicKey.parse(key.public_key.line()) == key.public_key  # minisign -P form
    # Encrypted keys (scrypt), with small limits so the test is quick.
    monkeypatch.setattr(minisign, "SCRYPT_OPSLIMIT", 524288)
    monkeypatch.setattr(minisign, "SCRYPT_MEMLIMIT", 16777216)
    text = key.to_text(b"hunter2")
    assert SecretKey.parse(text, b"hunter2") == key
    with pytest.raises(SignatureError, match="wrong password"):
        SecretKey.parse(text, b"wrong")
    with pytest.raises(SignatureError, match="a password is needed"):
        SecretKey.parse(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "signature: empty"),
        ("untrusted comment: x\nAAAA\n", "expected 4 lines per signature"),
        ("bad\nAAAA\ntrusted comment: x\nAAAA\n", "should start with 'untrusted comment: '"),
        ("untrusted comment: x\n!!!\ntrusted comment: x\nAAAA\n", "not base64"),
        ("untrusted comment: x\nAAAA\ntrusted comment: x\nAAAA\n", "expected 74 bytes, got 3"),
    ],
)
def test_malformed_signatures_say_what_is_wrong(text, message):
    with pytest.raises(SignatureError, match=message):
        parse_signatures(text)


def test_oversized_input_is_refused_before_parsing():
    with pytest.raises(SignatureError, match="larger than"):
        parse_signatures("x" * (minisign.MAX_FILE + 1))


@needs_minisign
def test_minisign_verifies_what_we_sign(tmp_path):
    key = SecretKey.generate()
    (tmp_path / "k.pub").write_text(key.public_key.to_text())
    data = tmp_path / "manifest.json"
    data.write_bytes(b'{"name":"m","version":2}')
    for prehash, flag in ((True, []), (False, [])):
        sig = key.sign(data.read_bytes(), "timestamp:1\tname:m\tversion:2", prehash=prehash)
        (tmp_path / "manifest.json.minisig").write_text(sig.to_text())
        out = subprocess.run(
            [MINISIGN, "-V", *flag, "-p", str(tmp_path / "k.pub"), "-m", str(data)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert "Trusted comment: timestamp:1\tname:m\tversion:2" in out.stdout
    # A tampered file fails there too.
    data.write_bytes(b'{"name":"m","version":3}')
    out = subprocess.run([MINISIGN, "-V", "-p", str(tmp_path / "k.pub"), "-m", str(data)], capture_output=True)
    assert out.returncode != 0
    # minisign signs with a secret key file we wrote.
    (tmp_path / "k.key").write_text(key.to_text())
    out = subprocess.run(
        [MINISIGN, "-S", "-s", str(tmp_path / "k.key"), "-m", str(data), "-t", "from edgerun key"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    (sig,) = parse_signatures((tmp_path / "manifest.json.minisig").read_text())
    sig.verify(data.read_bytes(), key.public_key)


@needs_minisign
def test_we_verify_what_minisign_signs(tmp_path):
    pub, sec = tmp_path / "m.pub", tmp_path / "m.key"
    out = subprocess.run([MINISIGN, "-G", "-W", "-p", str(pub), "-s", str(sec)], capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    key = PublicKey.load(pub)
    assert SecretKey.load(sec).public_key.key == key.key  # its secret key file reads too
    data = tmp_path / "file"
    data.write_bytes(b"payload" * 1000)
    for legacy in (False, True):
        args = [MINISIGN, "-S", *(["-l"] if legacy else []), "-s", str(sec), "-m", str(data), "-t", "name:m\tversion:7"]
        assert subprocess.run(args, capture_output=True, timeout=30).returncode == 0
        (sig,) = parse_signatures((tmp_path / "file.minisig").read_text())
        assert sig.algorithm == (minisign.ALG_LEGACY if legacy else minisign.ALG_PREHASHED)
        sig.verify(data.read_bytes(), key)
        assert comment_fields(sig.trusted_comment) == {"name": "m", "version": "7"}
        with pytest.raises(SignatureError):
            sig.verify(data.read_bytes() + b"x", key)

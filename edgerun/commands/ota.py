"""``edgerun ota keygen | keys | sign | make-delta | publish | verify | status``.

Release workflow (the root key stays offline)::

    edgerun ota keygen -p root.pub -s root.key            # offline machine; asks for a password; or: minisign -G
    edgerun ota keygen -p release.pub -s release.key --password-env RELEASE_KEY_PASSWORD
    edgerun ota keys --release-key release.pub --version 1 -o rel/keys.json
    edgerun ota sign -s root.key -m rel/keys.json         # or minisign -S (see the printed -t)
    edgerun ota publish --bundle model_v2/ --base model_v1/ -s release.key --to rel/
    edgerun ota verify rel/ --root-key root.pub
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from edgerun.commands.options import (
    add_old_spelling,
    ask_new_password,
    first_stdin_line,
    key_password,
    parse_hostport,
    require_one_spelling,
)
from edgerun.errors import EXIT_NEEDS_OPERATOR
from edgerun.ota.errors import OtaError


class KeygenUsageError(OtaError):
    """No way to get the new secret key's password (a usage error: exit 2)."""

    exit_code = EXIT_NEEDS_OPERATOR


def _new_key_password(args: argparse.Namespace) -> bytes | None:
    """The password a new secret key is encrypted with, like minisign -G: asked twice on a terminal.

    None only with --no-password; without a terminal a password must come from --password-env or
    --password-stdin, so a script never writes an unencrypted key by accident.
    """
    if args.no_password:
        return None
    if args.password_stdin:
        line = first_stdin_line()
        if not line:
            raise KeygenUsageError("ota keygen: --password-stdin: no password on standard input")
        return line.encode()
    if args.password_env:
        password = key_password(args, OtaError)
        if not password:
            raise KeygenUsageError(f"ota keygen: --password-env {args.password_env}: the variable is empty")
        return password
    if not sys.stdin.isatty():
        raise KeygenUsageError(
            "ota keygen: not a terminal: give the secret key's password with --password-env VAR or "
            "--password-stdin, or pass --no-password to write it unencrypted"
        )
    return ask_new_password(
        "Password for the new secret key: ",
        "Password (one more time): ",
        mismatch=KeygenUsageError("ota keygen: the passwords do not match"),
        empty=KeygenUsageError("ota keygen: empty password (pass --no-password to write the key unencrypted)"),
    ).encode()


def cmd_keygen(args: argparse.Namespace) -> int:
    from edgerun.ota.minisign import SecretKey

    pub, sec = Path(args.pubkey), Path(args.signing_key)
    for path in (pub, sec):
        if path.exists() and not args.force:
            raise OtaError(f"{path} exists (use -f to overwrite)")
    password = _new_key_password(args)  # before any file is touched: a refusal leaves nothing behind
    key = SecretKey.generate()
    sec.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(sec, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.to_text(password))
    public = key.public_key
    pub.write_text(public.to_text())
    print(f"key id {public.id_hex}: public key {pub}, secret key {sec}" + ("" if password else " (not encrypted)"))
    print(f"verify with: minisign -Vm <file> -P {public.line()}")
    return 0


def _default_trusted_comment(path: Path, data: bytes) -> str:
    now = int(time.time())
    if path.name == "manifest.json":
        from edgerun.ota.manifest import parse_manifest

        return parse_manifest(data, str(path)).trusted_comment(now)
    if path.name == "keys.json":
        import msgspec

        from edgerun.ota.trust import KeyList, keys_trusted_comment

        return keys_trusted_comment(msgspec.json.decode(data, type=KeyList).version, now)
    return f"timestamp:{now}\tfile:{path.name}"


def cmd_sign(args: argparse.Namespace) -> int:
    from edgerun.ota.minisign import SecretKey, parse_signatures

    key = SecretKey.load(args.signing_key, key_password(args, OtaError))
    path = Path(args.message)
    data = path.read_bytes()
    comment = args.trusted_comment or _default_trusted_comment(path, data)
    sig = key.sign(data, comment, prehash=not args.legacy)
    out = Path(args.sigfile or f"{path}.minisig")
    text = sig.to_text()
    if args.append and out.exists():
        existing = out.read_text()
        others = [s for s in parse_signatures(existing, str(out)) if s.key_id != key.key_id]
        text = "".join(s.to_text() for s in others) + text
    out.write_text(text)
    print(f"signed {path} with key {key.public_key.id_hex} -> {out}; trusted comment: {comment}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from edgerun.ota.minisign import PublicKey
    from edgerun.ota.trust import keys_trusted_comment, make_key_list

    keys = [PublicKey.load(p) for p in args.release_key]
    data = make_key_list(keys, args.version, args.expires_days, args.threshold, tuple(args.revoke))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    comment = keys_trusted_comment(args.version, int(time.time()))
    print(f"wrote {out} (version {args.version}, {len(keys)} release key(s)); sign it with each root key:")
    print(f"  edgerun ota sign -s ROOT.key -m {out} --append")
    print(f"  or: minisign -S -s ROOT.key -m {out} -t '{comment}'")
    return 0


def cmd_make_delta(args: argparse.Namespace) -> int:
    from edgerun.ota.delta import make_best, make_delta
    from edgerun.ota.release import read_payload

    _, old = read_payload(args.old)
    _, new = read_payload(args.new)
    if args.algorithm == "auto":
        choice = make_best(old, new)
        algorithm, patch, sizes = choice.algorithm, choice.patch, choice.sizes
    else:
        patch = make_delta(old, new, args.algorithm)
        algorithm, sizes = args.algorithm, {args.algorithm: len(patch), "full": len(new)}
    report = ", ".join(f"{k} {v} B ({v / len(new):.1%})" for k, v in sizes.items())
    if algorithm == "full" or len(patch) >= len(new):
        print(f"the full payload is smaller than any delta: {report}; no delta written")
        return 0
    Path(args.out).write_bytes(patch)
    print(f"wrote {args.out}: {algorithm}, {len(patch)} bytes; {report}")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from edgerun.ota.minisign import SecretKey
    from edgerun.ota.release import ReleaseSpec, build_release

    if not args.signing_key and not args.unsigned:
        raise OtaError("publish: give -s RELEASE.key, or --unsigned to sign manifest.json yourself with minisign")
    key = SecretKey.load(args.signing_key, key_password(args, OtaError)) if args.signing_key else None
    spec = ReleaseSpec(
        expires_days=args.expires_days,
        boards=args.board,
        min_runtime=args.min_runtime,
        rollout_percent=args.percent,
        rollout_salt=args.salt,
        full=not args.no_full,
        algorithm=args.algorithm,
    )
    from edgerun.progress import phases

    with phases("ota publish", 2 if args.mqtt else 1) as progress:
        progress.step("build the release (payload, delta, signature)")
        release = build_release(args.bundle, args.to, spec, base_path=args.base, key=key)
        if args.mqtt:
            from edgerun.ota.transport_mqtt import publish_release

            progress.step(f"publish to mqtt://{args.mqtt}")
            host, port = parse_hostport(args.mqtt, "--mqtt", 1883)
            publish_release(Path(args.to), release.manifest.name, host, port)
    m = release.manifest
    print(f"{m.name} v{m.version}: {release.directory}")
    if m.target.file:
        print(f"  full payload {m.target.file}: {m.target.size} bytes")
    if m.delta is not None:
        print(
            f"  delta {m.delta.file} ({m.delta.algorithm}) from v{m.delta.base_version}: {m.delta.size} bytes "
            f"({m.delta.size / m.target.size:.1%} of full)"
        )
    if release.note:
        print(f"  {release.note}")
    if key is None:
        comment = m.trusted_comment(int(time.time()))
        print(f"  sign it: minisign -S -s RELEASE.key -m {release.directory / 'manifest.json'} -t '{comment}'")
    if args.mqtt:
        print(f"  published to mqtt://{args.mqtt} edgerun/fleet/releases/{m.name} (retained)")
    return 0


def verify_release(
    root: Path, model: str | None, root_keys: list[str], threshold: int, now: float | None = None
) -> list[str]:
    """Check a release directory as a node would (signatures, expiry, file hashes); returns report lines."""
    from edgerun.ota.payload import sha256_file
    from edgerun.ota.transport_dir import read_offer
    from edgerun.ota.trust import TrustStore
    from edgerun.ota.updater import load_root_keys

    now = time.time() if now is None else now
    trust = TrustStore(load_root_keys(root_keys), threshold)
    models = [model] if model else sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file())
    if not models:
        raise OtaError(f"{root}: no <model>/manifest.json")
    lines = []
    for name in models:
        offer = read_offer(root, name, str(root))
        if offer is None:
            raise OtaError(f"{root / name}: no manifest.json")
        if offer.keys is None or offer.keys_sig is None:
            raise OtaError(f"{root}: keys.json and keys.json.minisig are needed")
        keyring = trust.verify_keys(offer.keys, offer.keys_sig, now, None)
        manifest = trust.verify_manifest(offer.manifest, offer.manifest_sig, keyring)
        if manifest.expires_ts <= now:
            raise OtaError(f"{name}: manifest v{manifest.version} expired at {manifest.expires}")
        lines.append(
            f"{name} v{manifest.version}: signatures OK (keys.json v{keyring.version}), expires {manifest.expires}"
        )
        files = [(manifest.target.file, manifest.target.size, manifest.target.sha256)] if manifest.target.file else []
        if manifest.delta is not None:
            files.append((manifest.delta.file, manifest.delta.size, manifest.delta.sha256))
        for file, size, sha in files:
            path = root / name / file
            if not path.is_file():
                raise OtaError(f"{path}: missing")
            if path.stat().st_size != size or sha256_file(path) != sha:
                raise OtaError(f"{path}: does not match the signed size and sha256")
            lines.append(f"  {file}: {size} bytes, sha256 OK")
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    from edgerun.ota.errors import Rejected

    try:
        lines = verify_release(Path(args.directory), args.model, args.root_key, args.root_threshold)
    except Rejected as err:
        raise OtaError(f"rejected ({err.code}): {err}") from None
    print("\n".join(lines))
    return 0


def status_report(state_dir: Path, check: bool = False) -> dict[str, Any]:
    import msgspec

    from edgerun.ota.store import ModelStore

    store = ModelStore(state_dir)
    inst = store.installed()
    report: dict[str, Any] = {"state_dir": str(state_dir)}
    report["installed"] = None if inst is None else msgspec.to_builtins(inst)
    try:
        report["status"] = json.loads(store.status_path.read_text())
    except (OSError, ValueError):
        report["status"] = None
    report["journal"] = store.journal_records()[-12:]
    if check:
        report["problems"] = store.check()
    return report


def cmd_status(args: argparse.Namespace) -> int:
    from edgerun.ota.store import default_state_dir

    if args.state_dir:
        state_dir = Path(args.state_dir)
    elif args.config:
        from edgerun.config import load_config

        cfg = load_config(args.config)
        state_dir = Path(cfg.ota.state_dir) if cfg.ota.state_dir else default_state_dir()
    else:
        state_dir = default_state_dir()
    report = status_report(state_dir, check=args.check)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        inst = report["installed"]
        if inst is None:
            print(f"{state_dir}: not provisioned")
        else:
            prev = inst.get("previous")
            counter = inst["counter"]
            print(f"{inst['name']} v{inst['version']} in slot {inst['active']} (anti-rollback counter {counter})")
            previous = "none" if not prev else f"v{prev['version']} in slot {prev['slot']}"
            print(f"previous: {previous}; never retried: {inst['rejected'] or 'none'}")
        status = report["status"] or {}
        last = status.get("last")
        if last:
            print(f"updater: {status.get('state', '?')}; last step: {json.dumps(last, sort_keys=True)}")
        for rec in report["journal"][-6:]:
            extra = {k: v for k, v in rec.items() if k in ("version", "slot", "from_version", "reason")}
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["t"]))
            print(f"  {when} txn {rec['txn']} {rec['step']} {json.dumps(extra, sort_keys=True) if extra else ''}")
        if args.check:
            for problem in report["problems"]:
                print(f"problem: {problem}")
    if args.check and report["problems"]:
        return 1
    return 0


def add_ota_parser(sub: Any) -> None:
    ota = sub.add_parser("ota", help="signed over-the-air model updates: keys, releases, status")
    osub = ota.add_subparsers(dest="ota_command", required=True)

    p = osub.add_parser("keygen", help="make a minisign-compatible Ed25519 key pair")
    p.add_argument("-p", "--pubkey", required=True, metavar="FILE", help="write the public key here")
    p.add_argument("-s", "--signing-key", metavar="FILE", help="write the secret (signing) key here (required)")
    add_old_spelling(p, "--seckey", dest="signing_key")  # minisign's name, in scripts written before 0.x
    require_one_spelling(p, "signing_key", "-s/--signing-key")
    p.add_argument("--force", action="store_true", help="overwrite key files that exist")
    add_old_spelling(p, "-f", dest="force", action="store_true")  # minisign's -f, documented before --force
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--password-env", help="encrypt the secret key with the password in this variable (scrypt)")
    secret.add_argument("--password-stdin", action="store_true", help="read that password from the first stdin line")
    secret.add_argument("--no-password", action="store_true", help="write the secret key unencrypted (minisign -W)")
    p.set_defaults(func=cmd_keygen)

    p = osub.add_parser("keys", help="write keys.json: the release keys the root keys vouch for")
    p.add_argument("--release-key", action="append", required=True, help="release public key file (repeat)")
    p.add_argument("--version", type=int, required=True, help="must go up with every change")
    p.add_argument("--threshold", type=int, default=1, help="release signatures a manifest needs")
    p.add_argument("--revoke", action="append", default=[], metavar="KEY_ID", help="revoked key id (repeat)")
    p.add_argument("--expires-days", type=float, default=365.0, help="keys.json is refused after this many days")
    p.add_argument("-o", "--out", metavar="FILE", help="write keys.json here (required)")
    add_old_spelling(p, "--output", dest="out")
    require_one_spelling(p, "out", "-o/--out")
    p.set_defaults(func=cmd_keys)

    p = osub.add_parser("sign", help="sign a file (minisign format; manifest.json/keys.json get their comment)")
    p.add_argument("-s", "--signing-key", metavar="FILE", help="the secret key to sign with (required)")
    add_old_spelling(p, "--seckey", dest="signing_key")
    require_one_spelling(p, "signing_key", "-s/--signing-key")
    p.add_argument("-m", "--message", required=True, metavar="FILE", help="the file to sign")
    p.add_argument(
        "-x",
        "--sigfile",
        default=None,
        metavar="FILE",
        help="write the signature here (default: the signed file's name + .minisig)",
    )
    p.add_argument(
        "-t",
        "--trusted-comment",
        default=None,
        help="signed comment (default: the time and file name; for manifest.json and keys.json their version)",
    )
    p.add_argument("--append", action="store_true", help="add to the signatures already there (k-of-n)")
    p.add_argument("--legacy", action="store_true", help="sign the file itself, not its BLAKE2b hash")
    p.add_argument("--password-env", help="the secret key's password is in this variable")
    p.set_defaults(func=cmd_sign)

    p = osub.add_parser("make-delta", help="bsdiff4 and zstd deltas between two payloads; keeps the smaller")
    p.add_argument("old", help="base bundle directory or payload tar")
    p.add_argument("new", help="new bundle directory or payload tar")
    p.add_argument("-o", "--out", metavar="FILE", help="write the delta here (required)")
    add_old_spelling(p, "--output", dest="out")
    require_one_spelling(p, "out", "-o/--out")
    p.add_argument(
        "--algorithm", choices=["auto", "bsdiff4", "zstd"], default="auto", help="auto: try both, keep the smaller"
    )
    p.set_defaults(func=cmd_make_delta)

    p = osub.add_parser("publish", help="write a release directory (payload, delta, signed manifest)")
    p.add_argument("--bundle", required=True, help="the new bundle (directory or tar)")
    p.add_argument("--to", required=True, help="release directory (USB stick, web root, staging)")
    p.add_argument("--base", default=None, help="the bundle nodes run now: ship a delta from it")
    p.add_argument("-s", "--signing-key", default=None, metavar="FILE", help="release secret key")
    add_old_spelling(p, "--seckey", dest="signing_key")
    p.add_argument("--unsigned", action="store_true", help="leave manifest.json for minisign -S")
    p.add_argument("--no-full", action="store_true", help="ship only the delta")
    p.add_argument(
        "--algorithm", choices=["auto", "bsdiff4", "zstd"], default="auto", help="delta algorithm; auto: the smaller"
    )
    p.add_argument("--expires-days", type=float, default=30.0, help="nodes refuse the release after this many days")
    p.add_argument("--board", action="append", default=[], help="compatible board class (repeat); none: any")
    p.add_argument("--min-runtime", default="0", metavar="VERSION", help="oldest edgerun version that may take it")
    p.add_argument("--percent", type=float, default=100.0, help="share of the fleet that takes the release")
    add_old_spelling(p, "--rollout-percent", dest="percent", type=float)
    p.add_argument("--salt", default="", help="cohort salt: which nodes fall in --percent")
    add_old_spelling(p, "--rollout-salt", dest="salt")
    p.add_argument("--mqtt", metavar="HOST:PORT", default=None, help="also publish it, retained, to this broker")
    p.add_argument("--password-env", help="the secret key's password is in this variable")
    p.set_defaults(func=cmd_publish)

    p = osub.add_parser("verify", help="check a release directory as a node would")
    p.add_argument("directory")
    p.add_argument("--root-key", action="append", required=True, help="root public key file (repeat)")
    p.add_argument("--root-threshold", type=int, default=1, metavar="N", help="root signatures keys.json needs")
    p.add_argument("--model", default=None, help="check only this model's release (default: every model there)")
    p.set_defaults(func=cmd_verify)

    p = osub.add_parser("status", help="the node's model store: active slot, counter, journal, last update")
    p.add_argument("--state-dir", default=None, metavar="DIR", help="the node's ota.state_dir (or give -c)")
    p.add_argument("-c", "--config", default=None, help="node config (for ota.state_dir)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 when the store is inconsistent")
    p.set_defaults(func=cmd_status)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: edgerun ota ...")

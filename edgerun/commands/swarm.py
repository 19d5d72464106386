"""``edgerun swarm keygen | members``: make a swarm key, print a running node's view of the swarm."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError, EdgerunError


def cmd_keygen(args: argparse.Namespace) -> int:
    from swarm.keyring import encode_key, generate_key

    line = encode_key(generate_key()) + "\n"
    if args.out in (None, "-"):
        sys.stdout.write(line)
        return 0
    path = Path(args.out)
    if path.exists() and not args.force:
        raise ConfigError(f"{path}: exists (a swarm key is not overwritten without --force)")
    # Readable by the node's group only: the key lets anyone join the swarm and forge claims.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write(line)
    print(f"wrote a swarm key to {path} (install it on every node as swarm.key_file)")
    return 0


def fetch_view(host: str, port: int, timeout_s: float = 3.0) -> dict[str, Any]:
    """The ``swarm`` part of a running node's /healthz."""
    url = f"http://{host}:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:
        body = json.loads(err.read() or b"{}")
    except (OSError, ValueError) as err:
        raise EdgerunError(f"cannot read the node's view from {url}: {err}") from None
    view = body.get("swarm")
    if view is None:
        raise EdgerunError(f"{url}: the node has no swarm (swarm.enabled is false)")
    return view


def format_members(view: dict[str, Any]) -> str:
    rows = [("NAME", "STATE", "INC", "ADDRESS", "MODEL", "ENGINE", "HEALTH", "POSITION")]
    for m in view.get("members", []):
        meta = m.get("meta") or {}
        pos = ""
        if meta.get("east") is not None:
            pos = f"{meta['east']:.1f} E {meta['north']:.1f} N {meta.get('up') or 0:.1f} U"
        model = f"{meta.get('model', '')} v{meta.get('version', '')}" if meta.get("model") else ""
        rows.append(
            (
                m["name"],
                m["state"],
                str(m["incarnation"]),
                m["addr"],
                model,
                meta.get("engine", ""),
                meta.get("health", ""),
                pos,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_members(args: argparse.Namespace) -> int:
    from edgerun.config import load_config

    cfg = load_config(args.config)
    port = cfg.service.http_port
    if not cfg.service.http_enabled or port == 0:
        raise ConfigError(f"{args.config}: service.http_port must be a fixed port to ask the running node")
    view = fetch_view(cfg.service.http_host, port)
    print(json.dumps(view, indent=2) if args.json else format_members(view))
    return 0


def add_swarm_parser(sub: Any) -> None:
    swarm = sub.add_parser("swarm", help="swarm keys and membership")
    ssub = swarm.add_subparsers(dest="swarm_command", required=True)
    keygen = ssub.add_parser("keygen", help="write a new swarm key (base64, one line)")
    keygen.add_argument("out", nargs="?", default=None, help="key file (default: print it)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing file")
    keygen.set_defaults(func=cmd_keygen)
    members = ssub.add_parser("members", help="print a running node's view of the swarm")
    members.add_argument("--config", "-c", required=True, help="the node's TOML config")
    members.add_argument("--json", action="store_true", help="print the members as JSON")
    members.set_defaults(func=cmd_members)

#!/usr/bin/env bash
# Verify the systemd unit the way a board loads it: install.sh into a scratch DESTDIR, then
# `systemd-analyze verify` and `systemd-analyze security --offline=yes` with --root on that tree.
#
#   deploy/verify-unit.sh [--board generic|pi|coral|jetson] [--source PATH]     (or: make verify-unit)
#
# `systemd-analyze verify deploy/systemd/edgerun.service` on a development machine fails: ExecStart names
# /opt/edgerun/.venv/bin/edgerun, which is not there. In the installed tree it is. No root is needed, nothing
# is written outside the scratch tree (removed on exit), nothing is downloaded: the node goes in without its
# dependencies (verify needs the ExecStart binary, not a working node). --source is what install.sh installs
# (default: this checkout, built into a wheel with $PYTHON, default python3; a wheel works too). Exit 0 when verify says nothing and the exposure is at most
# MAX_EXPOSURE (2.0 by default); the exposure is printed either way.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
board=generic
source_path="$(dirname "$here")"
max_exposure="${MAX_EXPOSURE:-2.0}"

die() { echo "verify-unit.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --board) board="${2:?--board needs a value}"; shift 2 ;;
        --source) source_path="${2:?--source needs a path}"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
command -v systemd-analyze >/dev/null || die "systemd-analyze not found (Debian: systemd)"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/edgerun-verify.XXXXXX")"
root="$scratch"
trap 'rm -rf "$scratch"' EXIT

log="$root/install.log"
if [ -d "$source_path" ]; then
    # A checkout: build its wheel from a copy (the checkout stays clean), offline, with the setuptools and wheel
    # of $PYTHON (make verify-unit passes the project's venv).
    mkdir "$root/src" "$root/wheel"
    for name in edgerun swarm setup.cfg pyproject.toml README.md; do cp -a "$source_path/$name" "$root/src/"; done
    "${PYTHON:-python3}" -m pip wheel -q --no-deps --no-build-isolation -w "$root/wheel" "$root/src" >"$log" 2>&1 \
        || { cat "$log" >&2; die "building the wheel of $source_path failed (above)"; }
    source_path="$(echo "$root"/wheel/edgerun-*.whl)"
fi
mkdir "$root/tree"
if ! DESTDIR="$root/tree" EDGERUN_PIP_ARGS="--no-deps --no-index" \
        bash "$here/install.sh" --board "$board" --source "$source_path" >"$log" 2>&1; then
    cat "$log" >&2
    die "install.sh into a scratch DESTDIR failed (above)"
fi
root="$root/tree"
# verify loads the units edgerun.service pulls in (sysinit.target, network-online.target ...) from the same root.
for units in /usr/lib/systemd/system /lib/systemd/system; do
    if [ -d "$units" ]; then
        mkdir -p "$root/usr/lib/systemd/system"
        cp -a "$units/." "$root/usr/lib/systemd/system/"
        break
    fi
done

out="$(systemd-analyze verify --root="$root" edgerun.service 2>&1)" || { echo "$out" >&2; die "verify failed (board $board)"; }
[ -z "$out" ] || { echo "$out" >&2; die "verify printed warnings (board $board)"; }
exposure="$(systemd-analyze security --offline=yes --root="$root" edgerun.service 2>&1 \
    | sed -n 's/.*Overall exposure level for edgerun\.service: \([0-9.]*\).*/\1/p')"
[ -n "$exposure" ] || die "systemd-analyze security printed no exposure level"
echo "edgerun.service (board $board): verify clean, exposure $exposure (at most $max_exposure)"
awk -v e="$exposure" -v m="$max_exposure" 'BEGIN { exit !(e <= m) }' || die "exposure $exposure is above $max_exposure"

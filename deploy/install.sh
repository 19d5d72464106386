#!/usr/bin/env bash
# Install edgerun as a hardened systemd service (see deploy/README.md).
#
#   sudo deploy/install.sh [--board generic|pi|coral|jetson] [--source PATH] [--model BUNDLE_DIR]...
#                          [--root-key FILE]... [--swarm-key FILE] [--no-start]
#   sudo deploy/install.sh --uninstall [--purge]
#
# Layout: /opt/edgerun/.venv (the node), /etc/edgerun/node.toml (kept when present),
# /etc/edgerun/keys/ (OTA root keys, swarm key: 0640 root:edgerun), /var/lib/edgerun/models/ (model store),
# the unit in /etc/systemd/system with the board's drop-in, sysusers.d and tmpfiles.d entries in /usr/lib.
# Idempotent: a second run upgrades the node in place and keeps config, keys and state.
# DESTDIR=/some/root installs into that tree instead (packaging, tests): nothing is started, the unit is
# enabled with `systemctl --root`, and the venv's scripts point at /opt/edgerun, not at DESTDIR.
# --uninstall removes the node, unit and system entries but keeps /etc/edgerun and /var/lib/edgerun;
# --purge removes those too. The edgerun account stays (sysusers.d never deletes accounts).
# Environment: PYTHON (the interpreter for the venv, default python3), EDGERUN_PIP_ARGS (extra pip
# arguments, e.g. "--no-index --find-links /media/wheels" on an offline board).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
DESTDIR="${DESTDIR:-}"
DESTDIR="${DESTDIR%/}"
PYTHON="${PYTHON:-python3}"

board=generic
source_path="$repo"
action=install
purge=0
start=1
models=()
root_keys=()
swarm_key=""

die() { echo "install.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --board) board="${2:?--board needs a value}"; shift 2 ;;
        --source) source_path="${2:?--source needs a path}"; shift 2 ;;
        --model) models+=("${2:?--model needs a bundle directory}"); shift 2 ;;
        --root-key) root_keys+=("${2:?--root-key needs a file}"); shift 2 ;;
        --swarm-key) swarm_key="${2:?--swarm-key needs a file}"; shift 2 ;;
        --no-start) start=0; shift ;;
        --uninstall) action=uninstall; shift ;;
        --purge) purge=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
case "$board" in generic|pi|coral|jetson) ;; *) die "--board: expected generic, pi, coral or jetson, got '$board'" ;; esac
[ "$purge" -eq 0 ] || [ "$action" = uninstall ] || die "--purge goes with --uninstall"

opt="$DESTDIR/opt/edgerun"
venv="$opt/.venv"
etc="$DESTDIR/etc/edgerun"
state="$DESTDIR/var/lib/edgerun"
cache="$DESTDIR/var/cache/edgerun"
unit_dir="$DESTDIR/etc/systemd/system"
sysusers="$DESTDIR/usr/lib/sysusers.d/edgerun.conf"
tmpfiles="$DESTDIR/usr/lib/tmpfiles.d/edgerun.conf"
root_arg=()
[ -z "$DESTDIR" ] || root_arg=(--root="$DESTDIR")
# Only a real install on a running systemd talks to PID 1.
live=0
[ -z "$DESTDIR" ] && [ -d /run/systemd/system ] && live=1
is_root=0
[ "$(id -u)" -eq 0 ] && is_root=1

log() { echo "install.sh: $*"; }

# The numeric id of an account in the target's /etc files (DESTDIR's, not the build host's).
lookup_id() { # file name
    awk -F: -v n="$2" '$1 == n { print $3; found = 1 } END { exit !found }' "$DESTDIR/etc/$1"
}

owned() { # mode owner group path...: chmod always, chown only as root (a packager's fakeroot-less run)
    local mode="$1" user="$2" group="$3"; shift 3
    chmod "$mode" "$@"
    if [ "$is_root" -eq 1 ]; then
        chown "$(lookup_id passwd "$user"):$(lookup_id group "$group")" "$@"
    fi
}

uninstall() {
    if [ "$live" -eq 1 ]; then
        systemctl disable --now edgerun.service 2>/dev/null || true
    elif [ -e "$unit_dir/edgerun.service" ]; then
        systemctl "${root_arg[@]}" disable edgerun.service >/dev/null 2>&1 || true
    fi
    rm -f "$unit_dir/edgerun.service" "$sysusers" "$tmpfiles"
    rm -rf "$unit_dir/edgerun.service.d" "$opt"
    [ "$live" -eq 0 ] || systemctl daemon-reload
    if [ "$purge" -eq 1 ]; then
        rm -rf "$etc" "$state" "$cache"
        log "removed edgerun, its config, keys, models and state"
    else
        log "removed edgerun; kept ${etc#"$DESTDIR"} and ${state#"$DESTDIR"} (--purge removes them)"
    fi
}

install_node() {
    mkdir -p "$opt"
    local venv_args=()
    # JetPack ships TensorRT's and OpenCV's Python bindings as Debian packages, outside any venv.
    [ "$board" = jetson ] && venv_args+=(--system-site-packages)
    local upgrade=1
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv "${venv_args[@]}" "$venv"
        upgrade=0
    fi
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
    # shellcheck disable=SC2086  # EDGERUN_PIP_ARGS is a list of words on purpose
    "${pip[@]}" ${EDGERUN_PIP_ARGS:-} --upgrade "$source_path"
    if [ "$upgrade" -eq 1 ]; then  # a checkout keeps its version number while its code changes: replace it anyway
        # shellcheck disable=SC2086
        "${pip[@]}" ${EDGERUN_PIP_ARGS:-} --no-deps --force-reinstall "$source_path"
    fi
    # The service cannot write /opt: compile now so nothing tries at run time.
    "$venv/bin/python" -m compileall -q "$venv" >/dev/null || true
    if [ -n "$DESTDIR" ]; then
        # venv writes its absolute path into scripts; on the target it lives at /opt/edgerun.
        { grep -rlI --null -F "$opt" "$venv/bin" "$venv/pyvenv.cfg" || true; } | xargs -0 -r sed -i "s#$opt#/opt/edgerun#g"
    fi
    install -d -m 0755 "$opt/share/deploy"
    install -m 0644 "$here/README.md" "$here/node.example.toml" "$opt/share/deploy/"
}

install_system_files() {
    install -D -m 0644 "$here/systemd/edgerun.service" "$unit_dir/edgerun.service"
    rm -rf "$unit_dir/edgerun.service.d"
    if [ "$board" != generic ]; then
        install -D -m 0644 "$here/systemd/boards/$board.conf" "$unit_dir/edgerun.service.d/board.conf"
    fi
    install -D -m 0644 "$here/systemd/sysusers.d/edgerun.conf" "$sysusers"
    install -D -m 0644 "$here/systemd/tmpfiles.d/edgerun.conf" "$tmpfiles"
    mkdir -p "$DESTDIR/etc"
    systemd-sysusers "${root_arg[@]}" "$sysusers"
    if [ "$is_root" -eq 1 ]; then
        systemd-tmpfiles "${root_arg[@]}" --create "$tmpfiles"
    else  # tmpfiles.d cannot chown without root: make the tree, the target's tmpfiles fixes owners at boot
        mkdir -p "$etc/keys" "$state/models" "$cache"
        chmod 0750 "$etc" "$etc/keys" "$state" "$state/models" "$cache"
    fi
}

install_config_and_keys() {
    if [ ! -e "$etc/node.toml" ]; then
        install -m 0640 "$here/node.example.toml" "$etc/node.toml"
        owned 0640 root edgerun "$etc/node.toml"
        log "wrote ${etc#"$DESTDIR"}/node.toml from node.example.toml; edit it, then: systemctl restart edgerun"
    fi
    local key
    for key in "${root_keys[@]}"; do
        install -m 0640 "$key" "$etc/keys/$(basename "$key")"
        owned 0640 root edgerun "$etc/keys/$(basename "$key")"
    done
    if [ -n "$swarm_key" ]; then
        install -m 0640 "$swarm_key" "$etc/keys/swarm.key"
        owned 0640 root edgerun "$etc/keys/swarm.key"
    fi
    local bundle name
    for bundle in "${models[@]}"; do
        [ -f "$bundle/model.toml" ] || die "--model $bundle: not a model bundle (no model.toml)"
        name="$(basename "$bundle")"
        rm -rf "$state/models/$name.new"
        cp -r "$bundle" "$state/models/$name.new"
        rm -rf "$state/models/$name"
        mv "$state/models/$name.new" "$state/models/$name"
        find "$state/models/$name" -type d -exec chmod 0750 {} + -o -type f -exec chmod 0640 {} +
        [ "$is_root" -eq 0 ] || chown -R "$(lookup_id passwd edgerun):$(lookup_id group edgerun)" "$state/models/$name"
    done
}

enable_unit() {
    if [ "$live" -eq 1 ]; then
        systemctl daemon-reload
        systemctl enable edgerun.service
        if [ "$start" -eq 1 ]; then
            systemctl restart edgerun.service
        fi
    else
        systemctl "${root_arg[@]}" enable edgerun.service
    fi
}

if [ "$action" = uninstall ]; then
    uninstall
    exit 0
fi
command -v systemd-sysusers >/dev/null || die "systemd-sysusers not found: this installs a systemd service"
install_node
install_system_files
install_config_and_keys
enable_unit
log "installed edgerun (board $board) into ${DESTDIR:-/}"

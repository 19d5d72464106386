#!/usr/bin/env bash
# Make (or replace) one MQTT credential of the fleet broker (deploy/mosquitto/edgerun-fleet.conf).
#
#   sudo deploy/mqtt-credential.sh [-f PASSWORD_FILE] [-o SNIPPET_FILE] NODE_ID
#   sudo deploy/mqtt-credential.sh [-f PASSWORD_FILE] [-o SNIPPET_FILE] --operator | --station
#
# A new random password goes into the broker's password file (mosquitto_passwd, read from stdin so it never
# appears in a process list) under the username NODE_ID, "operator" or "station"; the ACL
# (edgerun-fleet.acl) gives that username its rights. The node's [sinks.mqtt] lines are printed once on
# stdout, or written to SNIPPET_FILE (mode 0600) with -o: put them in the node's /etc/edgerun/node.toml
# (or EDGERUN_SINKS_MQTT_USERNAME / _PASSWORD on balena). Run again to rotate; -d NODE_ID removes one.
# Default PASSWORD_FILE: /etc/mosquitto/edgerun/passwd. Reload the broker afterwards (systemctl reload
# mosquitto: SIGHUP rereads the password and ACL files).
set -euo pipefail

die() { echo "mqtt-credential.sh: $*" >&2; exit 2; }

passwd_file=/etc/mosquitto/edgerun/passwd
out=""
name=""
delete=0
while [ $# -gt 0 ]; do
    case "$1" in
        -f|--passwd-file) passwd_file="${2:?-f needs a file}"; shift 2 ;;
        -o|--output) out="${2:?-o needs a file}"; shift 2 ;;
        -d|--delete) delete=1; shift ;;
        --operator) [ -z "$name" ] || die "one identity at a time"; name=operator; shift ;;
        --station) [ -z "$name" ] || die "one identity at a time"; name=station; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *)
            [ -z "$name" ] || die "one identity at a time"
            # The operator and station identities have their own flags: a node called so would get their rights.
            case "$1" in
                operator|station) die "$1 is a reserved identity: use --$1" ;;
                fleet) die "fleet is reserved: the ACL pattern edgerun/%u/# would let it publish releases" ;;
            esac
            # What a node id may be here: one MQTT topic level without wildcards (the ACL's %u).
            [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]] || die "node id '$1': use letters, digits, '_', '.', '-' (64 at most)"
            name="$1"; shift ;;
    esac
done
[ -n "$name" ] || die "which identity? NODE_ID, --operator or --station (see --help)"
command -v mosquitto_passwd >/dev/null || die "mosquitto_passwd not found (apt install mosquitto)"

if [ "$delete" = 1 ]; then
    [ -f "$passwd_file" ] || die "$passwd_file does not exist"
    mosquitto_passwd -D "$passwd_file" "$name" >/dev/null
    echo "mqtt-credential.sh: removed $name from $passwd_file (reload the broker)" >&2
    exit 0
fi

# 30 random bytes, base64 without '/', '+' or '=': safe inside TOML quotes and an environment variable.
password="$(head -c 30 /dev/urandom | base64 | tr -d '\n/+=')"
[ "${#password}" -ge 24 ] || die "could not read /dev/urandom"

create=()
if [ ! -e "$passwd_file" ]; then
    mkdir -p "$(dirname "$passwd_file")"
    create=(-c)
fi
old_umask="$(umask)"
umask 077  # a new password file is readable by its owner only (give it to the mosquitto group after)
printf '%s\n%s\n' "$password" "$password" | mosquitto_passwd "${create[@]}" "$passwd_file" "$name" >/dev/null
umask "$old_umask"
if [ "${#create[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && getent group mosquitto >/dev/null; then
    chgrp mosquitto "$passwd_file" && chmod 0640 "$passwd_file"  # the broker reads it after dropping root
fi

snippet="[sinks.mqtt]
username = \"$name\"
password = \"$password\"
"
if [ -n "$out" ]; then
    (umask 077; printf '%s' "$snippet" > "$out")
    echo "mqtt-credential.sh: $name added to $passwd_file; its settings are in $out (reload the broker)" >&2
else
    printf '%s' "$snippet"
    echo "mqtt-credential.sh: $name added to $passwd_file (reload the broker)" >&2
fi

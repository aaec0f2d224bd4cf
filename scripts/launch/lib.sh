# shellcheck shell=bash
# Helpers shared by the launch scripts (sourced, not run): start processes with their logs in
# $RUN_DIR, wait for ready files or sockets, print a request, stop everything on exit.
#
# Variables a launch script may set before sourcing: none. It reads:
#   OPENENGINE_SIDECAR_BIN  the sidecar CLI (default: the checkout's .venv, else `openengine-sidecar` on PATH)
#   RUN_DIR                 sockets, ready files and logs (default: a new directory under ${TMPDIR:-/tmp})

OE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -n "${OPENENGINE_SIDECAR_BIN:-}" ]; then
    OE_BIN=$OPENENGINE_SIDECAR_BIN
elif [ -x "$OE_ROOT/.venv/bin/openengine-sidecar" ]; then
    OE_BIN=$OE_ROOT/.venv/bin/openengine-sidecar
else
    OE_BIN=$(command -v openengine-sidecar || true)
fi
if [ -z "$OE_BIN" ]; then
    echo "openengine-sidecar not found: run scripts/setup, or set OPENENGINE_SIDECAR_BIN" >&2
    exit 1
fi
OE_OWN_RUN_DIR=false
if [ -z "${RUN_DIR:-}" ]; then
    RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/openengine-launch.XXXXXX")
    OE_OWN_RUN_DIR=true
fi
mkdir -p "$RUN_DIR"
OE_NAMES=()
OE_PIDS=()

# oe_start NAME COMMAND [ARG...]: run COMMAND in the background, output to $RUN_DIR/NAME.log.
oe_start() {
    local name=$1
    shift
    echo "starting $name: $*" >&2
    "$@" >"$RUN_DIR/$name.log" 2>&1 &
    OE_NAMES+=("$name")
    OE_PIDS+=("$!")
}

oe_pid() {
    local i
    for i in "${!OE_NAMES[@]}"; do
        if [ "${OE_NAMES[$i]}" = "$1" ]; then
            echo "${OE_PIDS[$i]}"
            return 0
        fi
    done
    return 1
}

oe_died() {
    echo "$1 exited early; last lines of $RUN_DIR/$1.log:" >&2
    tail -n 30 "$RUN_DIR/$1.log" >&2 || true
    exit 1
}

oe_exists() {
    case $1 in
    file) [ -s "$2" ] ;;
    socket) [ -S "$2" ] ;;
    *) return 2 ;;
    esac
}

# oe_wait KIND PATH TIMEOUT NAME: wait until PATH exists (KIND file: non-empty; socket) while NAME runs.
oe_wait() {
    local kind=$1 path=$2 timeout=$3 name=$4 pid waited=0
    pid=$(oe_pid "$name")
    until oe_exists "$kind" "$path"; do
        kill -0 "$pid" 2>/dev/null || oe_died "$name"
        if [ "$waited" -ge $((timeout * 10)) ]; then
            echo "$name: $path did not appear within ${timeout}s (log: $RUN_DIR/$name.log)" >&2
            exit 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

# oe_wait_file PATH TIMEOUT NAME: a ready file (written atomically once NAME serves).
oe_wait_file() { oe_wait file "$1" "$2" "$3"; }

# oe_wait_socket PATH TIMEOUT NAME: a Unix socket NAME listens on.
oe_wait_socket() { oe_wait socket "$1" "$2" "$3"; }

# oe_json FILE KEY: one top-level string of a JSON file.
oe_json() {
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}

# oe_wait_http URL TIMEOUT NAME: until URL answers 200 (e.g. a sidecar's /ready).
oe_wait_http() {
    local url=$1 timeout=$2 name=$3 pid waited=0
    pid=$(oe_pid "$name")
    until python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$url" 2>/dev/null; do
        kill -0 "$pid" 2>/dev/null || oe_died "$name"
        if [ "$waited" -ge $((timeout * 10)) ]; then
            echo "$name: $url not ready within ${timeout}s (log: $RUN_DIR/$name.log)" >&2
            exit 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

# oe_stop_all STATUS: SIGTERM every started process, newest first (sidecars drain before their
# engines stop), wait up to 60 s each, then SIGKILL what is left. A RUN_DIR this script created
# is removed after a successful run and kept (with the logs) after a failure.
oe_stop_all() {
    local status=$1 i pid waited
    trap - EXIT INT TERM
    for ((i = ${#OE_PIDS[@]} - 1; i >= 0; i--)); do
        pid=${OE_PIDS[$i]}
        kill -TERM "$pid" 2>/dev/null || continue
        waited=0
        while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 600 ]; do
            sleep 0.1
            waited=$((waited + 1))
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if $OE_OWN_RUN_DIR && [ "$status" -eq 0 ]; then
        rm -rf "$RUN_DIR"
    elif [ "$status" -ne 0 ]; then
        echo "logs kept in $RUN_DIR" >&2
    fi
}

trap 'oe_stop_all $?' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# oe_print_command TITLE COMMAND [ARG...]: print a ready-to-paste command line.
oe_print_command() {
    local title=$1
    shift
    printf '%s\n  ' "$title"
    printf '%q ' "$@"
    printf '\n'
}

# oe_serve_forever: keep everything running until Ctrl-C (or a started process exits).
oe_serve_forever() {
    echo "logs in $RUN_DIR; Ctrl-C stops everything" >&2
    wait -n "${OE_PIDS[@]}" || true
}

# oe_schema_release: the OpenEngine schema release this sidecar build was generated from
# (engines of the OpenEngine forks read it from OPENENGINE_SCHEMA_RELEASE).
oe_schema_release() {
    "$OE_BIN" --version | sed -n 's/^openengine schema release \([0-9a-f]*\).*/\1/p'
}

# oe_sidecar NAME ENGINE WS HTTP KV_PUBLISH KV_REPLAY [RUN FLAG...]: start a sidecar in front of
# ENGINE that waits as long as a GPU engine needs to load (STARTUP_DEADLINE, default 1800 s).
oe_sidecar() {
    local name=$1 engine=$2 ws=$3 http=$4 kv_publish=$5 kv_replay=$6
    shift 6
    oe_start "$name" "$OE_BIN" run --engine "$engine" --listen "$ws" --http-listen "$http" \
        --kv-publish "$kv_publish" --kv-replay "$kv_replay" --startup-deadline "${STARTUP_DEADLINE:-1800}" \
        --ready-file "$RUN_DIR/$name.json" "$@"
}

#!/usr/bin/env bash
# Aggregated serving on this machine, no GPU: a simulated engine (mock-engine) on a Unix socket,
# the sidecar in front of it on the CLI's default ports, then one request through the sidecar.
#
#   scripts/launch/local-mock-agg.sh           serve until Ctrl-C
#   scripts/launch/local-mock-agg.sh --check   send the request, then stop everything (exit 0 if it completed)
#
# Environment: FLAVOR (vllm | sglang | trtllm, default vllm), MODEL, LISTEN, HTTP_LISTEN,
# KV_PUBLISH, KV_REPLAY (sidecar binds; defaults are the CLI's), RUN_DIR, OPENENGINE_SIDECAR_BIN.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

check=false
[ "${1:-}" = "--check" ] && check=true
FLAVOR=${FLAVOR:-vllm}
MODEL=${MODEL:-Qwen/Qwen3-0.6B}

oe_start engine "$OE_BIN" mock-engine --flavor "$FLAVOR" --role aggregated --model "$MODEL" \
    --listen "unix://$RUN_DIR/engine.sock" --kv-port 0 --token-delay-ms 5 --ready-file "$RUN_DIR/engine.json"
oe_wait_file "$RUN_DIR/engine.json" 60 engine

oe_start sidecar "$OE_BIN" run --engine "unix://$RUN_DIR/engine.sock" \
    --listen "${LISTEN:-127.0.0.1:8600}" --http-listen "${HTTP_LISTEN:-127.0.0.1:8601}" \
    --kv-publish "${KV_PUBLISH:-tcp://127.0.0.1:5600}" --kv-replay "${KV_REPLAY:-tcp://127.0.0.1:5700}" \
    --ready-file "$RUN_DIR/sidecar.json"
oe_wait_file "$RUN_DIR/sidecar.json" 60 sidecar
ws=$(oe_json "$RUN_DIR/sidecar.json" ws)
http=$(oe_json "$RUN_DIR/sidecar.json" http)

request=("$OE_BIN" generate --sidecar "$ws" --max-tokens 16 "Hello from the sidecar")
echo "sidecar ready: $ws  $http (simulated $FLAVOR engine on unix://$RUN_DIR/engine.sock)"
oe_print_command "a request:" "${request[@]}"
oe_print_command "the worker card:" curl -s "$http/v1/worker"
echo "--- running the request:"
"${request[@]}"
echo
echo "--- request completed"
if ! $check; then
    oe_serve_forever
fi

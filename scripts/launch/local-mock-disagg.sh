#!/usr/bin/env bash
# Disaggregated (prefill/decode) serving on this machine, no GPU: a simulated prefill engine and
# a simulated decode engine (KV moves between them over the mock's transfer channel), one
# sidecar in front of each, then one P/D request: `openengine-sidecar disagg` sends the prompt
# to the prefill sidecar and its handoff to the decode sidecar (SGLang flavour: both at once,
# with a client-created bootstrap).
#
#   scripts/launch/local-mock-disagg.sh           serve until Ctrl-C
#   scripts/launch/local-mock-disagg.sh --check   send the request, then stop everything
#
# Environment: FLAVOR (vllm | sglang | trtllm, default vllm), MODEL, PREFILL_LISTEN,
# PREFILL_HTTP_LISTEN, PREFILL_KV_PUBLISH, PREFILL_KV_REPLAY, DECODE_LISTEN, DECODE_HTTP_LISTEN,
# DECODE_KV_PUBLISH, DECODE_KV_REPLAY (sidecar binds; prefill uses the CLI's default ports,
# decode the same + 10), RUN_DIR, OPENENGINE_SIDECAR_BIN.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"

check=false
[ "${1:-}" = "--check" ] && check=true
FLAVOR=${FLAVOR:-vllm}
MODEL=${MODEL:-Qwen/Qwen3-0.6B}

for role in prefill decode; do
    oe_start "$role-engine" "$OE_BIN" mock-engine --flavor "$FLAVOR" --role "$role" --model "$MODEL" \
        --listen "unix://$RUN_DIR/$role.sock" --kv-port 0 --transfer-port 0 --token-delay-ms 5 \
        --ready-file "$RUN_DIR/$role-engine.json"
done
oe_wait_file "$RUN_DIR/prefill-engine.json" 60 prefill-engine
oe_wait_file "$RUN_DIR/decode-engine.json" 60 decode-engine

oe_start prefill-sidecar "$OE_BIN" run --engine "unix://$RUN_DIR/prefill.sock" \
    --listen "${PREFILL_LISTEN:-127.0.0.1:8600}" --http-listen "${PREFILL_HTTP_LISTEN:-127.0.0.1:8601}" \
    --kv-publish "${PREFILL_KV_PUBLISH:-tcp://127.0.0.1:5600}" --kv-replay "${PREFILL_KV_REPLAY:-tcp://127.0.0.1:5700}" \
    --ready-file "$RUN_DIR/prefill-sidecar.json"
oe_start decode-sidecar "$OE_BIN" run --engine "unix://$RUN_DIR/decode.sock" \
    --listen "${DECODE_LISTEN:-127.0.0.1:8610}" --http-listen "${DECODE_HTTP_LISTEN:-127.0.0.1:8611}" \
    --kv-publish "${DECODE_KV_PUBLISH:-tcp://127.0.0.1:5610}" --kv-replay "${DECODE_KV_REPLAY:-tcp://127.0.0.1:5710}" \
    --ready-file "$RUN_DIR/decode-sidecar.json"
oe_wait_file "$RUN_DIR/prefill-sidecar.json" 60 prefill-sidecar
oe_wait_file "$RUN_DIR/decode-sidecar.json" 60 decode-sidecar
prefill=$(oe_json "$RUN_DIR/prefill-sidecar.json" ws)
decode=$(oe_json "$RUN_DIR/decode-sidecar.json" ws)

request=("$OE_BIN" disagg --prefill "$prefill" --decode "$decode" --max-tokens 16 "Hello from the sidecar")
echo "prefill sidecar ready: $prefill  $(oe_json "$RUN_DIR/prefill-sidecar.json" http)"
echo "decode sidecar ready:  $decode  $(oe_json "$RUN_DIR/decode-sidecar.json" http)"
oe_print_command "a prefill/decode request:" "${request[@]}"
if "$OE_BIN" disagg --help | grep -q -- "--prefill"; then
    echo "--- running the request:"
    "${request[@]}"
    echo
    echo "--- request completed"
else
    echo "('openengine-sidecar disagg' is not available in this build yet: the command above is" \
        "what to run once it is)"
    for role in prefill decode; do
        http=$(oe_json "$RUN_DIR/$role-sidecar.json" http)
        python3 -c 'import json, sys, urllib.request
card = json.load(urllib.request.urlopen(sys.argv[1] + "/v1/worker", timeout=5))
print(sys.argv[2], "sidecar serves a", card["role"], "engine:", card["engine"]["name"])' "$http" "$role"
    done
fi
if ! $check; then
    oe_serve_forever
fi

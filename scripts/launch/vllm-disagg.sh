#!/usr/bin/env bash
# Disaggregated vLLM on two GPUs of this node (prefill on GPU 0, decode on GPU 1, KV over NIXL),
# one sidecar in front of each engine.
#
#   MODEL=Qwen/Qwen3-0.6B scripts/launch/vllm-disagg.sh
#
# The engine commands are upstream's `vllm serve` with NixlConnector (vLLM's disaggregated
# prefilling docs) plus the OpenEngine server of vLLM's OpenEngine fork:
#   --openengine-host / --openengine-port   FORK FLAGS (not in upstream vLLM)
#   OPENENGINE_SCHEMA_RELEASE               FORK
#   kv_role kv_producer / kv_consumer       upstream values; the fork derives the OpenEngine role
#                                           (PREFILL / DECODE) from them
# VLLM_NIXL_SIDE_CHANNEL_PORT is moved off vLLM's default 5600, which the sidecar's KV publisher uses.
# Environment: MODEL, PREFILL_GPU (0), DECODE_GPU (1), RUN_DIR, STARTUP_DEADLINE, OPENENGINE_SIDECAR_BIN.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
release=$(oe_schema_release)

start_engine() { # NAME GPU HTTP_PORT OPENENGINE_PORT KV_EVENTS_PORT NIXL_PORT KV_ROLE
    CUDA_VISIBLE_DEVICES=$2 OPENENGINE_SCHEMA_RELEASE=$release PYTHONHASHSEED=0 \
        VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$6 \
        oe_start "$1" vllm serve "$MODEL" --host 127.0.0.1 --port "$3" \
        --openengine-host 127.0.0.1 --openengine-port "$4" \
        --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$7\"}" \
        --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$5\",\"topic\":\"kv-events\"}"
}
start_engine prefill-engine "${PREFILL_GPU:-0}" 8001 50051 5557 5800 kv_producer
start_engine decode-engine "${DECODE_GPU:-1}" 8002 50052 5558 5801 kv_consumer
oe_sidecar prefill-sidecar 127.0.0.1:50051 127.0.0.1:8600 127.0.0.1:8601 tcp://127.0.0.1:5600 tcp://127.0.0.1:5700 \
    --expected-engine vllm
oe_sidecar decode-sidecar 127.0.0.1:50052 127.0.0.1:8610 127.0.0.1:8611 tcp://127.0.0.1:5610 tcp://127.0.0.1:5710 \
    --expected-engine vllm
oe_wait_file "$RUN_DIR/prefill-sidecar.json" "${STARTUP_DEADLINE:-1800}" prefill-sidecar
oe_wait_file "$RUN_DIR/decode-sidecar.json" "${STARTUP_DEADLINE:-1800}" decode-sidecar
oe_print_command "ready; a prefill/decode request:" "$OE_BIN" disagg \
    --prefill "$(oe_json "$RUN_DIR/prefill-sidecar.json" ws)" --decode "$(oe_json "$RUN_DIR/decode-sidecar.json" ws)" \
    --max-tokens 32 "Hello"
oe_serve_forever

#!/usr/bin/env bash
# Disaggregated SGLang on two GPUs of this node (prefill on GPU 0, decode on GPU 1, KV over NIXL),
# one sidecar in front of each engine. SGLang uses client bootstrap: `openengine-sidecar disagg`
# creates the bootstrap room and sends the prefill and decode requests at once; the bootstrap
# endpoint comes from the prefill engine's discovery (its kv_connector.local_endpoints).
#
#   MODEL=Qwen/Qwen3-0.6B scripts/launch/sglang-disagg.sh
#
# Engine commands: upstream `sglang.launch_server` with --disaggregation-mode prefill|decode,
# --disaggregation-transfer-backend nixl, --disaggregation-bootstrap-port (SGLang's PD
# disaggregation docs), plus the OpenEngine fork's server:
#   --openengine-host / --openengine-port   FORK FLAGS (not in upstream SGLang)
#   OPENENGINE_SCHEMA_RELEASE               FORK
#   OPENENGINE_ADVERTISED_HOST              FORK: the host the prefill engine advertises as its
#                                           bootstrap endpoint (here loopback; a pod IP on Kubernetes)
#   SGLANG_HOST_IP                          upstream SGLang: the local IP its disaggregation uses
# Environment: MODEL, PREFILL_GPU (0), DECODE_GPU (1), BOOTSTRAP_PORT (8998), RUN_DIR,
# STARTUP_DEADLINE, OPENENGINE_SIDECAR_BIN.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
release=$(oe_schema_release)

start_engine() { # NAME GPU HTTP_PORT OPENENGINE_PORT KV_EVENTS_PORT MODE
    CUDA_VISIBLE_DEVICES=$2 OPENENGINE_SCHEMA_RELEASE=$release \
        OPENENGINE_ADVERTISED_HOST=127.0.0.1 SGLANG_HOST_IP=127.0.0.1 \
        oe_start "$1" python3 -m sglang.launch_server --model-path "$MODEL" --served-model-name "$MODEL" \
        --host 127.0.0.1 --port "$3" \
        --openengine-host 127.0.0.1 --openengine-port "$4" \
        --page-size 16 \
        --disaggregation-mode "$6" --disaggregation-transfer-backend nixl \
        --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" \
        --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$5\",\"topic\":\"\"}"
}
start_engine prefill-engine "${PREFILL_GPU:-0}" 8001 50051 5557 prefill
start_engine decode-engine "${DECODE_GPU:-1}" 8002 50052 5558 decode
oe_sidecar prefill-sidecar 127.0.0.1:50051 127.0.0.1:8600 127.0.0.1:8601 tcp://127.0.0.1:5600 tcp://127.0.0.1:5700 \
    --expected-engine sglang
oe_sidecar decode-sidecar 127.0.0.1:50052 127.0.0.1:8610 127.0.0.1:8611 tcp://127.0.0.1:5610 tcp://127.0.0.1:5710 \
    --expected-engine sglang
oe_wait_file "$RUN_DIR/prefill-sidecar.json" "${STARTUP_DEADLINE:-1800}" prefill-sidecar
oe_wait_file "$RUN_DIR/decode-sidecar.json" "${STARTUP_DEADLINE:-1800}" decode-sidecar
oe_print_command "ready; a prefill/decode request:" "$OE_BIN" disagg \
    --prefill "$(oe_json "$RUN_DIR/prefill-sidecar.json" ws)" --decode "$(oe_json "$RUN_DIR/decode-sidecar.json" ws)" \
    --max-tokens 32 "Hello"
oe_serve_forever

#!/usr/bin/env bash
# Disaggregated TensorRT-LLM on two GPUs of this node (context on GPU 0, generation on GPU 1,
# KV over the cache transceiver), one sidecar in front of each engine.
#
#   MODEL=Qwen/Qwen3-0.6B scripts/launch/trtllm-disagg.sh
#
# Engine commands: upstream `trtllm-serve MODEL --backend pytorch --server_role CONTEXT|GENERATION`
# with cache_transceiver_config in the LLM-API options (TensorRT-LLM's disaggregated serving docs),
# plus the OpenEngine fork's server:
#   --openengine-host / --openengine-port   FORK FLAGS (not in upstream trtllm-serve)
#   OPENENGINE_SCHEMA_RELEASE               FORK
# Environment: MODEL, PREFILL_GPU (0), DECODE_GPU (1), RUN_DIR, STARTUP_DEADLINE, OPENENGINE_SIDECAR_BIN.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
release=$(oe_schema_release)
cat >"$RUN_DIR/context.yaml" <<'YAML'
disable_overlap_scheduler: true
cache_transceiver_config:
  backend: DEFAULT
kv_cache_config:
  enable_block_reuse: true
  free_gpu_memory_fraction: 0.85
YAML
cat >"$RUN_DIR/generation.yaml" <<'YAML'
cache_transceiver_config:
  backend: DEFAULT
kv_cache_config:
  enable_block_reuse: true
  free_gpu_memory_fraction: 0.85
YAML

start_engine() { # NAME GPU HTTP_PORT OPENENGINE_PORT ROLE CONFIG
    CUDA_VISIBLE_DEVICES=$2 OPENENGINE_SCHEMA_RELEASE=$release \
        oe_start "$1" trtllm-serve "$MODEL" --backend pytorch --host 127.0.0.1 --port "$3" \
        --server_role "$5" --config "$RUN_DIR/$6" \
        --openengine-host 127.0.0.1 --openengine-port "$4"
}
start_engine prefill-engine "${PREFILL_GPU:-0}" 8001 50051 CONTEXT context.yaml
start_engine decode-engine "${DECODE_GPU:-1}" 8002 50052 GENERATION generation.yaml
oe_sidecar prefill-sidecar 127.0.0.1:50051 127.0.0.1:8600 127.0.0.1:8601 tcp://127.0.0.1:5600 tcp://127.0.0.1:5700 \
    --expected-engine tensorrt_llm
oe_sidecar decode-sidecar 127.0.0.1:50052 127.0.0.1:8610 127.0.0.1:8611 tcp://127.0.0.1:5610 tcp://127.0.0.1:5710 \
    --expected-engine tensorrt_llm
oe_wait_file "$RUN_DIR/prefill-sidecar.json" "${STARTUP_DEADLINE:-1800}" prefill-sidecar
oe_wait_file "$RUN_DIR/decode-sidecar.json" "${STARTUP_DEADLINE:-1800}" decode-sidecar
oe_print_command "ready; a prefill/decode request:" "$OE_BIN" disagg \
    --prefill "$(oe_json "$RUN_DIR/prefill-sidecar.json" ws)" --decode "$(oe_json "$RUN_DIR/decode-sidecar.json" ws)" \
    --max-tokens 32 "Hello"
oe_serve_forever

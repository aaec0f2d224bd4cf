#!/usr/bin/env bash
# Aggregated vLLM on one GPU of this node, with the sidecar in front of it.
#
#   MODEL=Qwen/Qwen3-0.6B scripts/launch/vllm-agg.sh [extra vllm serve flags...]
#
# The engine command is upstream's `vllm serve` (https://docs.vllm.ai) plus the OpenEngine
# server of vLLM's OpenEngine fork (image "vllm-openengine" in Dynamo's OpenEngine examples):
#   --openengine-host / --openengine-port   FORK FLAGS: not in upstream vLLM (upstream's own
#                                           `--grpc` server speaks a different protocol)
#   OPENENGINE_SCHEMA_RELEASE               FORK: the schema release the engine reports
# Everything else is upstream vLLM. Environment: MODEL, GPU (default 0), RUN_DIR, STARTUP_DEADLINE,
# OPENENGINE_SIDECAR_BIN, LISTEN / HTTP_LISTEN / KV_PUBLISH / KV_REPLAY (sidecar binds).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
release=$(oe_schema_release)

CUDA_VISIBLE_DEVICES=${GPU:-0} OPENENGINE_SCHEMA_RELEASE=$release PYTHONHASHSEED=0 \
    oe_start engine vllm serve "$MODEL" --host 127.0.0.1 --port 8001 \
    --openengine-host 127.0.0.1 --openengine-port 50051 \
    --enable-lora --max-loras 4 \
    --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":"kv-events"}' \
    "$@"
oe_sidecar sidecar 127.0.0.1:50051 "${LISTEN:-127.0.0.1:8600}" "${HTTP_LISTEN:-127.0.0.1:8601}" \
    "${KV_PUBLISH:-tcp://127.0.0.1:5600}" "${KV_REPLAY:-tcp://127.0.0.1:5700}" --expected-engine vllm
oe_wait_file "$RUN_DIR/sidecar.json" "${STARTUP_DEADLINE:-1800}" sidecar
oe_print_command "ready; a request:" "$OE_BIN" generate --sidecar "$(oe_json "$RUN_DIR/sidecar.json" ws)" \
    --max-tokens 32 "Hello"
oe_serve_forever

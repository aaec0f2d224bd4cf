#!/usr/bin/env bash
# Aggregated TensorRT-LLM (PyTorch backend) on one GPU of this node, with the sidecar in front of it.
#
#   MODEL=Qwen/Qwen3-0.6B scripts/launch/trtllm-agg.sh [extra trtllm-serve flags...]
#
# The engine command is upstream's `trtllm-serve MODEL --backend pytorch` with an LLM-API options
# file (--config; older releases call it --extra_llm_api_options), plus the OpenEngine server of
# TensorRT-LLM's OpenEngine fork (image "tensorrtllm-openengine" in Dynamo's OpenEngine examples):
#   --openengine-host / --openengine-port   FORK FLAGS: not in upstream trtllm-serve (upstream's
#                                           `--grpc` serves TensorRT-LLM's own gRPC protocol)
#   OPENENGINE_SCHEMA_RELEASE               FORK
# Environment: MODEL, GPU (default 0), RUN_DIR, STARTUP_DEADLINE, OPENENGINE_SIDECAR_BIN,
# LISTEN / HTTP_LISTEN / KV_PUBLISH / KV_REPLAY (sidecar binds).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
release=$(oe_schema_release)
cat >"$RUN_DIR/engine.yaml" <<'YAML'
kv_cache_config:
  enable_block_reuse: true
  free_gpu_memory_fraction: 0.85
YAML

CUDA_VISIBLE_DEVICES=${GPU:-0} OPENENGINE_SCHEMA_RELEASE=$release \
    oe_start engine trtllm-serve "$MODEL" --backend pytorch --host 127.0.0.1 --port 8001 \
    --config "$RUN_DIR/engine.yaml" \
    --openengine-host 127.0.0.1 --openengine-port 50051 \
    "$@"
oe_sidecar sidecar 127.0.0.1:50051 "${LISTEN:-127.0.0.1:8600}" "${HTTP_LISTEN:-127.0.0.1:8601}" \
    "${KV_PUBLISH:-tcp://127.0.0.1:5600}" "${KV_REPLAY:-tcp://127.0.0.1:5700}" --expected-engine tensorrt_llm
oe_wait_file "$RUN_DIR/sidecar.json" "${STARTUP_DEADLINE:-1800}" sidecar
oe_print_command "ready; a request:" "$OE_BIN" generate --sidecar "$(oe_json "$RUN_DIR/sidecar.json" ws)" \
    --max-tokens 32 "Hello"
oe_serve_forever

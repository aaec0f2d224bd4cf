#!/usr/bin/env bash
# Aggregated SGLang on one GPU of this node, with the sidecar in front of it.
#
#   MODEL=Qwen/Qwen3-0.6B scripts/launch/sglang-agg.sh [extra sglang.launch_server flags...]
#
# The engine command is upstream's `python3 -m sglang.launch_server` (https://docs.sglang.ai)
# plus the OpenEngine server of SGLang's OpenEngine fork (image "sglang-openengine" in Dynamo's
# OpenEngine examples):
#   --openengine-host / --openengine-port   FORK FLAGS: not in upstream SGLang (upstream's
#                                           `--grpc-port` serves SGLang's own gRPC protocol)
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

CUDA_VISIBLE_DEVICES=${GPU:-0} OPENENGINE_SCHEMA_RELEASE=$release \
    oe_start engine python3 -m sglang.launch_server --model-path "$MODEL" --served-model-name "$MODEL" \
    --host 127.0.0.1 --port 8001 \
    --openengine-host 127.0.0.1 --openengine-port 50051 \
    --page-size 16 --enable-lora \
    --kv-events-config '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":""}' \
    "$@"
oe_sidecar sidecar 127.0.0.1:50051 "${LISTEN:-127.0.0.1:8600}" "${HTTP_LISTEN:-127.0.0.1:8601}" \
    "${KV_PUBLISH:-tcp://127.0.0.1:5600}" "${KV_REPLAY:-tcp://127.0.0.1:5700}" --expected-engine sglang
oe_wait_file "$RUN_DIR/sidecar.json" "${STARTUP_DEADLINE:-1800}" sidecar
oe_print_command "ready; a request:" "$OE_BIN" generate --sidecar "$(oe_json "$RUN_DIR/sidecar.json" ws)" \
    --max-tokens 32 "Hello"
oe_serve_forever

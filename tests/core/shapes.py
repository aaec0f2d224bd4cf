"""Hand-built discovery answers of three engine-like shapes (vLLM, TensorRT-LLM, SGLang)."""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.core.card import WorkerCard, build_card
from sidecar.core.negotiation import negotiate
from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE

R = pb.EngineRole
M = pb.Modality
S = pb.MediaSourceType
C = pb.CandidateTokenSelectionMode
G = pb.GuidedDecodingMode

SGLANG_BOOTSTRAP = pb.KvEndpoint(host="10.0.0.5", port=8998, protocol="http")


def vllm_info(
    role: pb.EngineRole = R.AGGREGATED, *, dp: int = 1
) -> tuple[pb.ServerInfo, dict[str, pb.ModelInfo]]:
    info = pb.ServerInfo(
        engine_name="vllm",
        engine_version="0.26.1",
        engine_role=role,
        instance_id="vllm-1",
        supported_models=["llama"],
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=2,
            pipeline_parallel_size=1,
            data_parallel_size=dp,
            data_parallel_rank=0,
            data_parallel_start_rank=0,
        ),
        kv_connector=pb.KvConnectorInfo(
            enabled=True,
            transfer_backend="nixl",
            handoff_profile="vllm.kv_transfer_params.v1",
            supports_client_bootstrap=False,
            local_endpoints=[pb.KvEndpoint(host="10.0.0.1", port=5600, protocol="nixl")],
            supports_abort_cleanup=True,
        ),
        schema_revision=3,
        minimum_client_revision=1,
        schema_release=SCHEMA_RELEASE,
        capacity=pb.DeploymentCapacity(
            kv_block_size=16,
            total_kv_blocks=4096,
            max_running_requests=256,
            max_batched_tokens=8192,
            max_loras=4,
        ),
        extra=pb.Struct.from_dict({"kv_cache_dtype": "auto"}),
    )
    model = pb.ModelInfo(
        model_id="meta-llama/Llama-3.1-8B-Instruct",
        served_model_name="llama",
        served_model_aliases=["meta-llama/Llama-3.1-8B-Instruct", "llama"],
        max_context_length=8192,
        max_output_tokens=4096,
        tokenizer_modes=["auto", "slow"],
        tokenizer=pb.TokenizerInfo(source="meta-llama/Llama-3.1-8B-Instruct", mode="auto"),
        supports_text_input=True,
        supports_token_ids_input=True,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=pb.LogprobCapabilities(
                supported=True, candidate_selection_modes=[C.TOP_N], max_top_n=20
            ),
            output_logprobs=pb.LogprobCapabilities(
                supported=True, candidate_selection_modes=[C.TOP_N, C.TOKEN_IDS], max_top_n=20
            ),
            guided_decoding=pb.GuidedDecodingCapabilities(
                supported=True, modes=[G.JSON_SCHEMA, G.REGEX, G.CHOICE, G.JSON_OBJECT]
            ),
            max_num_sequences=8,
            supports_priority=True,
            supports_stop_in_output=True,
            supports_cache_salt=True,
            supports_prefix_cache_bypass=False,
        ),
        supports_lora=True,
        supports_multimodal=True,
        multimodal_capabilities=pb.MultimodalCapabilities(
            aggregate_modalities=[M.IMAGE],
            prefill_decode_modalities=[M.IMAGE],
            source_types=[S.URL, S.DATA_URI],
            supports_per_request_media_options=True,
            routing_image_token_id=32000,
        ),
        reasoning_parser="",
        tool_call_parser="llama3_json",
    )
    return info, {"llama": model}


def trtllm_info(role: pb.EngineRole = R.AGGREGATED) -> tuple[pb.ServerInfo, dict[str, pb.ModelInfo]]:
    info = pb.ServerInfo(
        engine_name="tensorrt_llm",
        engine_version="1.3.0",
        engine_role=role,
        instance_id="trt-7",
        supported_models=["qwen-omni"],
        parallelism=pb.ParallelismInfo(tensor_parallel_size=4),
        kv_connector=pb.KvConnectorInfo(
            enabled=True,
            transfer_backend="ucx",
            handoff_profile="tensorrt_llm.disaggregated_params.v1",
        ),
        schema_revision=3,
        minimum_client_revision=1,
        schema_release="v1.0.0",
        capacity=pb.DeploymentCapacity(kv_block_size=32),
    )
    model = pb.ModelInfo(
        model_id="Qwen/Qwen2.5-Omni-7B",
        served_model_name="qwen-omni",
        tokenizer=pb.TokenizerInfo(source="Qwen/Qwen2.5-Omni-7B"),
        max_context_length=32768,
        supports_text_input=True,
        supports_token_ids_input=False,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=pb.LogprobCapabilities(supported=False),
            output_logprobs=pb.LogprobCapabilities(
                supported=True, candidate_selection_modes=[C.TOP_N], max_top_n=1
            ),
            guided_decoding=pb.GuidedDecodingCapabilities(
                supported=True,
                modes=[G.JSON_SCHEMA, G.REGEX, G.EBNF_GRAMMAR, G.JSON_OBJECT, G.STRUCTURAL_TAG],
            ),
            max_num_sequences=4,
            supports_stop_in_output=False,
        ),
        supports_lora=False,
        supports_multimodal=True,
        multimodal_capabilities=pb.MultimodalCapabilities(
            aggregate_modalities=[M.IMAGE, M.AUDIO],
            prefill_decode_modalities=[M.IMAGE],
            source_types=[S.URL, S.DATA_URI, S.RAW_BYTES],
            supports_per_request_media_options=False,
        ),
    )
    return info, {"qwen-omni": model}


def sglang_info(
    role: pb.EngineRole = R.PREFILL, *, dp: int = 2
) -> tuple[pb.ServerInfo, dict[str, pb.ModelInfo]]:
    info = pb.ServerInfo(
        engine_name="sglang",
        engine_version="0.5.9",
        engine_role=role,
        instance_id="sgl-p0",
        supported_models=["deepseek"],
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=8, data_parallel_size=dp, data_parallel_start_rank=0
        ),
        kv_connector=pb.KvConnectorInfo(
            enabled=True,
            transfer_backend="mooncake",
            handoff_profile="sglang.bootstrap.v1",
            supports_client_bootstrap=True,
            local_endpoints=[SGLANG_BOOTSTRAP],
        ),
        schema_revision=3,
        minimum_client_revision=1,
        schema_release=SCHEMA_RELEASE.upper(),
    )
    model = pb.ModelInfo(
        model_id="deepseek-ai/DeepSeek-V3",
        served_model_name="deepseek",
        served_model_aliases=["ds3"],
        supports_text_input=True,
        supports_token_ids_input=True,
    )
    return info, {"deepseek": model}


def card_of(
    shape: tuple[pb.ServerInfo, dict[str, pb.ModelInfo]],
    *,
    loras: Sequence[pb.LoraAdapter] | None = (),
    sources: Sequence[pb.KvEventSource] | None = None,
    only_model: str | None = None,
) -> WorkerCard:
    info, models = shape
    return build_card(
        info,
        negotiate(info),
        models,
        kv_event_sources=sources,
        lora_adapters=None if loras is None else list(loras),
        only_model=only_model,
    )


def vllm_card(role: pb.EngineRole = R.AGGREGATED, *, dp: int = 1, **kw: object) -> WorkerCard:
    kw.setdefault("loras", [pb.LoraAdapter(lora_id=1, lora_name="sql-lora", source_path="/adapters/sql")])
    return card_of(vllm_info(role, dp=dp), **kw)  # type: ignore[arg-type]


def trtllm_card(role: pb.EngineRole = R.AGGREGATED, **kw: object) -> WorkerCard:
    return card_of(trtllm_info(role), **kw)  # type: ignore[arg-type]


def sglang_card(role: pb.EngineRole = R.PREFILL, *, dp: int = 2, **kw: object) -> WorkerCard:
    kw.setdefault("loras", None)
    return card_of(sglang_info(role, dp=dp), **kw)  # type: ignore[arg-type]

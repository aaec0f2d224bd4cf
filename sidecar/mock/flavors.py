"""Per-flavour discovery of the simulated engines: ServerInfo, ModelInfo, connectors.

The three flavours differ the way the real engines do (docs/design/engine-facts.md):
engine name and version, handoff profile and transfer backend, SGLang's client
bootstrap, multimodal support, logprob and guided-decoding capabilities, and the
request knobs each accepts. Behaviour elsewhere follows these tables, never a flavour
name switch. What is advertised is cut to the schema the engine is built on
(:mod:`sidecar.mock.schemas`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sidecar.mock import schemas
from sidecar.mock import tokenizer as tok
from sidecar.mock.config import EngineConfig
from sidecar.openengine import pb

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
TOKENIZER_SOURCE = "openengine-sidecar/mock-tokenizer-v1"
#: Placeholder tokens one media item expands to, per modality.
MEDIA_TOKENS = {pb.Modality.IMAGE: 8, pb.Modality.VIDEO: 16, pb.Modality.AUDIO: 4}
MEDIA_PLACEHOLDER = {
    pb.Modality.IMAGE: tok.IMAGE_ID,
    pb.Modality.VIDEO: tok.VIDEO_ID,
    pb.Modality.AUDIO: tok.AUDIO_ID,
}
MODALITY_NAMES = {pb.Modality.IMAGE: "image", pb.Modality.VIDEO: "video", pb.Modality.AUDIO: "audio"}
_ROLE_ENUM = {
    "aggregated": pb.EngineRole.AGGREGATED,
    "prefill": pb.EngineRole.PREFILL,
    "decode": pb.EngineRole.DECODE,
}

_G = pb.GuidedDecodingMode
_C = pb.CandidateTokenSelectionMode
_M = pb.Modality
_S = pb.MediaSourceType


@dataclass(frozen=True)
class LogprobCaps:
    modes: tuple[pb.CandidateTokenSelectionMode, ...]
    max_top_n: int


@dataclass(frozen=True)
class FlavorSpec:
    """Static facts of one flavour."""

    key: str
    engine_name: str
    engine_version: str
    handoff_profile: str
    transfer_backend: str
    transfer_protocol: str
    client_bootstrap: bool
    aggregate_modalities: tuple[pb.Modality, ...]
    pd_modalities: tuple[pb.Modality, ...]
    source_types: tuple[pb.MediaSourceType, ...]
    per_request_media_options: bool
    media_option_keys: dict[str, frozenset[str]]
    prompt_logprobs: LogprobCaps
    output_logprobs: LogprobCaps
    guided_modes: tuple[pb.GuidedDecodingMode, ...]
    guided_backends: tuple[str, ...]
    max_num_sequences: int
    supports_priority: bool
    supports_stop_in_output: bool
    supports_cache_salt: bool
    supports_prefix_cache_bypass: bool
    tokenizer_modes: tuple[str, ...]
    reasoning_parser: str
    tool_call_parser: str
    max_batched_tokens: int

    def role_modalities(self, role: str) -> tuple[pb.Modality, ...]:
        return self.aggregate_modalities if role == "aggregated" else self.pd_modalities


FLAVORS: dict[str, FlavorSpec] = {
    "trtllm": FlavorSpec(
        key="trtllm",
        engine_name="tensorrt_llm",
        engine_version="1.3.0+mock",
        handoff_profile="tensorrt_llm.disaggregated_params.v1",
        transfer_backend="ucx",
        transfer_protocol="tcp",
        client_bootstrap=False,
        aggregate_modalities=(_M.IMAGE, _M.VIDEO, _M.AUDIO),
        pd_modalities=(_M.IMAGE, _M.VIDEO),
        source_types=(_S.URL, _S.DATA_URI),
        per_request_media_options=False,
        media_option_keys={},
        prompt_logprobs=LogprobCaps((_C.TOP_N,), 5),
        output_logprobs=LogprobCaps((_C.TOP_N,), 5),
        guided_modes=(_G.JSON_SCHEMA, _G.REGEX, _G.EBNF_GRAMMAR, _G.STRUCTURAL_TAG, _G.JSON_OBJECT),
        guided_backends=("xgrammar", "llguidance"),
        max_num_sequences=8,
        supports_priority=False,
        supports_stop_in_output=True,
        supports_cache_salt=True,
        supports_prefix_cache_bypass=False,
        tokenizer_modes=("auto",),
        reasoning_parser="",
        tool_call_parser="",
        max_batched_tokens=8192,
    ),
    "vllm": FlavorSpec(
        key="vllm",
        engine_name="vllm",
        engine_version="0.26.1+mock",
        handoff_profile="vllm.kv_transfer_params.v1",
        transfer_backend="nixl",
        transfer_protocol="tcp",
        client_bootstrap=False,
        aggregate_modalities=(_M.IMAGE,),
        pd_modalities=(_M.IMAGE,),
        source_types=(_S.URL, _S.DATA_URI),
        per_request_media_options=True,
        media_option_keys={"image": frozenset({"max_pixels", "min_pixels", "num_crops"})},
        prompt_logprobs=LogprobCaps((_C.TOP_N,), 20),
        output_logprobs=LogprobCaps((_C.TOP_N,), 20),
        guided_modes=(
            _G.JSON_SCHEMA,
            _G.REGEX,
            _G.EBNF_GRAMMAR,
            _G.STRUCTURAL_TAG,
            _G.CHOICE,
            _G.JSON_OBJECT,
        ),
        guided_backends=("auto", "xgrammar", "guidance", "outlines"),
        max_num_sequences=16,
        supports_priority=True,
        supports_stop_in_output=True,
        supports_cache_salt=True,
        supports_prefix_cache_bypass=True,
        tokenizer_modes=("auto", "slow", "mistral", "custom"),
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        max_batched_tokens=8192,
    ),
    "sglang": FlavorSpec(
        key="sglang",
        engine_name="sglang",
        engine_version="0.6.2+mock",
        handoff_profile="sglang.bootstrap.v1",
        transfer_backend="mooncake",
        transfer_protocol="tcp",
        client_bootstrap=True,
        aggregate_modalities=(_M.IMAGE, _M.VIDEO, _M.AUDIO),
        pd_modalities=(_M.IMAGE, _M.VIDEO),
        source_types=(_S.URL, _S.DATA_URI, _S.RAW_BYTES),
        per_request_media_options=False,
        media_option_keys={},
        prompt_logprobs=LogprobCaps((_C.TOP_N, _C.TOKEN_IDS), 20),
        output_logprobs=LogprobCaps((_C.TOP_N, _C.TOKEN_IDS), 20),
        guided_modes=(_G.JSON_SCHEMA, _G.REGEX, _G.EBNF_GRAMMAR, _G.STRUCTURAL_TAG),
        guided_backends=("xgrammar", "outlines", "llguidance"),
        max_num_sequences=16,
        supports_priority=True,
        supports_stop_in_output=True,
        supports_cache_salt=True,
        supports_prefix_cache_bypass=False,
        tokenizer_modes=("auto", "slow"),
        reasoning_parser="qwen3",
        tool_call_parser="qwen25",
        max_batched_tokens=16384,
    ),
}


def flavor_spec(config: EngineConfig) -> FlavorSpec:
    """The flavour as built on the configured schema (no client bootstrap where the schema
    has none: SGLang then hands over context-first, the prefill choosing the room)."""
    spec = FLAVORS[config.flavor]
    if spec.client_bootstrap and not schemas.has(config, "clientBootstrap"):
        spec = replace(spec, client_bootstrap=False)
    return spec


def accepted_modalities(config: EngineConfig) -> tuple[pb.Modality, ...]:
    """Modalities the engine accepts for its role (none for a ``--text-only`` engine)."""
    return () if config.text_only else flavor_spec(config).role_modalities(config.role)


def model_name(config: EngineConfig) -> str:
    return config.model or DEFAULT_MODEL


def role_enum(role: str) -> pb.EngineRole:
    return _ROLE_ENUM[role]


def instance_id(config: EngineConfig, bound_listen: str) -> str:
    if config.instance_id:
        return config.instance_id
    return f"mock-{config.flavor}-{config.role}@{bound_listen}"


def kv_connector_info(config: EngineConfig, endpoints: Sequence[pb.KvEndpoint]) -> pb.KvConnectorInfo:
    """The role's connector: disabled for aggregated engines; P/D roles advertise the
    flavour's handoff profile and transfer backend and the transfer ``endpoints``."""
    spec = flavor_spec(config)
    if config.role == "aggregated" or config.faults.has("no-connector"):
        return pb.KvConnectorInfo(enabled=False)
    return pb.KvConnectorInfo(
        enabled=True,
        transfer_backend=spec.transfer_backend,
        local_endpoints=list(endpoints),
        supported_protocols=[spec.transfer_protocol],
        supports_remote_prefill=True,
        supports_decode_pull=True,
        supports_abort_cleanup=True,
        supports_drain=True,
        schema_version=1,
        handoff_profile=spec.handoff_profile,
        supports_client_bootstrap=spec.client_bootstrap,
    )


def server_info(
    config: EngineConfig, *, instance: str, endpoints: Sequence[pb.KvEndpoint] = ()
) -> pb.ServerInfo:
    """ServerInfo as the flavour reports it on its schema (faults may falsify revision/release/role)."""
    spec = flavor_spec(config)
    schema = schemas.schema_of(config)
    f = config.faults
    role = f.wrong_role or config.role
    zero = f.has("zero-presence")  # fault: explicit zeros where "unknown" means absent
    info = pb.ServerInfo(
        engine_name=spec.engine_name,
        engine_version=config.engine_version or spec.engine_version,
        engine_role=role_enum(role),
        instance_id=instance,
        supported_models=[model_name(config)],
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=config.tp_size,
            pipeline_parallel_size=1,
            data_parallel_size=config.dp_size,
            data_parallel_start_rank=0,
            decode_context_parallel_size=0 if zero else 1,
        ),
        kv_connector=kv_connector_info(config, endpoints),
        schema_revision=schema.revision if f.wrong_revision is None else f.wrong_revision,
        minimum_client_revision=(
            schema.minimum_client_revision if f.wrong_min_client is None else f.wrong_min_client
        ),
        schema_release=schemas.advertised_release(config) if f.wrong_release is None else f.wrong_release,
        capacity=pb.DeploymentCapacity(
            kv_block_size=0 if zero else config.kv_block_size,
            total_kv_blocks=config.total_kv_blocks * config.dp_size,
            max_running_requests=config.max_running * config.dp_size,
            max_batched_tokens=spec.max_batched_tokens,
            max_loras=config.max_loras if config.enable_lora else 0,
        ),
        extra=pb.Struct.from_dict(
            {"mock": True, "flavor": config.flavor, "fast": config.fast, "vocab_size": tok.VOCAB_SIZE}
        ),
    )
    return schemas.advertise(config, info)


def _logprob_caps(caps: LogprobCaps) -> pb.LogprobCapabilities:
    return pb.LogprobCapabilities(
        supported=True, candidate_selection_modes=list(caps.modes), max_top_n=caps.max_top_n
    )


def model_info(config: EngineConfig) -> pb.ModelInfo:
    """ModelInfo of the served model (the same for its aliases)."""
    spec = flavor_spec(config)
    name = model_name(config)
    modalities = accepted_modalities(config)
    info = pb.ModelInfo(
        model_id=name,
        served_model_name=name,
        served_model_aliases=list(config.aliases)
        + ([f"{name}-phantom-alias"] if config.faults.has("phantom-alias") else []),
        max_context_length=config.max_context_length,
        max_output_tokens=config.max_output_tokens,
        tokenizer_modes=list(spec.tokenizer_modes),
        tokenizer=pb.TokenizerInfo(source=config.tokenizer_source or TOKENIZER_SOURCE, mode="auto"),
        supports_text_input=True,
        supports_token_ids_input=True,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=_logprob_caps(spec.prompt_logprobs),
            output_logprobs=_logprob_caps(spec.output_logprobs),
            guided_decoding=pb.GuidedDecodingCapabilities(supported=True, modes=list(spec.guided_modes)),
            max_num_sequences=spec.max_num_sequences,
            supports_priority=spec.supports_priority,
            supports_stop_in_output=spec.supports_stop_in_output,
            supports_cache_salt=spec.supports_cache_salt,
            supports_prefix_cache_bypass=spec.supports_prefix_cache_bypass,
        ),
        supports_lora=config.enable_lora,
        supports_multimodal=bool(modalities),
        reasoning_parser=spec.reasoning_parser,
        tool_call_parser=spec.tool_call_parser,
        extra=pb.Struct.from_dict(
            {
                "mock": True,
                "vocab_size": tok.VOCAB_SIZE,
                "bos_token_id": tok.BOS_ID,
                "eos_token_id": tok.EOS_ID,
                "media_tokens": {MODALITY_NAMES[m]: n for m, n in MEDIA_TOKENS.items()},
            }
        ),
        multimodal_capabilities=None
        if config.text_only
        else pb.MultimodalCapabilities(
            aggregate_modalities=list(spec.aggregate_modalities),
            prefill_decode_modalities=list(spec.pd_modalities),
            source_types=list(spec.source_types),
            supports_per_request_media_options=spec.per_request_media_options,
            routing_image_token_id=tok.IMAGE_ID,
        ),
    )
    return schemas.advertise(config, info)

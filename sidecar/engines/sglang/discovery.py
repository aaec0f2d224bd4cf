"""SglangDiscovery (``ServerInfo``, ``ModelInfo``, KV event sources) read off SGLang's resolved configuration.

Nothing here is configured twice: page size (the KV block), KV capacity, context length, the
running-request limit, the radix cache, the tokenizer and its EOS id all come from the running
engine (its ``ServerArgs``, model config, first load snapshot and tokenizer). The engine is
aggregated (docs/ENGINES.md says why P/D is not offered here), one data-parallel rank, no LoRA,
text only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.engines.common.checks import ModelLimits
from sidecar.engines.common.net import KvEndpoints, zmq_kv_sources
from sidecar.engines.sglang.config import SglangSettings
from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE

SCHEMA_REVISION = 3
MINIMUM_CLIENT_REVISION = 1
ENGINE_NAME = "sglang"
GUIDED_BACKEND = "xgrammar"
_TOP_N = pb.CandidateTokenSelectionMode.TOP_N
_TOKEN_IDS = pb.CandidateTokenSelectionMode.TOKEN_IDS
_GUIDED_MODES = [
    pb.GuidedDecodingMode.JSON_SCHEMA,
    pb.GuidedDecodingMode.REGEX,
    pb.GuidedDecodingMode.EBNF_GRAMMAR,
]


@dataclass(frozen=True)
class SglangDiscovery:
    """Everything the engine advertises; built once the engine runs (:func:`discover`)."""

    server: pb.ServerInfo
    model: pb.ModelInfo
    limits: ModelLimits
    eos_token_id: int | None
    page_size: int
    total_kv_blocks: int
    kv_sources: pb.GetKvEventSourcesResponse

    @property
    def names(self) -> tuple[str, ...]:
        """The served name and its aliases."""
        return self.limits.names


def _optional_int(value: Any) -> int | None:
    return None if value is None or int(value) <= 0 else int(value)


def discover(
    server_args: Any,
    model_config: Any,
    tokenizer: Any,
    scheduler_info: dict[str, Any],
    snapshot: Any,
    settings: SglangSettings,
    kv: KvEndpoints | None,
    *,
    instance_id: str,
) -> SglangDiscovery:
    """SglangDiscovery from SGLang's ``ServerArgs``, ``ModelConfig``, tokenizer and its scheduler's
    start-up report (``max_total_num_tokens``) and first load snapshot (``max_running_requests``)."""
    import sglang

    name = str(server_args.served_model_name)
    names = (name, *(n for n in settings.served_model_names[1:] if n != name))
    max_len = int(model_config.context_len)
    page = int(server_args.page_size)
    total_tokens = int(scheduler_info["max_total_num_tokens"])
    blocks = total_tokens // page
    max_running = int(snapshot.max_running_requests)
    radix = not bool(server_args.disable_radix_cache)
    eos = getattr(tokenizer, "eos_token_id", None)
    model_path = str(getattr(server_args, "model_path", None) or settings.model)
    tokenizer_source = str(getattr(server_args, "tokenizer_path", None) or model_path)
    tokenizer_mode = str(getattr(server_args, "tokenizer_mode", None) or "auto")
    vocab = int(model_config.vocab_size)
    server = pb.ServerInfo(
        engine_name=ENGINE_NAME,
        engine_version=sglang.__version__,
        engine_role=pb.EngineRole.AGGREGATED,
        instance_id=instance_id,
        supported_models=[names[0]],
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=int(server_args.tp_size),
            pipeline_parallel_size=int(server_args.pp_size),
            data_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_start_rank=0,
        ),
        kv_connector=pb.KvConnectorInfo(enabled=False),
        schema_revision=SCHEMA_REVISION,
        minimum_client_revision=MINIMUM_CLIENT_REVISION,
        schema_release=SCHEMA_RELEASE,
        capacity=pb.DeploymentCapacity(
            kv_block_size=page,
            total_kv_blocks=blocks,
            max_running_requests=max_running,
            max_batched_tokens=_optional_int(server_args.chunked_prefill_size),
        ),
        extra=pb.Struct.from_dict(
            {
                "device": str(server_args.device),
                "dtype": str(server_args.dtype),
                "attention_backend": str(server_args.attention_backend),
                "radix_cache": radix,
                "max_total_tokens": total_tokens,
            }
        ),
    )
    logprob_caps = pb.LogprobCapabilities(
        supported=True, candidate_selection_modes=[_TOP_N], max_top_n=settings.max_logprobs
    )
    model = pb.ModelInfo(
        model_id=model_path,
        served_model_name=names[0],
        served_model_aliases=list(names[1:]),
        max_context_length=max_len,
        max_output_tokens=max_len - 1,
        tokenizer_modes=[tokenizer_mode],
        tokenizer=pb.TokenizerInfo(source=tokenizer_source, mode=tokenizer_mode),
        supports_text_input=True,
        supports_token_ids_input=True,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=logprob_caps,
            output_logprobs=pb.LogprobCapabilities(
                supported=True,
                candidate_selection_modes=[_TOP_N, _TOKEN_IDS],
                max_top_n=settings.max_logprobs,
            ),
            guided_decoding=pb.GuidedDecodingCapabilities(supported=True, modes=list(_GUIDED_MODES)),
            max_num_sequences=max_running,
            supports_priority=False,
            supports_stop_in_output=True,
            supports_cache_salt=radix,
            supports_prefix_cache_bypass=False,
        ),
        supports_lora=False,
        supports_multimodal=False,
        extra=pb.Struct.from_dict(
            {"vocab_size": vocab, **({"eos_token_id": eos} if eos is not None else {})}
        ),
    )
    limits = ModelLimits(
        names=names,
        vocab_size=vocab,
        max_model_len=max_len,
        max_num_sequences=max_running,
        max_logprobs=settings.max_logprobs,
        priority=False,
        guided_backend=str(server_args.grammar_backend or GUIDED_BACKEND),
    )
    sources = zmq_kv_sources(kv, settings.kv_topic, settings.kv_buffer_steps)
    return SglangDiscovery(server, model, limits, eos, page, blocks, sources)

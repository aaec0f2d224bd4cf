"""VllmDiscovery (``ServerInfo``, ``ModelInfo``, KV event sources) read off vLLM's resolved configuration.

Nothing here is configured twice: block size, KV blocks, context length, batch limits, prefix
caching, parallelism, the tokenizer and its EOS id all come from the running engine's
``VllmConfig`` (and tokenizer), so what the worker card says is what vLLM does. The engine is
aggregated (vLLM's CPU build has no KV connector that hands a prefill to another engine here:
docs/ENGINES.md), one data-parallel rank, no LoRA, text only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.engines.common.net import KvEndpoints, zmq_kv_sources
from sidecar.engines.vllm.config import VllmSettings
from sidecar.engines.vllm.requests import ModelLimits
from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE

SCHEMA_REVISION = 3
MINIMUM_CLIENT_REVISION = 1
ENGINE_NAME = "vllm"
_TOP_N = pb.CandidateTokenSelectionMode.TOP_N
_TOKEN_IDS = pb.CandidateTokenSelectionMode.TOKEN_IDS
_GUIDED_MODES = [
    pb.GuidedDecodingMode.JSON_SCHEMA,
    pb.GuidedDecodingMode.REGEX,
    pb.GuidedDecodingMode.EBNF_GRAMMAR,
    pb.GuidedDecodingMode.CHOICE,
    pb.GuidedDecodingMode.JSON_OBJECT,
]


@dataclass(frozen=True)
class VllmDiscovery:
    """Everything the engine advertises; built once the engine runs (:func:`discover`)."""

    server: pb.ServerInfo
    model: pb.ModelInfo
    limits: ModelLimits
    eos_token_id: int | None
    total_kv_blocks: int
    kv_sources: pb.GetKvEventSourcesResponse

    @property
    def names(self) -> tuple[str, ...]:
        """The served name and its aliases."""
        return self.limits.names


def _names(vllm_config: Any, settings: VllmSettings) -> tuple[str, ...]:
    name = str(vllm_config.model_config.served_model_name)
    return (name, *(n for n in settings.served_model_names[1:] if n != name))


def discover(
    vllm_config: Any, tokenizer: Any, settings: VllmSettings, kv: KvEndpoints | None, *, instance_id: str
) -> VllmDiscovery:
    import vllm

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    par = vllm_config.parallel_config
    names = _names(vllm_config, settings)
    max_len = int(model_config.max_model_len)
    max_logprobs = int(model_config.max_logprobs)
    blocks = int(cache.num_gpu_blocks or 0)
    prefix = bool(cache.enable_prefix_caching)
    priority = sched.policy == "priority"
    eos = getattr(tokenizer, "eos_token_id", None)
    vocab = int(model_config.get_vocab_size())
    server = pb.ServerInfo(
        engine_name=ENGINE_NAME,
        engine_version=vllm.__version__,
        engine_role=pb.EngineRole.AGGREGATED,
        instance_id=instance_id,
        supported_models=[names[0]],
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=par.tensor_parallel_size,
            pipeline_parallel_size=par.pipeline_parallel_size,
            data_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_start_rank=0,
            decode_context_parallel_size=par.decode_context_parallel_size,
        ),
        kv_connector=pb.KvConnectorInfo(enabled=False),
        schema_revision=SCHEMA_REVISION,
        minimum_client_revision=MINIMUM_CLIENT_REVISION,
        schema_release=SCHEMA_RELEASE,
        capacity=pb.DeploymentCapacity(
            kv_block_size=int(cache.block_size),
            total_kv_blocks=blocks,
            max_running_requests=int(sched.max_num_seqs),
            max_batched_tokens=int(sched.max_num_batched_tokens),
        ),
        extra=pb.Struct.from_dict(
            {
                "device": "cpu",
                "dtype": str(model_config.dtype).removeprefix("torch."),
                "prefix_caching": prefix,
            }
        ),
    )
    logprob_caps = pb.LogprobCapabilities(
        supported=True, candidate_selection_modes=[_TOP_N], max_top_n=max_logprobs
    )
    model = pb.ModelInfo(
        model_id=str(model_config.model),
        served_model_name=names[0],
        served_model_aliases=list(names[1:]),
        max_context_length=max_len,
        max_output_tokens=max_len - 1,
        tokenizer_modes=[str(model_config.tokenizer_mode)],
        tokenizer=pb.TokenizerInfo(source=str(model_config.tokenizer), mode=str(model_config.tokenizer_mode)),
        supports_text_input=True,
        supports_token_ids_input=True,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=logprob_caps,
            output_logprobs=pb.LogprobCapabilities(
                supported=True, candidate_selection_modes=[_TOP_N, _TOKEN_IDS], max_top_n=max_logprobs
            ),
            guided_decoding=pb.GuidedDecodingCapabilities(supported=True, modes=list(_GUIDED_MODES)),
            max_num_sequences=int(sched.max_num_seqs),
            supports_priority=priority,
            supports_stop_in_output=True,
            supports_cache_salt=prefix,
            supports_prefix_cache_bypass=prefix,
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
        max_num_sequences=int(sched.max_num_seqs),
        max_logprobs=max_logprobs,
        priority=priority,
        guided_backend=str(vllm_config.structured_outputs_config.backend),
    )
    return VllmDiscovery(
        server, model, limits, eos, blocks, zmq_kv_sources(kv, settings.kv_topic, settings.kv_buffer_steps)
    )

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

from sidecar.engines.common.discovery import AdapterDiscovery, model_info, server_info
from sidecar.engines.common.net import KvEndpoints, zmq_kv_sources
from sidecar.engines.common.settings import served_names
from sidecar.engines.vllm.config import VllmSettings
from sidecar.openengine import pb

ENGINE_NAME = "vllm"
_GUIDED_MODES = [
    pb.GuidedDecodingMode.JSON_SCHEMA,
    pb.GuidedDecodingMode.REGEX,
    pb.GuidedDecodingMode.EBNF_GRAMMAR,
    pb.GuidedDecodingMode.CHOICE,
    pb.GuidedDecodingMode.JSON_OBJECT,
]


@dataclass(frozen=True)
class VllmDiscovery(AdapterDiscovery):
    """Everything the engine advertises; built once the engine runs (:func:`discover`)."""


def discover(
    vllm_config: Any, tokenizer: Any, settings: VllmSettings, kv: KvEndpoints | None, *, instance_id: str
) -> VllmDiscovery:
    import vllm

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    par = vllm_config.parallel_config
    names = served_names(str(model_config.served_model_name), settings)
    blocks = int(cache.num_gpu_blocks or 0)
    prefix = bool(cache.enable_prefix_caching)
    eos = getattr(tokenizer, "eos_token_id", None)
    server = server_info(
        engine_name=ENGINE_NAME,
        engine_version=vllm.__version__,
        instance_id=instance_id,
        model_name=names[0],
        tensor_parallel_size=par.tensor_parallel_size,
        pipeline_parallel_size=par.pipeline_parallel_size,
        decode_context_parallel_size=par.decode_context_parallel_size,
        capacity=pb.DeploymentCapacity(
            kv_block_size=int(cache.block_size),
            total_kv_blocks=blocks,
            max_running_requests=int(sched.max_num_seqs),
            max_batched_tokens=int(sched.max_num_batched_tokens),
        ),
        extra={
            "device": "cpu",
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "prefix_caching": prefix,
        },
    )
    model, limits = model_info(
        model_id=str(model_config.model),
        names=names,
        max_len=int(model_config.max_model_len),
        tokenizer_source=str(model_config.tokenizer),
        tokenizer_mode=str(model_config.tokenizer_mode),
        max_logprobs=int(model_config.max_logprobs),
        guided_modes=_GUIDED_MODES,
        guided_backend=str(vllm_config.structured_outputs_config.backend),
        max_num_sequences=int(sched.max_num_seqs),
        priority=sched.policy == "priority",
        cache_salt=prefix,
        prefix_cache_bypass=prefix,
        vocab_size=int(model_config.get_vocab_size()),
        eos_token_id=eos,
    )
    sources = zmq_kv_sources(kv, settings.kv_topic, settings.kv_buffer_steps)
    return VllmDiscovery(server, model, limits, eos, blocks, sources)

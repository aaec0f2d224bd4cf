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

from sidecar.engines.common.discovery import AdapterDiscovery, model_info, server_info
from sidecar.engines.common.net import KvEndpoints, zmq_kv_sources
from sidecar.engines.common.settings import served_names
from sidecar.engines.sglang.config import SglangSettings
from sidecar.openengine import pb

ENGINE_NAME = "sglang"
GUIDED_BACKEND = "xgrammar"
_GUIDED_MODES = [
    pb.GuidedDecodingMode.JSON_SCHEMA,
    pb.GuidedDecodingMode.REGEX,
    pb.GuidedDecodingMode.EBNF_GRAMMAR,
]


@dataclass(frozen=True)
class SglangDiscovery(AdapterDiscovery):
    """Everything the engine advertises; built once the engine runs (:func:`discover`)."""

    page_size: int


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

    names = served_names(str(server_args.served_model_name), settings)
    page = int(server_args.page_size)
    total_tokens = int(scheduler_info["max_total_num_tokens"])
    blocks = total_tokens // page
    max_running = int(snapshot.max_running_requests)
    radix = not bool(server_args.disable_radix_cache)
    eos = getattr(tokenizer, "eos_token_id", None)
    model_path = str(getattr(server_args, "model_path", None) or settings.model)
    server = server_info(
        engine_name=ENGINE_NAME,
        engine_version=sglang.__version__,
        instance_id=instance_id,
        model_name=names[0],
        tensor_parallel_size=int(server_args.tp_size),
        pipeline_parallel_size=int(server_args.pp_size),
        capacity=pb.DeploymentCapacity(
            kv_block_size=page,
            total_kv_blocks=blocks,
            max_running_requests=max_running,
            max_batched_tokens=_optional_int(server_args.chunked_prefill_size),
        ),
        extra={
            "device": str(server_args.device),
            "dtype": str(server_args.dtype),
            "attention_backend": str(server_args.attention_backend),
            "radix_cache": radix,
            "max_total_tokens": total_tokens,
        },
    )
    model, limits = model_info(
        model_id=model_path,
        names=names,
        max_len=int(model_config.context_len),
        tokenizer_source=str(getattr(server_args, "tokenizer_path", None) or model_path),
        tokenizer_mode=str(getattr(server_args, "tokenizer_mode", None) or "auto"),
        max_logprobs=settings.max_logprobs,
        guided_modes=_GUIDED_MODES,
        guided_backend=str(server_args.grammar_backend or GUIDED_BACKEND),
        max_num_sequences=max_running,
        priority=False,
        cache_salt=radix,
        prefix_cache_bypass=False,
        vocab_size=int(model_config.vocab_size),
        eos_token_id=eos,
    )
    sources = zmq_kv_sources(kv, settings.kv_topic, settings.kv_buffer_steps)
    return SglangDiscovery(server, model, limits, eos, blocks, sources, page_size=page)

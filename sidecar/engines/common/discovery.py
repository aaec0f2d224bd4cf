"""The ``ServerInfo`` and ``ModelInfo`` every adapter advertises, from what its engine resolved.

Every adapter here serves one aggregated engine: one data-parallel rank, no KV connector, no
LoRA, text only, stop strings in the output, token ids in and out. What differs per engine
(version, parallelism, capacity, limits, guided modes, prefix-cache features) is passed in,
read off the running engine by the adapter's own ``discovery.py``. I/O-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.engines.common.checks import ModelLimits
from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE

SCHEMA_REVISION = 3
MINIMUM_CLIENT_REVISION = 1
_TOP_N = pb.CandidateTokenSelectionMode.TOP_N
_TOKEN_IDS = pb.CandidateTokenSelectionMode.TOKEN_IDS


@dataclass(frozen=True)
class AdapterDiscovery:
    """Everything an adapter advertises; built once its engine runs (its ``discover``)."""

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


def server_info(
    *,
    engine_name: str,
    engine_version: str,
    instance_id: str,
    model_name: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    decode_context_parallel_size: int | None = None,
    capacity: pb.DeploymentCapacity,
    extra: dict[str, Any],
) -> pb.ServerInfo:
    """``ServerInfo`` of an aggregated engine serving ``model_name`` as data-parallel rank 0 of 1."""
    return pb.ServerInfo(
        engine_name=engine_name,
        engine_version=engine_version,
        engine_role=pb.EngineRole.AGGREGATED,
        instance_id=instance_id,
        supported_models=[model_name],
        parallelism=pb.ParallelismInfo(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_start_rank=0,
            decode_context_parallel_size=decode_context_parallel_size,
        ),
        kv_connector=pb.KvConnectorInfo(enabled=False),
        schema_revision=SCHEMA_REVISION,
        minimum_client_revision=MINIMUM_CLIENT_REVISION,
        schema_release=SCHEMA_RELEASE,
        capacity=capacity,
        extra=pb.Struct.from_dict(extra),
    )


def model_info(
    *,
    guided_backend: str,
    model_id: str,
    names: Sequence[str],
    max_len: int,
    tokenizer_source: str,
    tokenizer_mode: str,
    max_logprobs: int,
    guided_modes: Sequence[pb.GuidedDecodingMode],
    max_num_sequences: int,
    priority: bool,
    cache_salt: bool,
    prefix_cache_bypass: bool,
    vocab_size: int,
    eos_token_id: int | None,
) -> tuple[pb.ModelInfo, ModelLimits]:
    """``ModelInfo`` of a text-only model without LoRA (``names[0]`` served, the rest aliases;
    prompt logprob candidates by top n, output ones by top n or token ids; the vocabulary size
    and EOS id in ``extra``), and the limits requests are checked against."""
    model = pb.ModelInfo(
        model_id=model_id,
        served_model_name=names[0],
        served_model_aliases=list(names[1:]),
        max_context_length=max_len,
        max_output_tokens=max_len - 1,
        tokenizer_modes=[tokenizer_mode],
        tokenizer=pb.TokenizerInfo(source=tokenizer_source, mode=tokenizer_mode),
        supports_text_input=True,
        supports_token_ids_input=True,
        generation=pb.GenerationCapabilities(
            prompt_logprobs=pb.LogprobCapabilities(
                supported=True, candidate_selection_modes=[_TOP_N], max_top_n=max_logprobs
            ),
            output_logprobs=pb.LogprobCapabilities(
                supported=True, candidate_selection_modes=[_TOP_N, _TOKEN_IDS], max_top_n=max_logprobs
            ),
            guided_decoding=pb.GuidedDecodingCapabilities(supported=True, modes=list(guided_modes)),
            max_num_sequences=max_num_sequences,
            supports_priority=priority,
            supports_stop_in_output=True,
            supports_cache_salt=cache_salt,
            supports_prefix_cache_bypass=prefix_cache_bypass,
        ),
        supports_lora=False,
        supports_multimodal=False,
        extra=pb.Struct.from_dict(
            {"vocab_size": vocab_size, **({"eos_token_id": eos_token_id} if eos_token_id is not None else {})}
        ),
    )
    fields = (vocab_size, max_len, max_num_sequences, max_logprobs, priority, guided_backend)
    return model, ModelLimits(tuple(names), *fields)

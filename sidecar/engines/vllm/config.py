"""Settings of one ``vllm-engine`` process, and the vLLM engine arguments and environment they make.

I/O-free and vLLM-free except :func:`engine_args` (imports vLLM). The settings are what the
command line gives; everything the engine reports in discovery comes from vLLM's own resolved
configuration afterwards (``discovery.py``), never from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sidecar.engines.common import settings as common
from sidecar.engines.common.net import KvEndpoints
from sidecar.engines.common.settings import AdapterSettings, kv_endpoints

__all__ = ["DEFAULT_ENV", "VllmSettings", "apply_env", "engine_args", "kv_endpoints", "serve_argv"]

#: Environment the adapter sets unless the caller already did: a local model directory needs
#: no hub, vLLM's usage reporting stays off, and single-node addresses stay on this host.
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


@dataclass(frozen=True)
class VllmSettings(AdapterSettings):
    """What ``openengine-sidecar vllm-engine`` was asked to run (see ``command.py`` for each flag)."""

    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_gib: int = 1
    kv_cache_blocks: int | None = None
    prefix_caching: bool = True
    enforce_eager: bool = True
    scheduling_policy: str = "fcfs"


def apply_env(settings: VllmSettings) -> None:
    """Set :data:`DEFAULT_ENV` (unless set) and the CPU KV cache size for vLLM's processes."""
    common.apply_env(settings, DEFAULT_ENV)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))


def serve_argv(settings: VllmSettings, python: str, port: int) -> list[str]:
    """Stock ``vllm serve`` (its API server module, run by ``python``) on 127.0.0.1:``port`` with
    the engine settings :func:`engine_args` gives ``vllm-engine`` (for comparisons with vLLM's own
    server; no KV events, no scheduling policy flag)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", settings.model]
    if settings.served_model_names:
        argv += ["--served-model-name", *settings.served_model_names]
    optional = {
        "--block-size": settings.block_size,
        "--num-gpu-blocks-override": settings.kv_cache_blocks,
        "--max-model-len": settings.max_model_len,
        "--max-num-seqs": settings.max_num_seqs,
        "--max-num-batched-tokens": settings.max_num_batched_tokens,
    }
    argv += ["--dtype", settings.dtype]
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--enforce-eager"] if settings.enforce_eager else []
    argv += [] if settings.prefix_caching else ["--no-enable-prefix-caching"]
    argv += ["--max-logprobs", str(settings.max_logprobs), "--seed", str(settings.seed)]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)]


def engine_args(settings: VllmSettings, kv: KvEndpoints | None) -> Any:
    """vLLM's ``AsyncEngineArgs`` for ``settings`` (one process, no tensor/data parallelism)."""
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.prefix_caching,
        "scheduling_policy": settings.scheduling_policy,
        "max_logprobs": settings.max_logprobs,
        "seed": settings.seed,
        "disable_log_stats": True,  # our own stat logger still receives the scheduler's stats
    }
    optional = {
        "served_model_name": list(settings.served_model_names) or None,
        "block_size": settings.block_size,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "num_gpu_blocks_override": settings.kv_cache_blocks,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if kv is not None:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=kv.bind,
            replay_endpoint=kv.replay_bind,
            topic=settings.kv_topic,
            buffer_steps=settings.kv_buffer_steps,
        )
    return AsyncEngineArgs(**kwargs)

"""Settings of one ``sglang-engine`` process, and the SGLang engine arguments and environment they make.

I/O-free and SGLang-free. The settings are what the command line gives; what the engine reports
in discovery comes from SGLang's own resolved configuration afterwards (``discovery.py``).
SGLang runs its generic CPU path here (``--device cpu --attention-backend torch_native``, no
CUDA graphs, no warm-up request): ``SGLANG_USE_CPU_ENGINE`` needs a CPU build of ``sgl_kernel``
that PyPI does not have (docs/ENGINES.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sidecar.engines.common import settings as common
from sidecar.engines.common.net import KvEndpoints
from sidecar.engines.common.settings import AdapterSettings, kv_endpoints

__all__ = ["DEFAULT_ENV", "SglangSettings", "apply_env", "engine_kwargs", "kv_endpoints"]

#: Environment the adapter sets unless the caller already did: a local model directory needs
#: no hub, and nothing reports usage.
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
}


@dataclass(frozen=True)
class SglangSettings(AdapterSettings):
    """What ``openengine-sidecar sglang-engine`` was asked to run (see ``command.py`` for each flag)."""

    page_size: int = 16
    context_length: int | None = None
    max_total_tokens: int = 8192
    max_running_requests: int | None = None
    radix_cache: bool = True


def apply_env(settings: SglangSettings) -> None:
    """Set :data:`DEFAULT_ENV` (unless set)."""
    common.apply_env(settings, DEFAULT_ENV)


def engine_kwargs(settings: SglangSettings, kv: KvEndpoints | None) -> dict[str, Any]:
    """SGLang's ``Engine(**kwargs)`` (its ``ServerArgs``) for ``settings``: one process group, CPU."""
    kwargs: dict[str, Any] = {
        "model_path": settings.model,
        "device": "cpu",
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
        "skip_server_warmup": True,
        "dtype": settings.dtype,
        "page_size": settings.page_size,
        "max_total_tokens": settings.max_total_tokens,
        "disable_radix_cache": not settings.radix_cache,
        "random_seed": settings.seed,
        "log_level": "warning",
    }
    optional = {
        "served_model_name": settings.served_model_names[0] if settings.served_model_names else None,
        "context_length": settings.context_length,
        "max_running_requests": settings.max_running_requests,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if kv is not None:
        kwargs["kv_events_config"] = json.dumps(
            {
                "publisher": "zmq",
                "endpoint": kv.bind,
                "replay_endpoint": kv.replay_bind,
                "topic": settings.kv_topic,
                "buffer_steps": settings.kv_buffer_steps,
            }
        )
    return kwargs

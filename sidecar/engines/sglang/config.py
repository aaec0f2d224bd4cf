"""Settings of one ``sglang-engine`` process, and the SGLang engine arguments and environment they make.

I/O-free and SGLang-free. The settings are what the command line gives; what the engine reports
in discovery comes from SGLang's own resolved configuration afterwards (``discovery.py``).
SGLang runs its generic CPU path here (``--device cpu --attention-backend torch_native``, no
CUDA graphs, no warm-up request): ``SGLANG_USE_CPU_ENGINE`` needs a CPU build of ``sgl_kernel``
that PyPI does not have (docs/ENGINES.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from sidecar.engines.common.net import KvEndpoints, advertised_host
from sidecar.engines.common.net import kv_endpoints as _kv_endpoints

#: Environment the adapter sets unless the caller already did: a local model directory needs
#: no hub, and nothing reports usage.
DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
}


@dataclass(frozen=True)
class SglangSettings:
    """What ``openengine-sidecar sglang-engine`` was asked to run (see ``command.py`` for each flag)."""

    model: str
    listen: str = "127.0.0.1:50051"
    served_model_names: tuple[str, ...] = ()
    dtype: str = "auto"
    page_size: int = 16
    context_length: int | None = None
    max_total_tokens: int = 8192
    max_running_requests: int | None = None
    radix_cache: bool = True
    max_logprobs: int = 20
    seed: int = 0
    kv_events: bool = True
    kv_host: str = ""
    kv_port: int = 0
    kv_replay_port: int = 0
    kv_topic: str = ""
    kv_buffer_steps: int = 10_000
    instance_id: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)

    def advertised_kv_host(self) -> str:
        """The routable host of the KV publisher: ``kv_host``, else the listen host when it is one."""
        return advertised_host(self.listen, self.kv_host)


def kv_endpoints(settings: SglangSettings) -> KvEndpoints:
    return _kv_endpoints(settings.listen, settings.kv_host, settings.kv_port, settings.kv_replay_port)


def apply_env(settings: SglangSettings) -> None:
    """Set :data:`DEFAULT_ENV` (unless set)."""
    for key, value in {**DEFAULT_ENV, **settings.extra_env}.items():
        os.environ.setdefault(key, value)


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

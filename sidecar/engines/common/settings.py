"""What every adapter's settings share: the served model, its listener and its KV event publisher.

:class:`AdapterSettings` holds the flags every adapter command takes (``command.adapter_options``);
an adapter's settings subclass it with its engine's own. I/O-free except :func:`kv_endpoints`
(binds sockets to find free ports) and :func:`apply_env` (sets this process's environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from sidecar.engines.common.net import KvEndpoints, advertised_host
from sidecar.engines.common.net import kv_endpoints as _kv_endpoints


@dataclass(frozen=True)
class AdapterSettings:
    """The model, how it is served, and the engine's KV event publisher (``--kv-*``)."""

    model: str
    listen: str = "127.0.0.1:50051"
    served_model_names: tuple[str, ...] = ()
    dtype: str = "auto"
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


def kv_endpoints(settings: AdapterSettings) -> KvEndpoints:
    """The publisher's endpoints for ``settings`` (a port 0 replaced by a free one)."""
    return _kv_endpoints(settings.listen, settings.kv_host, settings.kv_port, settings.kv_replay_port)


def apply_env(settings: AdapterSettings, defaults: Mapping[str, str]) -> None:
    """Set ``defaults`` and the settings' ``extra_env`` in this process's environment, unless set."""
    for key, value in {**defaults, **settings.extra_env}.items():
        os.environ.setdefault(key, value)


def served_names(name: str, settings: AdapterSettings) -> tuple[str, ...]:
    """The name the engine resolved, then the other ``--served-model-name`` aliases."""
    return (name, *(n for n in settings.served_model_names[1:] if n != name))

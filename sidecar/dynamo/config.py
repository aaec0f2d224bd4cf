"""Settings of the Dynamo worker plane (``run --dynamo``), without any Dynamo import.

Defaults follow Dynamo's own workers: namespace ``dynamo``, component ``backend``
(``prefill`` for a prefill engine), endpoint ``generate``, discovery ``etcd``, request
plane ``tcp``, event plane ``zmq`` — each also read from the ``DYN_*`` variable Dynamo
users already set (see :mod:`sidecar.dynamo.options`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DISCOVERY_BACKENDS",
    "EVENT_PLANES",
    "REQUEST_PLANES",
    "DynamoConfig",
    "DynamoConfigError",
]

DISCOVERY_BACKENDS = ("etcd", "file", "kubernetes", "mem")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("zmq", "nats")
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class DynamoConfigError(ValueError):
    """A ``--dynamo-*`` value is unusable (``str(err)`` names the flag)."""


@dataclass(frozen=True)
class DynamoConfig:
    namespace: str = "dynamo"
    #: ``None``: ``prefill`` for a prefill engine, ``backend`` otherwise (Dynamo's defaults).
    component: str | None = None
    endpoint: str = "generate"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    #: Local tokenizer/model directory to register; ``None``: the engine's tokenizer source.
    model_path: str | None = None
    #: Relay the sidecar's KV events to Dynamo's KV router (needs the KV bridge).
    kv_events: bool = True
    #: Register the engine's tool-call and reasoning parsers with the model.
    parsers: bool = True
    #: After unregistering on SIGTERM, wait this long before draining (routers notice).
    unregister_grace: float = 0.5

    def validate(self) -> None:
        for flag, value in (
            ("--dynamo-namespace", self.namespace),
            ("--dynamo-component", self.component),
            ("--dynamo-endpoint", self.endpoint),
        ):
            if value is not None and not _NAME.fullmatch(value):
                raise DynamoConfigError(f"{flag} {value!r}: use letters, digits, '_' and '-' only")
        for flag, value, allowed in (
            ("--dynamo-discovery-backend", self.discovery_backend, DISCOVERY_BACKENDS),
            ("--dynamo-request-plane", self.request_plane, REQUEST_PLANES),
            ("--dynamo-event-plane", self.event_plane, EVENT_PLANES),
        ):
            if value not in allowed:
                raise DynamoConfigError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
        if self.unregister_grace < 0:
            raise DynamoConfigError("--dynamo-unregister-grace must be >= 0")

    def component_for(self, role: str) -> str:
        """The component name this worker serves under for ``role``."""
        if self.component:
            return self.component
        return "prefill" if role == "prefill" else "backend"

    def endpoint_path(self, role: str) -> str:
        """``namespace.component.endpoint``."""
        return f"{self.namespace}.{self.component_for(role)}.{self.endpoint}"

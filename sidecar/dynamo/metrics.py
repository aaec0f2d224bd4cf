"""Prometheus metrics of the Dynamo plane (on ``sidecar.metrics_registry.REGISTRY``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from sidecar.metrics_registry import REGISTRY

REQUESTS = Counter(
    "openengine_sidecar_dynamo_requests",
    "Dynamo requests ended, by stream outcome (completed, cancelled, failed, rejected).",
    ["outcome"],
    registry=REGISTRY,
)
ROUTABLE = Gauge(
    "openengine_sidecar_dynamo_routable",
    "1 while this worker's endpoint is registered in Dynamo's discovery.",
    registry=REGISTRY,
)
RUNTIME_RESTARTS = Counter(
    "openengine_sidecar_dynamo_runtime_restarts",
    "Dynamo runtimes rebuilt because the runtime shut down on its own (e.g. its etcd lease was lost).",
    registry=REGISTRY,
)

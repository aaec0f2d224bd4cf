"""Prometheus metric families of the sidecar core (registered on ``sidecar.metrics.REGISTRY``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from sidecar.metrics import REGISTRY

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

STREAMS = Counter(
    "openengine_sidecar_streams",
    "Generate streams ended, by outcome and OpenEngine error code.",
    ["outcome", "code"],
    registry=REGISTRY,
)
ACTIVE_STREAMS = Gauge(
    "openengine_sidecar_active_streams", "Admitted Generate streams in flight.", registry=REGISTRY
)
TOKENS = Counter("openengine_sidecar_tokens_relayed", "Output tokens relayed to clients.", registry=REGISTRY)
TTFT = Histogram(
    "openengine_sidecar_time_to_first_token_seconds",
    "From admission to the first output token relayed.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "openengine_sidecar_inter_token_seconds",
    "Between consecutive token events of one stream.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ABORTS = Counter(
    "openengine_sidecar_aborts",
    "Abort calls to the engine by result (aborted, already_finished, not_found, failed).",
    ["result"],
    registry=REGISTRY,
)
ABORT_RETRIES = Counter("openengine_sidecar_abort_retries", "Abort attempts retried.", registry=REGISTRY)
ENGINE_RECONNECTS = Counter(
    "openengine_sidecar_engine_reconnects", "Times the engine came back after being lost.", registry=REGISTRY
)
DRAINING = Gauge("openengine_sidecar_draining", "1 while the sidecar drains.", registry=REGISTRY)
READY = Gauge("openengine_sidecar_ready", "1 while /ready answers 200.", registry=REGISTRY)
CONNECTIONS = Gauge("openengine_sidecar_connections", "Open WebSocket connections.", registry=REGISTRY)
PROTOCOL_ERRORS = Counter(
    "openengine_sidecar_protocol_errors", "Client frames refused as protocol errors.", registry=REGISTRY
)
LOAD_POLL_ERRORS = Counter("openengine_sidecar_load_poll_errors", "Failed GetLoad polls.", registry=REGISTRY)

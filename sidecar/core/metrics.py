"""Prometheus metric families of the sidecar core (registered on ``sidecar.metrics_registry.REGISTRY``)."""

from __future__ import annotations

from typing import TypeVar, cast

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from sidecar.metrics_registry import REGISTRY

#: Token counts a stream adds to ``TOKENS`` at once (and at its end): the counter's lock is
#: taken once per this many tokens, not per token; /metrics lags by at most this per stream.
TOKENS_FLUSH = 64
#: One inter-token gap in this many is observed in ``ITL`` (plus each stream's first gap).
ITL_SAMPLE = 8

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
TOKENS = Counter(
    "openengine_sidecar_tokens_relayed",
    f"Output tokens relayed to clients (added per stream every {TOKENS_FLUSH} tokens and at its end).",
    registry=REGISTRY,
)
TTFT = Histogram(
    "openengine_sidecar_time_to_first_token_seconds",
    "From admission to the first output token relayed.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "openengine_sidecar_inter_token_seconds",
    "Between consecutive token events of one stream, sampled: each stream's first gap, then one"
    f" gap in {ITL_SAMPLE} (the count is about 1/{ITL_SAMPLE} of the gaps; the distribution is kept).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ABORTS = Counter(
    "openengine_sidecar_aborts",
    "Aborts by result (aborted, already_finished, not_found, failed; dropped: an undelivered Abort"
    " pushed out of the full --max-undelivered-aborts set, never sent).",
    ["result"],
    registry=REGISTRY,
)
ABORTS_PARKED = Counter(
    "openengine_sidecar_aborts_parked",
    "Aborts still undelivered after --abort-retry-window (engine unreachable), kept to be re-sent"
    " once it answers again.",
    registry=REGISTRY,
)
ABORTS_UNDELIVERED = Gauge(
    "openengine_sidecar_aborts_undelivered",
    "Aborts kept for re-delivery now (at most --max-undelivered-aborts).",
    registry=REGISTRY,
)
ABORT_RETRIES = Counter("openengine_sidecar_abort_retries", "Abort attempts retried.", registry=REGISTRY)
ABORT_CONFIRMATIONS = Counter(
    "openengine_sidecar_abort_confirmations",
    "Aborts sent again after NOT_FOUND for a request the engine had sent nothing on (it may"
    " have arrived after its Abort), by result (aborted: it had; not_found, already_finished,"
    " failed, no_answer).",
    ["result"],
    registry=REGISTRY,
)
ENGINE_RECONNECTS = Counter(
    "openengine_sidecar_engine_reconnects", "Times the engine came back after being lost.", registry=REGISTRY
)
KEEPALIVE_TIMEOUTS = Counter(
    "openengine_sidecar_engine_keepalive_timeouts",
    "Engine connections closed because an HTTP/2 PING went unanswered (hung engine or dead path).",
    registry=REGISTRY,
)
GENERATE_STALLS = Counter(
    "openengine_sidecar_generate_stalls",
    "Times the engine's Generate path was found stalled (a started stream hit --inactivity-timeout "
    "with no event from the engine on any stream meanwhile).",
    registry=REGISTRY,
)
DRAINING = Gauge("openengine_sidecar_draining", "1 while the sidecar drains.", registry=REGISTRY)
READY = Gauge("openengine_sidecar_ready", "1 while /ready answers 200.", registry=REGISTRY)
ENGINE_INFO = Gauge(
    "openengine_sidecar_engine_info",
    "1, labelled with the engine served (its name and P/D role) once discovered: join on"
    " instance to split any series by role.",
    ["engine", "role"],
    registry=REGISTRY,
)
CONNECTIONS = Gauge("openengine_sidecar_connections", "Open WebSocket connections.", registry=REGISTRY)
HEALTH_CHECKS = Counter(
    "openengine_sidecar_health_checks",
    "Health calls to the engine by result (ok, slow: no answer within --call-timeout, failed).",
    ["result"],
    registry=REGISTRY,
)
ENGINE_CHANNELS = Gauge(
    "openengine_sidecar_engine_generate_channels",
    "HTTP/2 connections to the engine carrying Generate streams (the pool grows with the streams).",
    registry=REGISTRY,
)
PROTOCOL_ERRORS = Counter(
    "openengine_sidecar_protocol_errors", "Client frames refused as protocol errors.", registry=REGISTRY
)
LIMIT_REFUSALS = Counter(
    "openengine_sidecar_limit_refusals",
    "Client work refused at a limit (docs/SECURITY.md), by limit: connections, connections_per_peer,"
    " streams_per_peer, calls_per_connection, client_engine_calls; http_connections,"
    " http_connections_per_peer (probe port: a connection refused or an idle one closed for a new one).",
    ["limit"],
    registry=REGISTRY,
)
LOAD_POLL_ERRORS = Counter("openengine_sidecar_load_poll_errors", "Failed GetLoad polls.", registry=REGISTRY)
LOAD_ATTRIBUTES_DROPPED = Counter(
    "openengine_sidecar_load_attributes_dropped",
    "GetLoad answers whose attributes exceeded the size limit and were not converted (the card shows none).",
    registry=REGISTRY,
)

M = TypeVar("M", bound=MetricWrapperBase)

_children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}


def child(metric: M, *values: str) -> M:
    """``metric.labels(*values)``, cached (``labels()`` costs a lock and a dict build per call)."""
    key = (id(metric), values)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*values)
    return cast(M, found)  # the child of ``metric`` (its id is in the key): a metric of its class


HTTP_FAILURES = Counter(
    "openengine_sidecar_http_failures",
    "HTTP listener failures, by level: a connection closed on an error, or the listener restarted.",
    ["level"],
    registry=REGISTRY,
)

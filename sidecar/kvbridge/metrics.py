"""Prometheus metrics of the KV event bridge (on ``sidecar.metrics_registry.REGISTRY``), per DP rank.

``rank`` is the DP rank as a string. Names start ``openengine_sidecar_kv_``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from sidecar.metrics_registry import REGISTRY

_P = "openengine_sidecar_kv_"

EVENTS_IN = Counter(
    _P + "events_in", "KV events received from the engine and decoded.", ["rank"], registry=REGISTRY
)
EVENTS_OUT = Counter(
    _P + "events_out", "KV events published (AllBlocksCleared resyncs included).", ["rank"], registry=REGISTRY
)
BATCHES_IN = Counter(
    _P + "batches_in", "KV event batches received from the engine.", ["rank"], registry=REGISTRY
)
BATCHES_OUT = Counter(_P + "batches_out", "KV event batches published.", ["rank"], registry=REGISTRY)
GAPS = Counter(_P + "gaps", "Upstream sequence gaps detected.", ["rank"], registry=REGISTRY)
REPLAYS = Counter(
    _P + "replays",
    "Upstream replays / resumed subscriptions, by outcome (ok, failed, over_limit: abandoned at a limit).",
    ["rank", "outcome"],
    registry=REGISTRY,
)
RESYNCS = Counter(
    _P + "resyncs",
    "AllBlocksCleared published because upstream history was lost, by reason.",
    ["rank", "reason"],
    registry=REGISTRY,
)
DUPLICATES = Counter(
    _P + "duplicates", "Upstream batches dropped as already published.", ["rank"], registry=REGISTRY
)
DECODE_ERRORS = Counter(
    _P + "decode_errors", "Upstream messages that did not decode.", ["rank"], registry=REGISTRY
)
LAG = Gauge(
    _P + "lag_seconds",
    "Publish time minus the engine's batch timestamp, for the last published batch.",
    ["rank"],
    registry=REGISTRY,
)
SILENCE_PROBES = Counter(
    _P + "silence_probes",
    "Replays asked of a silent ZMQ source for what follows its last batch.",
    ["rank"],
    registry=REGISTRY,
)
HEARTBEATS = Counter(
    _P + "heartbeats",
    "Idle heartbeats: a batch with no events published after --kv-heartbeat seconds without one.",
    ["rank"],
    registry=REGISTRY,
)
REPLAY_REQUESTS = Counter(
    _P + "replay_requests_served",
    "Replay requests answered by the bridge's ROUTER.",
    ["rank"],
    registry=REGISTRY,
)

REPLAY_DROPPED = Counter(
    _P + "replay_requests_dropped",
    "Replay requests the bridge's ROUTER did not (fully) answer, by reason "
    "(busy, slow, evicted, superseded, gone, malformed).",
    ["rank", "reason"],
    registry=REGISTRY,
)
REPLAYS_ACTIVE = Gauge(
    _P + "replays_active", "Replays the bridge's ROUTER is sending.", ["rank"], registry=REGISTRY
)


class RankMetrics:
    """The label children of one rank, resolved once (``labels()`` is too slow per batch)."""

    __slots__ = (
        "batches_in",
        "batches_out",
        "decode_errors",
        "duplicates",
        "events_in",
        "events_out",
        "gaps",
        "heartbeats",
        "lag",
        "rank",
        "replay_requests",
        "replays_active",
        "silence_probes",
    )

    def __init__(self, rank: int) -> None:
        r = str(rank)
        self.rank = r
        self.events_in = EVENTS_IN.labels(r)
        self.events_out = EVENTS_OUT.labels(r)
        self.batches_in = BATCHES_IN.labels(r)
        self.batches_out = BATCHES_OUT.labels(r)
        self.gaps = GAPS.labels(r)
        self.duplicates = DUPLICATES.labels(r)
        self.decode_errors = DECODE_ERRORS.labels(r)
        self.lag = LAG.labels(r)
        self.replay_requests = REPLAY_REQUESTS.labels(r)
        self.replays_active = REPLAYS_ACTIVE.labels(r)
        self.heartbeats = HEARTBEATS.labels(r)
        self.silence_probes = SILENCE_PROBES.labels(r)

    def replay(self, outcome: str) -> None:
        REPLAYS.labels(self.rank, outcome).inc()

    def resync(self, reason: str) -> None:
        RESYNCS.labels(self.rank, reason).inc()

    def replay_dropped(self, reason: str) -> None:
        REPLAY_DROPPED.labels(self.rank, reason).inc()

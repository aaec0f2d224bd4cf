"""Per-DP-rank load gauges from the latest ``GetLoad`` (absent values are not exported)."""

from __future__ import annotations

from prometheus_client import Gauge

from sidecar.metrics_registry import REGISTRY
from sidecar.openengine import pb

RUNNING = Gauge(
    "openengine_engine_running_requests", "Running requests per DP rank.", ["rank"], registry=REGISTRY
)
QUEUED = Gauge(
    "openengine_engine_queued_requests", "Queued requests per DP rank.", ["rank"], registry=REGISTRY
)
KV_USED = Gauge(
    "openengine_engine_kv_blocks_used", "KV blocks in use per DP rank.", ["rank"], registry=REGISTRY
)
KV_TOTAL = Gauge("openengine_engine_kv_blocks_total", "KV blocks per DP rank.", ["rank"], registry=REGISTRY)


def export(info: pb.LoadInfo) -> None:
    """Set the gauges from one snapshot: per rank when reported, else the totals as rank ``all``."""
    rows: list[tuple[str, pb.RankLoadInfo | pb.LoadInfo]] = [
        (str(r.data_parallel_rank), r) for r in info.ranks if r.data_parallel_rank is not None
    ]
    if not rows:
        rows = [("all", info)]
    for label, row in rows:
        for gauge, value in (
            (RUNNING, row.running_requests),
            (QUEUED, row.queued_requests),
            (KV_USED, row.used_kv_blocks),
            (KV_TOTAL, row.total_kv_blocks),
        ):
            if value is not None:
                gauge.labels(label).set(value)

"""Shared pieces of the networked bridge tests."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from sidecar.kvbridge import KvBridgeConfig, KvBridgeInfo, KvSource, run_kv_bridge
from sidecar.metrics_registry import REGISTRY

CLEARED = {"type": "AllBlocksCleared"}


async def start_bridge(
    nursery: trio.Nursery,
    sources: Sequence[KvSource] | None = None,
    *,
    client: Any = None,
    tracer: Any = None,
    **cfg: Any,
) -> KvBridgeInfo:
    cfg.setdefault("publish_endpoint", "tcp://127.0.0.1:0")
    cfg.setdefault("replay_endpoint", "tcp://127.0.0.1:0")
    cfg.setdefault("replay_timeout", 2.0)
    cfg.setdefault("backoff_initial", 0.01)
    cfg.setdefault("backoff_max", 0.05)
    config = KvBridgeConfig(**cfg)
    info: KvBridgeInfo = await nursery.start(
        partial(run_kv_bridge, config, engine_client=client, sources=sources, tracer=tracer)
    )
    return info


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"openengine_sidecar_kv_{name}_total", labels) or 0.0


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


class Metrics:
    """KV-bridge counter deltas since creation, for one rank (the registry is process-wide)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = str(rank)
        self._base = _samples()

    def delta(self, name: str, **labels: str) -> float:
        key = (f"openengine_sidecar_kv_{name}_total", tuple(sorted({"rank": self.rank, **labels}.items())))
        return _samples().get(key, 0.0) - self._base.get(key, 0.0)


def flat(batches: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [e for b in batches for e in b]

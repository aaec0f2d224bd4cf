"""The Gateway API Inference Extension's model-server metrics, for any engine behind the sidecar.

GIE's endpoint picker scrapes each model server's ``/metrics`` for a few gauges with vLLM's
names (its model-server protocol, docs/OPENAI.md names the version). The sidecar exports them
whatever the engine — vLLM, SGLang, TensorRT-LLM, simulated — from the engine's own ``GetLoad``
reports and the worker card, read at scrape time (:class:`GieCollector`; nothing is polled
for it):

- ``vllm:num_requests_waiting`` (gauge): ``queued_requests`` of the latest report (summed over
  the DP ranks when only they carry it);
- ``vllm:num_requests_running`` (gauge): ``running_requests``, the same way;
- ``vllm:kv_cache_usage_perc`` (gauge): ``used_kv_blocks / total_kv_blocks``, a fraction from 0
  to 1 as vLLM reports it;
- ``vllm:lora_requests_info`` (gauge, the scrape's Unix time): labels ``max_lora`` (the card's
  ``max_loras``, 0 when not reported), ``running_lora_adapters`` (the adapters the engine has
  loaded, comma-separated: ready to serve) and ``waiting_lora_adapters`` (adapters of requests
  admitted here that wait for their first token);
- ``vllm:cache_config_info`` (gauge, 1): labels ``block_size`` and ``num_gpu_blocks`` from the
  card's capacity (GIE's optional block-size metric).

The labels are vLLM's: the three load gauges carry ``model_name`` (the first served model) and
``engine`` (``0``), ``cache_config_info`` ``engine``. A value the engine does not report is not exported (no guess): before the first load
report the three load gauges are absent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.core.card import WorkerCard
from sidecar.core.lifecycle import StreamSupervisor
from sidecar.core.load import LoadTracker
from sidecar.metrics_registry import REGISTRY

__all__ = ["GieCollector", "MetricsHost", "install"]

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG = "vllm:cache_config_info"


class MetricsHost(Protocol):
    """What the collector reads (``sidecar.core.sidecar.Sidecar``)."""

    load: LoadTracker
    supervisor: StreamSupervisor

    @property
    def card(self) -> WorkerCard | None: ...


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


class GieCollector(Collector):
    """Collects the GIE gauges from ``host`` at each scrape (module doc)."""

    def __init__(self, host: MetricsHost | None = None) -> None:
        self.host = host

    def describe(self) -> list[Metric]:
        return [
            GaugeMetricFamily(WAITING, "Requests queued in the engine (GetLoad queued_requests)."),
            GaugeMetricFamily(RUNNING, "Requests running in the engine (GetLoad running_requests)."),
            GaugeMetricFamily(KV_USAGE, "KV cache usage, 0 to 1 (GetLoad used / total KV blocks)."),
            GaugeMetricFamily(LORA_INFO, "LoRA adapters: loaded (running), waiting; value: Unix time."),
            GaugeMetricFamily(CACHE_CONFIG, "KV cache configuration (block_size, num_gpu_blocks); value 1."),
        ]

    def collect(self) -> Iterator[Metric]:
        host = self.host
        card = host.card if host is not None else None
        if host is None or card is None:
            return
        labels = ["model_name", "engine"]
        values = [card.models[0].served_model_name if card.models else "", "0"]
        snap = host.load.snapshot
        if snap is not None:
            ranks = snap.ranks
            waiting = snap.queued_requests
            running = snap.running_requests
            used: int | None = snap.used_kv_blocks
            total: int | None = snap.total_kv_blocks
            if waiting is None and ranks:
                waiting = _sum([r.queued_requests for r in ranks])
            if running is None and ranks:
                running = _sum([r.running_requests for r in ranks])
            if (used is None or total is None) and ranks:
                used = _sum([r.used_kv_blocks for r in ranks])
                total = _sum([r.total_kv_blocks for r in ranks])
            for name, doc, value in (
                (WAITING, "Requests queued in the engine.", waiting),
                (RUNNING, "Requests running in the engine.", running),
                (KV_USAGE, "KV cache usage, 0 to 1.", None if not total or used is None else used / total),
            ):
                if value is not None:
                    family = GaugeMetricFamily(name, doc, labels=labels)
                    family.add_metric(values, float(value))
                    yield family
        yield self._lora(card, host)
        cap = card.capacity
        if cap is not None and cap.kv_block_size:
            family = GaugeMetricFamily(
                CACHE_CONFIG, "KV cache configuration.", labels=["block_size", "num_gpu_blocks", "engine"]
            )
            family.add_metric([str(cap.kv_block_size), str(cap.total_kv_blocks or 0), "0"], 1.0)
            yield family

    @staticmethod
    def _lora(card: WorkerCard, host: MetricsHost) -> Metric:
        loaded = [a.lora_name for a in card.lora_adapters or ()]
        waiting: list[str] = []
        for handle in list(host.supervisor.streams.values()):
            name = handle.request.lora_name
            if name and not handle.started and name not in waiting:
                waiting.append(name)
        max_lora = card.capacity.max_loras if card.capacity is not None else None
        family = GaugeMetricFamily(
            LORA_INFO,
            "LoRA adapters loaded (running) and waiting for a first token; value: Unix time.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric([str(max_lora or 0), ",".join(waiting), ",".join(loaded)], time.time())
        return family


_COLLECTOR = GieCollector()
_installed = False


def install(host: MetricsHost) -> GieCollector:
    """Export the GIE gauges of ``host`` on the sidecar's registry (once per process; a later
    call points them at the new host)."""
    global _installed
    _COLLECTOR.host = host
    if not _installed:
        REGISTRY.register(_COLLECTOR)
        _installed = True
    return _COLLECTOR

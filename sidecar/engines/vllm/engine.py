"""The vLLM adapter's engine beside vLLM's ``AsyncLLM``: admission, Health, GetLoad, vLLM's stats.

One :class:`VllmEngine` per process (asyncio, one event loop). The request registry, Abort and
Drain are the engine-neutral :class:`~sidecar.engines.common.registry.AdapterEngine`; this class
plans requests for vLLM (``requests.plan_request``), aborts them in ``AsyncLLM`` and reports
vLLM's state.

Load counts the registry (what is in flight here), split by vLLM's scheduler stats (running,
waiting, KV cache usage), which :class:`SchedulerStatsSink` receives after every engine step
through vLLM's stat-logger hook; ``AsyncLLM.check_health`` says whether the engine core is alive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from sidecar.engines.common.registry import (
    ABORTED,
    CANCELLED,
    COMPLETED,
    FAILED,
    Active,
    AdapterEngine,
)
from sidecar.engines.vllm.discovery import VllmDiscovery
from sidecar.engines.vllm.requests import VllmPlan, plan_request
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

log = logging.getLogger(__name__)

__all__ = ["ABORTED", "CANCELLED", "COMPLETED", "FAILED", "Active", "SchedulerStatsSink", "VllmEngine"]


class SchedulerStatsSink:
    """The latest ``SchedulerStats`` of vLLM's engine core (a per-engine stat-logger factory)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.updated_ns: int | None = None
        self.steps = 0
        self.on_update: Callable[[], None] | None = None

    @property
    def busy(self) -> int:
        """Requests vLLM's scheduler holds (running + waiting) as of its last step."""
        return self.running + self.waiting

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """vLLM calls this once per engine core; the logger writes into this sink."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    sink.running = scheduler_stats.num_running_reqs
                    sink.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                    sink.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                    sink.updated_ns = time.time_ns()
                    sink.steps += 1
                    if sink.on_update is not None:
                        sink.on_update()

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


class VllmEngine(AdapterEngine):
    """Admission, Abort, Health and GetLoad around one ``AsyncLLM`` (registry and Drain inherited)."""

    def __init__(self, llm: Any, discovery: VllmDiscovery, stats: SchedulerStatsSink) -> None:
        super().__init__()
        self.llm = llm
        self.discovery = discovery
        self.stats = stats
        stats.on_update = self.changed.set

    @property
    def engine_busy(self) -> int:
        """Requests vLLM's scheduler holds as of its last step."""
        return self.stats.busy

    @property
    def instance_id(self) -> str:
        return self.discovery.server.instance_id

    def refusal(self) -> RpcStatusError | None:
        if self.llm.errored:
            return RpcStatusError("UNAVAILABLE", "the vLLM engine core is not running")
        return None

    def plan(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]]) -> VllmPlan:
        return plan_request(request, metadata, self.discovery.limits)

    async def engine_abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    # -- health and load -----------------------------------------------------------------

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        try:
            await self.llm.check_health()
            core = pb.HealthCheck(
                name="engine_core", state=pb.HealthState.READY, message="vLLM engine core alive"
            )
        except Exception as err:
            core = pb.HealthCheck(
                name="engine_core", state=pb.HealthState.NOT_READY, message=str(err) or "dead"
            )
        scheduler = f"{self.stats.running} running, {self.stats.waiting} waiting"
        return self.overall_health(core, scheduler, message, self.discovery.limits.names)

    def requests_load(self) -> tuple[int, int]:
        """``(running, queued)``: the requests in flight here (accepted, terminal not sent), of
        which as many as vLLM's scheduler last reported waiting are queued.

        The registry is the count (the adapter is vLLM's only submitter): vLLM's stats arrive
        only after an engine step, and they drop a request vLLM has finished while its events
        still wait for a slow client (vLLM runs ahead of the stream), which Abort and Drain
        still count; the stats only split the count."""
        return self.split_in_flight(self.stats.waiting)

    def load(self, include_per_rank: bool, *, report_aborts: bool = False) -> pb.LoadInfo:
        """``LoadInfo``: requests from :meth:`requests_load`, KV blocks from vLLM's scheduler
        stats; the adapter's counters in ``attributes`` (a few scalars, as a real engine sends:
        the sidecar polls this every second), plus the Aborts per request id (up to 4,096) when
        ``report_aborts``."""
        stats = self.stats
        total = self.discovery.total_kv_blocks
        used = min(total, round(stats.kv_cache_usage * total))
        attrs = {
            "vllm_unfinished_requests": self.llm.get_num_unfinished_requests(),
            "vllm_stats_steps": stats.steps,
            "vllm_running": stats.running,
            "vllm_waiting": stats.waiting,
        }
        return self.load_info(include_per_rank, report_aborts, self.requests_load(), (used, total), attrs)

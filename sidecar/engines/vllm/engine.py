"""The adapter's state beside vLLM's ``AsyncLLM``: the request registry, Abort, Health, GetLoad, Drain.

One :class:`VllmEngine` per process (asyncio, one event loop). Request lifecycle: ``admit``
(synchronous: every refusal is an :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError`, a non-OK
status before acceptance) registers the request; ``stream.run_request`` drives it through
``AsyncLLM.generate``; ``finish`` ends it with one outcome and remembers its id (bounded) so a
later Abort answers ``ALREADY_FINISHED``.

Load counts the registry (what is in flight here), split by vLLM's scheduler stats (running,
waiting, KV cache usage), which :class:`SchedulerStatsSink` receives after every engine step
through vLLM's stat-logger hook; ``AsyncLLM.check_health`` says whether the engine core is alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import betterproto2

from sidecar.engines.vllm.discovery import Discovery
from sidecar.engines.vllm.requests import Plan, plan_request
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

log = logging.getLogger(__name__)

FINISHED_MEMORY = 100_000  # finished request ids kept for ALREADY_FINISHED
RECENT_ABORTS = 4_096  # per-request Abort counts kept for GetLoad
_DRAIN_HEARTBEAT = 1.0
_ABORT_GRACE = 5.0

# outcomes (exactly one per accepted request)
COMPLETED = "completed"
ABORTED = "aborted"
CANCELLED = "cancelled"  # the client left (stream reset) before the terminal
FAILED = "failed"


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


@dataclass(eq=False)
class Active:
    """One accepted request."""

    plan: Plan
    abort_reason: str | None = None
    first_event: bool = False

    @property
    def id(self) -> str:
        return self.plan.request_id


@dataclass
class Counters:
    """What the adapter saw (reported in ``GetLoad.attributes``)."""

    requests_accepted: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    aborts_received: int = 0
    abort_outcomes: Counter[str] = field(default_factory=Counter)
    aborts_by_request: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def abort_seen(self, request_id: str | None) -> None:
        self.aborts_received += 1
        if request_id:
            self.aborts_by_request[request_id] = self.aborts_by_request.pop(request_id, 0) + 1
            while len(self.aborts_by_request) > RECENT_ABORTS:
                self.aborts_by_request.popitem(last=False)


class VllmEngine:
    """Registry, Abort, Health, GetLoad and Drain around one ``AsyncLLM``."""

    def __init__(self, llm: Any, discovery: Discovery, stats: SchedulerStatsSink) -> None:
        self.llm = llm
        self.discovery = discovery
        self.stats = stats
        self.requests: dict[str, Active] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.counters = Counters()
        self.draining = False
        self.closing = False
        self.changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        stats.on_update = self.changed.set

    @property
    def in_flight(self) -> int:
        """Accepted requests not ended here, or still held by vLLM's scheduler (an abort reaches the
        engine core a moment after the stream has ended)."""
        return max(len(self.requests), self.stats.busy)

    @property
    def instance_id(self) -> str:
        return self.discovery.server.instance_id

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` to its end even if the caller is cancelled (vLLM aborts on a reset stream)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- admission ---------------------------------------------------------------------

    def admit(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]]) -> Active:
        """Check and register ``request``; raises :class:`RpcStatusError` (counted) on refusal."""
        try:
            if self.draining:
                raise RpcStatusError("UNAVAILABLE", "engine is draining; not accepting new requests")
            if self.llm.errored:
                raise RpcStatusError("UNAVAILABLE", "the vLLM engine core is not running")
            plan = plan_request(request, metadata, self.discovery.limits)
            if plan.request_id in self.requests:
                raise RpcStatusError("ALREADY_EXISTS", f"request {plan.request_id!r} is already in flight")
        except RpcStatusError as err:
            self.counters.rejected[err.status] += 1
            raise
        active = Active(plan)
        self.requests[active.id] = active
        self.finished.pop(active.id, None)
        self.counters.requests_accepted += 1
        self.changed.set()
        return active

    def finish(self, active: Active, outcome: str) -> None:
        """End ``active`` with ``outcome`` (once); refused requests are forgotten instead."""
        if self.requests.get(active.id) is not active:
            return
        del self.requests[active.id]
        self.counters.outcomes[outcome] += 1
        self.finished[active.id] = None
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
        self.changed.set()

    def forget(self, active: Active) -> None:
        """``active`` was refused by vLLM before any event: as if never accepted."""
        if self.requests.get(active.id) is active:
            del self.requests[active.id]
            self.counters.requests_accepted -= 1
            self.changed.set()

    # -- abort -------------------------------------------------------------------------

    async def _abort_ids(self, actives: list[Active], reason: str) -> None:
        for active in actives:
            active.abort_reason = active.abort_reason or reason
        if actives:
            await self.llm.abort([a.id for a in actives])

    async def abort(self, message: pb.AbortRequest) -> pb.AbortResponse:
        """Abort by request id or all; idempotent (docs/LIFECYCLE.md). Raises RpcStatusError."""
        name, value = betterproto2.which_one_of(message, "target")
        self.counters.abort_seen(value if name == "request_id" else None)
        try:
            status, text = await self._abort(name, value)
        except RpcStatusError as err:
            self.counters.abort_outcomes[err.status] += 1
            raise
        self.counters.abort_outcomes[pb.AbortStatus(status).name] += 1
        return pb.AbortResponse(status=status, message=text)

    async def _abort(self, name: str | None, value: Any) -> tuple[pb.AbortStatus, str]:
        if name == "request_id":
            if not value:
                raise RpcStatusError("INVALID_ARGUMENT", "abort: request_id is empty")
            active = self.requests.get(value)
            if active is not None:
                await self._abort_ids([active], "abort")
                return pb.AbortStatus.ABORTED, f"request {value} aborted"
            if value in self.finished:
                return pb.AbortStatus.ALREADY_FINISHED, f"request {value} already finished"
            raise RpcStatusError("NOT_FOUND", f"abort: no request {value!r}")
        if name == "all_requests":
            actives = list(self.requests.values())
            await self._abort_ids(actives, "abort")
            return pb.AbortStatus.ABORTED, f"aborted {len(actives)} request(s)"
        if name == "kv_session":
            raise RpcStatusError("NOT_FOUND", "abort: this aggregated engine holds no KV sessions")
        raise RpcStatusError(
            "INVALID_ARGUMENT", "abort: exactly one target (request_id, kv_session, all_requests) is required"
        )

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
        state = (
            pb.HealthState.NOT_READY
            if core.state != pb.HealthState.READY
            else pb.HealthState.DRAINING
            if self.draining
            else pb.HealthState.READY
        )
        checks = [
            core,
            pb.HealthCheck(
                name="scheduler",
                state=pb.HealthState.DRAINING if self.draining else pb.HealthState.READY,
                message=f"{self.stats.running} running, {self.stats.waiting} waiting",
            ),
        ]
        if message.role != pb.EngineRole.UNSPECIFIED:
            ok = message.role == pb.EngineRole.AGGREGATED
            checks.append(
                pb.HealthCheck(
                    name="role",
                    state=pb.HealthState.READY if ok else pb.HealthState.NOT_READY,
                    message="engine role is aggregated",
                )
            )
            if not ok and state == pb.HealthState.READY:
                state = pb.HealthState.NOT_READY
        if message.model and message.model not in self.discovery.limits.names:
            checks.append(
                pb.HealthCheck(
                    name="model", state=pb.HealthState.NOT_READY, message=f"unknown model {message.model!r}"
                )
            )
        return pb.HealthResponse(state=state, checks=checks)

    def requests_load(self) -> tuple[int, int]:
        """``(running, queued)``: the requests in flight here (accepted, terminal not sent), of
        which as many as vLLM's scheduler last reported waiting are queued.

        The registry is the count (the adapter is vLLM's only submitter): vLLM's stats arrive
        only after an engine step, and they drop a request vLLM has finished while its events
        still wait for a slow client (vLLM runs ahead of the stream), which Abort and Drain
        still count; the stats only split the count."""
        n = len(self.requests)
        queued = min(self.stats.waiting, n)
        return n - queued, queued

    def load(self, include_per_rank: bool, *, report_aborts: bool = False) -> pb.LoadInfo:
        """``LoadInfo``: requests from :meth:`requests_load`, KV blocks from vLLM's scheduler
        stats; the adapter's counters in ``attributes`` (a few scalars, as a real engine sends:
        the sidecar polls this every second), plus the Aborts per request id (up to 4,096) when
        ``report_aborts``."""
        stats = self.stats
        running, queued = self.requests_load()
        total = self.discovery.total_kv_blocks
        used = min(total, round(stats.kv_cache_usage * total))
        info = pb.LoadInfo(
            instance_id=self.instance_id,
            timestamp_unix_nanos=time.time_ns(),
            running_requests=running,
            queued_requests=queued,
            active_kv_sessions=0,
            used_kv_blocks=used,
            total_kv_blocks=total,
        )
        if include_per_rank:
            info.ranks = [
                pb.RankLoadInfo(
                    data_parallel_rank=0,
                    running_requests=running,
                    queued_requests=queued,
                    used_kv_blocks=used,
                    total_kv_blocks=total,
                )
            ]
        c = self.counters
        attrs: dict[str, Any] = {
            "in_flight": len(self.requests),
            "vllm_unfinished_requests": self.llm.get_num_unfinished_requests(),
            "vllm_stats_steps": stats.steps,
            "vllm_running": stats.running,
            "vllm_waiting": stats.waiting,
            "requests_accepted": c.requests_accepted,
            "outcomes": dict(c.outcomes),
            "rejected": dict(c.rejected),
            "aborts_received": c.aborts_received,
            "abort_outcomes": dict(c.abort_outcomes),
            "draining": self.draining,
        }
        if report_aborts:
            attrs["aborts_by_request"] = dict(c.aborts_by_request)
        info.attributes = pb.Struct.from_dict(attrs)
        return info

    # -- drain -------------------------------------------------------------------------

    def _drain_state(self, state: pb.DrainState, message: str = "") -> pb.DrainResponse:
        return pb.DrainResponse(
            state=state, in_flight_requests=self.in_flight, open_kv_sessions=0, message=message
        )

    async def drain(self, request: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]:
        """``STARTED``, ``IN_PROGRESS`` on changes (and every second), ``COMPLETE`` when nothing is in
        flight; at ``deadline_ms`` (0 = now) either complete at once or, with
        ``abort_after_deadline``, abort everything first. ``stop_accepting_new_requests`` is final."""
        loop = asyncio.get_running_loop()
        if request.stop_accepting_new_requests:
            self.draining = True
        deadline = None if request.deadline_ms is None else loop.time() + request.deadline_ms / 1000.0
        yield self._drain_state(pb.DrainState.STARTED, "drain started")
        last = self.in_flight
        aborted = False
        while self.in_flight:
            now = loop.time()
            if deadline is not None and now >= deadline:
                if not request.abort_after_deadline:
                    yield self._drain_state(
                        pb.DrainState.COMPLETE, "deadline reached; requests still in flight"
                    )
                    return
                if aborted:
                    yield self._drain_state(
                        pb.DrainState.COMPLETE, "deadline reached; aborted requests did not end"
                    )
                    return
                aborted = True
                await self._abort_ids(list(self.requests.values()), "drain deadline")
                deadline = now + _ABORT_GRACE
                continue
            self.changed.clear()
            timeout = (
                _DRAIN_HEARTBEAT if deadline is None else max(0.0, min(_DRAIN_HEARTBEAT, deadline - now))
            )
            try:
                async with asyncio.timeout(timeout):
                    await self.changed.wait()
            except TimeoutError:
                pass
            if self.in_flight != last or not self.changed.is_set():
                last = self.in_flight
                yield self._drain_state(pb.DrainState.IN_PROGRESS)
        yield self._drain_state(
            pb.DrainState.COMPLETE, "aborted in-flight work at the deadline" if aborted else "drained"
        )

    async def shutdown(self) -> None:
        """Abort what is still running (server shutdown) and let spawned aborts finish (bounded)."""
        self.closing = True
        if self.requests:
            await self._abort_ids(list(self.requests.values()), "shutdown")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)

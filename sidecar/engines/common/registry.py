"""The engine-neutral half of an adapter: the request registry, Abort, Drain and the counters.

One :class:`AdapterEngine` subclass per adapter process (asyncio, one event loop): the vLLM
adapter's ``VllmEngine``, the SGLang adapter's ``SglangEngine``. Request lifecycle: ``admit``
(synchronous: every refusal is an :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError`, a non-OK
status before acceptance) registers the request the subclass's ``plan`` made; the adapter's
stream driver runs it; ``finish`` ends it with one outcome and remembers its id (bounded) so a
later Abort answers ``ALREADY_FINISHED``. A subclass supplies ``plan`` (check and map a
request), ``engine_abort`` (tell the engine to stop requests), ``refusal`` (is the engine able
to take work) and, when the engine holds requests the registry no longer does,
``engine_busy``; Health and GetLoad are the subclass's own, built with ``overall_health`` and
``load_info``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import betterproto2

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


class Planned(Protocol):
    """What a subclass's ``plan`` returns: at least the request id."""

    request_id: str


@dataclass(eq=False)
class Active:
    """One accepted request (``plan`` is the subclass's mapped request)."""

    plan: Any
    abort_reason: str | None = None
    first_event: bool = False

    @property
    def id(self) -> str:
        return str(self.plan.request_id)


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

    def attributes(self) -> dict[str, Any]:
        """The counters as ``GetLoad.attributes`` entries (per-request Aborts not included)."""
        return {
            "requests_accepted": self.requests_accepted,
            "outcomes": dict(self.outcomes),
            "rejected": dict(self.rejected),
            "aborts_received": self.aborts_received,
            "abort_outcomes": dict(self.abort_outcomes),
        }


class AdapterEngine:
    """Registry, Abort and Drain around one engine (see the module doc for the hooks)."""

    def __init__(self) -> None:
        self.requests: dict[str, Active] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.counters = Counters()
        self.draining = False
        self.closing = False
        self.changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- hooks -------------------------------------------------------------------------

    def plan(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]]) -> Any:
        """Check and map ``request``; raises :class:`RpcStatusError` for a refusal."""
        raise NotImplementedError

    def refusal(self) -> RpcStatusError | None:
        """Why the engine cannot take new work right now (``UNAVAILABLE``), if it cannot."""
        return None

    async def engine_abort(self, request_ids: list[str]) -> None:
        """Tell the engine to stop ``request_ids`` (idempotent; unknown ids are ignored)."""
        raise NotImplementedError

    @property
    def instance_id(self) -> str:
        """The instance id the engine advertises (``GetLoad`` carries it)."""
        raise NotImplementedError

    @property
    def engine_busy(self) -> int:
        """Requests the engine itself still holds (0 when it cannot say)."""
        return 0

    # -- registry ----------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Accepted requests not ended here, or still held by the engine (an abort reaches its
        scheduler a moment after the stream has ended)."""
        return max(len(self.requests), self.engine_busy)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` to its end even if the caller is cancelled (aborts on a reset stream)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def admit(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]]) -> Active:
        """Check and register ``request``; raises :class:`RpcStatusError` (counted) on refusal."""
        try:
            if self.draining:
                raise RpcStatusError("UNAVAILABLE", "engine is draining; not accepting new requests")
            refusal = self.refusal()
            if refusal is not None:
                raise refusal
            plan = self.plan(request, metadata)
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
        """``active`` was refused by the engine before any event: as if never accepted."""
        if self.requests.get(active.id) is active:
            del self.requests[active.id]
            self.counters.requests_accepted -= 1
            self.changed.set()

    # -- abort -------------------------------------------------------------------------

    async def abort_actives(self, actives: list[Active], reason: str) -> None:
        for active in actives:
            active.abort_reason = active.abort_reason or reason
        if actives:
            await self.engine_abort([a.id for a in actives])

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
                await self.abort_actives([active], "abort")
                return pb.AbortStatus.ABORTED, f"request {value} aborted"
            if value in self.finished:
                return pb.AbortStatus.ALREADY_FINISHED, f"request {value} already finished"
            raise RpcStatusError("NOT_FOUND", f"abort: no request {value!r}")
        if name == "all_requests":
            actives = list(self.requests.values())
            await self.abort_actives(actives, "abort")
            return pb.AbortStatus.ABORTED, f"aborted {len(actives)} request(s)"
        if name == "kv_session":
            raise RpcStatusError("NOT_FOUND", "abort: this aggregated engine holds no KV sessions")
        raise RpcStatusError(
            "INVALID_ARGUMENT", "abort: exactly one target (request_id, kv_session, all_requests) is required"
        )

    # -- health helpers ------------------------------------------------------------------

    def overall_health(
        self, core: pb.HealthCheck, scheduler_message: str, message: pb.HealthRequest, names: Sequence[str]
    ) -> pb.HealthResponse:
        """``HealthResponse`` from the engine's own check ``core``: draining, role and model checks added."""
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
                message=scheduler_message,
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
        if message.model and message.model not in names:
            checks.append(
                pb.HealthCheck(
                    name="model", state=pb.HealthState.NOT_READY, message=f"unknown model {message.model!r}"
                )
            )
        return pb.HealthResponse(state=state, checks=checks)

    # -- load helpers --------------------------------------------------------------------

    def split_in_flight(self, waiting: int) -> tuple[int, int]:
        """``(running, queued)``: the requests in flight here, of which as many as the engine
        reports ``waiting`` are queued."""
        n = len(self.requests)
        queued = min(waiting, n)
        return n - queued, queued

    def load_info(
        self,
        include_per_rank: bool,
        report_aborts: bool,
        requests: tuple[int, int],
        kv_blocks: tuple[int, int],
        engine_attributes: dict[str, Any],
    ) -> pb.LoadInfo:
        """``LoadInfo`` of rank 0 (``requests``: running, queued; ``kv_blocks``: used, total); in
        ``attributes`` the requests in flight, ``engine_attributes``, the counters and whether
        draining, plus the Aborts per request id (up to 4,096) when ``report_aborts``."""
        running, queued = requests
        used, total = kv_blocks
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
        attrs: dict[str, Any] = {
            "in_flight": len(self.requests),
            **engine_attributes,
            **self.counters.attributes(),
            "draining": self.draining,
        }
        if report_aborts:
            attrs["aborts_by_request"] = dict(self.counters.aborts_by_request)
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
                await self.abort_actives(list(self.requests.values()), "drain deadline")
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
            await self.abort_actives(list(self.requests.values()), "shutdown")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)

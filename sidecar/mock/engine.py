"""The simulated engine's state: admission, the request registry, Abort, health and load.

One :class:`MockEngine` per process (asyncio, one event-loop thread). The generation of
an accepted request is driven by :mod:`sidecar.mock.runner`; Drain by
:mod:`sidecar.mock.drain`; the gRPC surface by :mod:`sidecar.mock.services`.

Request lifecycle: ``accept`` (synchronous: validation, rank choice, admission — every
refusal is a :class:`~sidecar.mock.validation.RequestRefused`, i.e. a non-OK status before
acceptance) → queued or running → ended through :meth:`MockEngine.finish` with one
outcome, which frees the running slot, promotes queued requests and releases KV blocks.
A request whose client leaves before its terminal is *leaked* (``--orphans hold``): it
keeps its slot and blocks until an Abort names it or ``--orphan-timeout`` passes.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import betterproto2

from sidecar.mock import flavors, schemas
from sidecar.mock import generator as gen
from sidecar.mock.config import EngineConfig
from sidecar.mock.counters import GroundTruthCounters
from sidecar.mock.hangs import Hangs
from sidecar.mock.kvcache import Allocation, KvCache, KvCacheFull
from sidecar.mock.kvevents_model import KvEventSink, KvGroundTruth
from sidecar.mock.lora import LoraRegistry
from sidecar.mock.scheduler import Overloaded, RankScheduler, pick_rank
from sidecar.mock.transfer import (
    InvalidKvSession,
    KvTransferServer,
    SessionLocator,
    prefill_bootstrap_room,
    resolve_session,
)
from sidecar.mock.validation import EngineView, RequestPlan, RequestRefused, validate
from sidecar.nursery import lone_exception
from sidecar.openengine import pb

log = logging.getLogger(__name__)

FINISHED_MEMORY = 100_000
CANCEL_TIMES_KEPT = 20_000
RECENT_REQUESTS = 64

# Outcomes of a request (exactly one each).
COMPLETED = "completed"
FAILED = "failed"
ABORTED = "aborted"
CANCELLED = "cancelled"
DROPPED = "dropped"
ORPHAN_ABORTED = "orphan_aborted"
ORPHAN_EXPIRED = "orphan_expired"
SHUTDOWN = "shutdown"


@dataclass(eq=False)
class Request:
    """One accepted request."""

    id: str
    plan: RequestPlan
    rank: int
    priority: int
    running: bool
    alloc: Allocation | None = None
    client: bool = True
    leaked: bool = False
    abort_reason: str | None = None
    phase: str = "queued"  # queued | prefill | decode | handoff | done
    completion_tokens: int = 0
    session_id: str = ""
    room: int | None = None
    locator: SessionLocator | None = None
    done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    _woken: asyncio.Future[None] | None = field(default=None, repr=False)

    def wake(self) -> None:
        """Wake the request's task where it waits (:meth:`wait_woken`): an Abort, a running
        slot, shutdown. Nothing happens when it is not waiting (it checks its state first)."""
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    async def wait_woken(self, seconds: float | None = None) -> None:
        """Wait until :meth:`wake` or ``seconds`` passed (``None``: no bound); one waiter at a
        time. This is the per-token pause, so it is built as ``asyncio.sleep`` itself is (a
        future and a timer handle), plus the early wake: ``asyncio.timeout`` (which ends the
        wait by cancelling the task) measured 7-14 % more engine CPU per paced token (32 streams
        x 400 tokens, medians of six rounds)."""
        loop = asyncio.get_running_loop()
        self._woken = woken = loop.create_future()
        timer = None if seconds is None else loop.call_later(seconds, _resolve, woken)
        try:
            await woken
        finally:
            if timer is not None:
                timer.cancel()
            self._woken = None


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _recent_entry(
    request: pb.GenerateRequest, req: Request, kv_session_bytes: bytes | None
) -> dict[str, Any]:
    """What ``GetLoad.attributes.recent_requests`` shows of one accepted request (for tests)."""
    plan = req.plan
    entry: dict[str, Any] = {
        "rank": req.rank,
        "metadata": dict(plan.metadata.forwarded),
        "prompt_tokens": len(plan.prompt_ids),
        "model": request.model,
        "lora_name": request.lora_name,
        # media as received, in order: modality, source kind, uuid (media_options below when set)
        "media": [
            {
                "modality": pb.Modality(m.modality).proto_name,  # validated: a known modality
                "source": betterproto2.which_one_of(m, "source")[0] or "",
                "uuid": m.uuid,
            }
            for m in request.media
        ],
    }
    if request.media_options is not None and request.media_options.fields:
        entry["media_options"] = request.media_options.to_dict()
    if plan.kv_session is not None:
        # the KvSessionRef bytes exactly as they came over the wire (see openengine.server)
        raw = kv_session_bytes if kv_session_bytes is not None else bytes(plan.kv_session)
        entry["kv_session_b64"] = base64.b64encode(raw).decode()
    return entry


class MockEngine:
    """State of one simulated engine. Not thread-safe: call from its event loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        kv_sink: KvEventSink | None = None,
        ground_truth: KvGroundTruth | None = None,
        transfer: KvTransferServer | None = None,
        exit_process: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.flavor = flavors.flavor_spec(config)
        self.model = flavors.model_name(config)
        self.counters = GroundTruthCounters(config.dp_size)
        self.loras = LoraRegistry(
            enabled=config.enable_lora,
            max_loras=config.max_loras,
            check_path=config.check_lora_path,
            lenient=config.faults.has("lora-lenient"),
            idempotent=not config.faults.has("lora-not-idempotent"),
        )
        self.schedulers: list[RankScheduler[Request]] = [
            RankScheduler(r, config.max_running, config.max_queue) for r in range(config.dp_size)
        ]
        self.caches = [
            KvCache(r, config.kv_block_size, config.total_kv_blocks, kv_sink, ground_truth=ground_truth)
            for r in range(config.dp_size)
        ]
        self.kv_events: Any = kv_sink
        self.transfer = transfer
        self.exit_process = exit_process
        self.requests: dict[str, Request] = {}
        self.finished: OrderedDict[str, str] = OrderedDict()  # request id -> KV session id ("" none)
        self.recent: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Benchmark ground truth: request id -> when (µs since the epoch) the engine first saw
        # its client leave or an Abort naming it (GetLoad with REPORT_CANCEL_TIMES metadata).
        self.cancel_seen_us: OrderedDict[str, int] = OrderedDict()
        self.address = config.listen
        self.instance_id = flavors.instance_id(config, config.listen)
        self.started_at: float | None = None
        self.draining = False
        self.closing = False
        self.changed = asyncio.Event()
        self._background: asyncio.TaskGroup | None = None  # see serving()
        self._ids = itertools.count(1)
        self._drops_left = config.faults.drop_aborts
        self._holds_left = config.faults.hold_after_terminal
        self.slow_health_left = 0  # armed by the first accepted request (fault slow-health)
        self.hangs = Hangs()  # runtime hang switches (mock-engine: SIGUSR1 / SIGUSR2)

    # -- lifecycle -------------------------------------------------------------------

    def set_address(self, address: str) -> None:
        self.address = address
        self.instance_id = flavors.instance_id(self.config, address)

    def start(self) -> None:
        """Serving begins (Health leaves STARTING after ``slow-start``)."""
        self.started_at = asyncio.get_running_loop().time()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """The engine's background tasks (the holders of leaked requests) run in one task group
        for the block. Leaving it shuts them down: every request still held is released
        (outcome ``shutdown``) and the group waits for its holders to end, at most 2 s.
        In-flight Generate handlers are the server's (it cancels them when it closes)."""
        try:
            async with asyncio.timeout(None) as bound, asyncio.TaskGroup() as group:
                self._background = group
                try:
                    yield
                finally:
                    self._background = None
                    self._release_held()
                    bound.reschedule(asyncio.get_running_loop().time() + 2.0)
        except TimeoutError:
            log.warning("background tasks still running 2 s after shutdown: cancelled")
        except BaseExceptionGroup as group:  # the block's own exception, not wrapped by the group
            lone = lone_exception(group)
            if lone is group:
                raise
            raise lone from None

    def _release_held(self) -> None:
        self.closing = True
        for req in list(self.requests.values()):
            req.abort_reason = req.abort_reason or "shutdown"
            req.wake()

    def _elapsed(self) -> float:
        if self.started_at is None:
            return 0.0
        return asyncio.get_running_loop().time() - self.started_at

    @property
    def starting(self) -> bool:
        slow = self.config.faults.slow_start
        return self.started_at is None or (slow is not None and self._elapsed() < slow)

    @property
    def unhealthy(self) -> bool:
        after = self.config.faults.unhealthy_after
        return after is not None and self._elapsed() >= after

    # -- discovery ---------------------------------------------------------------------

    def transfer_endpoints(self) -> list[pb.KvEndpoint]:
        return [self.transfer.endpoint] if self.transfer is not None else []

    def server_info(self) -> pb.ServerInfo:
        return flavors.server_info(
            self.config, instance=self.instance_id, endpoints=self.transfer_endpoints()
        )

    def model_info(self, model: str) -> pb.ModelInfo:
        if (
            model
            and model != self.model
            and model not in self.config.aliases
            and not self.config.faults.has("any-model")
        ):
            raise RequestRefused("NOT_FOUND", f"model {model!r} is not served here (serving {self.model!r})")
        return flavors.model_info(self.config)

    def view(self) -> EngineView:
        return EngineView(
            config=self.config,
            flavor=self.flavor,
            model=self.model,
            model_names=frozenset((self.model, *self.config.aliases)),
            loras={a.name: a for a in self.loras.adapters()},
        )

    # -- admission ---------------------------------------------------------------------

    def accept(
        self, request: pb.GenerateRequest, metadata: Any, kv_session_bytes: bytes | None = None
    ) -> Request:
        """Validate and admit ``request``; raises :class:`RequestRefused` (counted) on refusal.
        ``kv_session_bytes``: its ``kv.session`` as received (recorded for tests)."""
        try:
            return self._accept(request, metadata, kv_session_bytes)
        except RequestRefused as rej:
            self.counters.rejected(rej.status)
            raise

    def _accept(self, request: pb.GenerateRequest, metadata: Any, kv_session_bytes: bytes | None) -> Request:
        if self.starting:
            raise RequestRefused("UNAVAILABLE", "engine is starting")
        if self.draining:
            raise RequestRefused("UNAVAILABLE", "engine is draining; not accepting new requests")
        plan = validate(schemas.as_seen(self.config, request), metadata, self.view())
        rid = request.request_id or f"mock-{next(self._ids)}"
        if rid in self.requests:
            raise RequestRefused("ALREADY_EXISTS", f"request {rid!r} is already in flight")
        locator = None
        room = None
        session = plan.kv_session
        try:
            if self.config.role == "decode" and session is not None:
                locator = resolve_session(session, default_profile=self.flavor.handoff_profile)
            elif self.config.role == "prefill" and session is not None and self.transfer is not None:
                room = prefill_bootstrap_room(session, self.transfer.endpoint)
        except InvalidKvSession as err:
            raise RequestRefused("INVALID_ARGUMENT", str(err)) from None
        target = plan.metadata.target_rank
        if target is None and session is not None and session.dp_rank < self.config.dp_size:
            target = session.dp_rank if self.config.role != "decode" else None
        sched = pick_rank(self.schedulers, target)
        priority = plan.metadata.priority if self.flavor.supports_priority else 0
        req = Request(id=rid, plan=plan, rank=sched.rank, priority=priority, running=False)
        req.locator, req.room = locator, room
        try:
            req.running = sched.admit(req, priority)
        except Overloaded as err:
            raise RequestRefused("RESOURCE_EXHAUSTED", f"overloaded: {err}") from None
        if req.running:
            try:
                self.allocate(req)
            except KvCacheFull as err:
                sched.release(req)
                raise RequestRefused("RESOURCE_EXHAUSTED", f"overloaded: {err}") from None
        self.requests[rid] = req
        if self.counters.requests_accepted == 0 and self.config.faults.slow_health:
            self.slow_health_left = self.config.faults.slow_health
        self.counters.requests_accepted += 1
        self.counters.served_by_rank[req.rank] += 1
        self.recent[rid] = _recent_entry(request, req, kv_session_bytes)
        while len(self.recent) > RECENT_REQUESTS:
            self.recent.popitem(last=False)
        self.changed.set()
        return req

    def allocate(self, req: Request) -> None:
        """Take the prompt's KV blocks on the request's rank (raises KvCacheFull)."""
        plan = req.plan
        cache = self.caches[req.rank]
        req.alloc = cache.allocate(
            plan.prompt_ids,
            lora_id=plan.lora.lora_id if plan.lora else None,
            lora_name=plan.lora.name if plan.lora else None,
            media_hashes=plan.media,
            cache_salt=plan.cache_salt or None,
            bypass_prefix_cache=plan.bypass_prefix_cache,
            request_id=req.id,
        )

    def release_blocks(self, req: Request) -> None:
        if req.alloc is not None:
            self.caches[req.rank].release(req.alloc)

    def finish(self, req: Request, outcome: str) -> None:
        """End ``req`` with ``outcome`` (idempotent): free its slot and blocks, count it."""
        if req.done:
            return
        req.done = True
        req.phase = "done"
        self.requests.pop(req.id, None)
        self.finished[req.id] = req.session_id
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
        if req.id in self.recent:
            self.recent[req.id]["outcome"] = outcome
        if not req.extra.get("blocks_handed_off"):
            self.release_blocks(req)
        if req.room is not None and outcome != COMPLETED and self.transfer is not None:
            # an SGLang prefill that ends otherwise (aborted before its handoff, failed): its
            # bootstrap room must not keep a registered decode waiting until the timeout
            self.transfer.abort_room(req.room)
        for promoted in self.schedulers[req.rank].release(req):
            promoted.running = True
            promoted.wake()
        c = self.counters
        if outcome == COMPLETED:
            c.requests_completed += 1
        elif outcome == FAILED:
            c.requests_failed += 1
        elif outcome == ABORTED:
            c.requests_aborted += 1
        elif outcome == DROPPED:
            c.requests_dropped += 1
        elif outcome == ORPHAN_ABORTED:
            c.orphans_aborted += 1
        elif outcome == ORPHAN_EXPIRED:
            c.orphans_expired += 1
        if req.leaked:
            req.leaked = False
            c.requests_leaked -= 1
        self.changed.set()

    def note_cancel(self, request_id: str) -> None:
        """Record when the end of ``request_id`` first reached the engine (client reset or Abort)."""
        seen = self.cancel_seen_us
        if request_id not in seen:
            seen[request_id] = time.time_ns() // 1000
            if len(seen) > CANCEL_TIMES_KEPT:
                seen.popitem(last=False)

    def take_hold(self) -> bool:
        """Whether the Generate call that just sent its terminal event stays open (fault
        ``hold-after-terminal``: the first N calls, or all)."""
        if not self._holds_left:
            return False
        if self._holds_left > 0:
            self._holds_left -= 1
        return True

    def client_gone(self, req: Request) -> None:
        """The client closed the stream before the terminal: count it and leak or release; a
        request whose Abort came first ends aborted."""
        if req.done or not req.client:
            return
        self.note_cancel(req.id)
        req.client = False
        if self.closing:
            self.finish(req, SHUTDOWN)
            return
        if req.abort_reason is not None:
            # the Abort came first and ended the request; the reset only cut its terminal short
            self.finish(req, ABORTED)
            return
        self.counters.requests_cancelled_by_client += 1
        if self.config.orphans == "release":
            self.finish(req, CANCELLED)
            return
        req.leaked = True
        self.counters.requests_leaked += 1
        if self._background is None:  # not serving (shutting down): nothing holds it
            self.finish(req, SHUTDOWN)
            return
        self._background.create_task(self._hold_orphan(req), name=f"hold-{req.id}")

    async def _hold_orphan(self, req: Request) -> None:
        """Hold a leaked request until an Abort names it, shutdown, or ``--orphan-timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.orphan_timeout_s
        try:
            while req.abort_reason is None and not req.done:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    log.info("leaked request %s expired after %.1fs", req.id, self.config.orphan_timeout_s)
                    self.finish(req, ORPHAN_EXPIRED)
                    return
                await req.wait_woken(remaining)
            self.finish(req, ORPHAN_ABORTED if req.abort_reason != "shutdown" else SHUTDOWN)
        finally:
            if not req.done:
                self.finish(req, SHUTDOWN)

    # -- abort -------------------------------------------------------------------------

    def _abort_request(self, req: Request, reason: str) -> None:
        if req.abort_reason is None:
            req.abort_reason = reason
        req.wake()

    def abort_everything(self, reason: str) -> int:
        """Abort every request and drop every held KV session (drain deadline); not an Abort call."""
        for req in list(self.requests.values()):
            self._abort_request(req, reason)
        dropped = 0
        if self.transfer is not None:
            for sid in list(self.transfer._sessions):
                dropped += self.transfer.drop(sid)
        self.changed.set()
        return dropped

    def abort(self, message: pb.AbortRequest) -> pb.AbortResponse:
        """Abort by request id, KV session or all; raises :class:`RequestRefused` for failures."""
        name, value = betterproto2.which_one_of(message, "target")
        self.counters.abort_received(value if name == "request_id" else None)
        outcomes = self.counters.abort_outcomes
        if self._drops_left is not None and self._drops_left != 0:
            self._drops_left -= 1 if self._drops_left > 0 else 0
            outcomes["DROPPED"] += 1
            raise RequestRefused("UNAVAILABLE", "abort dropped (fault drop-aborts)")
        try:
            status, text = self._abort(name or "", value)
        except RequestRefused as rej:
            outcomes["NOT_FOUND" if rej.status == "NOT_FOUND" else "INVALID"] += 1
            raise
        outcomes[pb.AbortStatus(status).name] += 1
        return pb.AbortResponse(status=status, message=text)

    def _abort(self, name: str, value: Any) -> tuple[pb.AbortStatus, str]:
        faults = self.config.faults
        ignore = faults.ignore_abort
        if name == "request_id":
            if not value:
                raise RequestRefused("INVALID_ARGUMENT", "abort: request_id is empty")
            if faults.has("abort-twice-error") and self.counters.aborts_received_by_id[value] > 1:
                raise RequestRefused(
                    "FAILED_PRECONDITION", f"abort: request {value} was already aborted (fault)"
                )
            req = self.requests.get(value)
            if req is not None:
                self.note_cancel(req.id)
                if not ignore:
                    self._abort_request(req, "abort")
                return pb.AbortStatus.ABORTED, f"request {value} aborted"
            if value in self.finished:
                session = self.finished[value]
                if session and self.transfer is not None and not ignore and self.transfer.drop(session):
                    return (
                        pb.AbortStatus.ABORTED,
                        f"request {value} finished; its KV session {session} released",
                    )
                if faults.has("abort-finished-aborted"):
                    return pb.AbortStatus.ABORTED, f"request {value} aborted (fault: it had finished)"
                return pb.AbortStatus.ALREADY_FINISHED, f"request {value} already finished"
            if faults.has("abort-unknown-aborted"):
                return pb.AbortStatus.ABORTED, f"request {value} aborted (fault: it never existed)"
            raise RequestRefused("NOT_FOUND", f"abort: no request {value!r}")
        if name == "kv_session":
            return self._abort_session(schemas.session_as_seen(self.config, value), ignore)
        if name == "all_requests":
            reqs = list(self.requests.values())
            sessions = 0
            if not ignore:
                for req in reqs:
                    self._abort_request(req, "abort")
                if self.transfer is not None:
                    for sid in list(self.transfer._sessions):
                        sessions += self.transfer.drop(sid)
            return pb.AbortStatus.ABORTED, f"aborted {len(reqs)} request(s) and {sessions} KV session(s)"
        if faults.has("abort-no-target-found"):
            raise RequestRefused("NOT_FOUND", "abort: nothing to abort (fault: no target)")
        raise RequestRefused(
            "INVALID_ARGUMENT", "abort: exactly one target (request_id, kv_session, all_requests) is required"
        )

    def _abort_session(self, ref: pb.KvSessionRef, ignore: bool) -> tuple[pb.AbortStatus, str]:
        sid = ref.session_id
        room = (
            ref.bootstrap.room_id
            if ref.bootstrap is not None and ref.bootstrap.endpoint is not None
            else None
        )
        if not sid and room is None:
            raise RequestRefused(
                "INVALID_ARGUMENT", "abort: kv_session needs a session_id or a bootstrap room"
            )
        hits = [
            r
            for r in self.requests.values()
            if (
                sid
                and (
                    r.session_id == sid
                    or (r.plan.kv_session is not None and r.plan.kv_session.session_id == sid)
                )
            )
            or (room is not None and r.room == room)
        ]
        dropped = False
        if not ignore:
            for r in hits:
                self._abort_request(r, "abort")
            if self.transfer is not None:
                if sid:
                    dropped = self.transfer.drop(sid)
                if room is not None:
                    dropped = self.transfer.abort_room(room) or dropped
        if (
            hits
            or dropped
            or (ignore and sid and self.transfer is not None and self.transfer.has_session(sid))
        ):
            return pb.AbortStatus.ABORTED, f"KV session {sid or room} aborted"
        if sid and sid in self.finished.values():
            return pb.AbortStatus.ALREADY_FINISHED, f"KV session {sid} already finished"
        raise RequestRefused("NOT_FOUND", f"abort: no KV session {sid or room!r}")

    # -- health and load ---------------------------------------------------------------

    @property
    def open_sessions(self) -> int:
        return self.transfer.open_sessions if self.transfer is not None else 0

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        if self.starting:
            state = pb.HealthState.STARTING
        elif self.draining:
            state = pb.HealthState.DRAINING
        elif self.unhealthy:
            state = pb.HealthState.NOT_READY
        else:
            state = pb.HealthState.READY
        running = sum(len(s.running) for s in self.schedulers)
        checks = [
            pb.HealthCheck(name="grpc", state=pb.HealthState.READY, message="serving"),
            pb.HealthCheck(
                name="scheduler",
                state=pb.HealthState.DRAINING if self.draining else pb.HealthState.READY,
                message=f"{running} running, {sum(s.queued for s in self.schedulers)} queued",
            ),
            pb.HealthCheck(
                name="model",
                state=pb.HealthState.NOT_READY
                if self.unhealthy
                else pb.HealthState.STARTING
                if self.starting
                else pb.HealthState.READY,
                message="injected fault: unhealthy" if self.unhealthy else self.model,
            ),
        ]
        if self.config.role != "aggregated":
            checks.append(
                pb.HealthCheck(
                    name="kv_connector", state=pb.HealthState.READY, message=self.flavor.transfer_backend
                )
            )
        if message.role != pb.EngineRole.UNSPECIFIED:
            ok = message.role == flavors.role_enum(self.config.role)
            checks.append(
                pb.HealthCheck(
                    name="role",
                    state=pb.HealthState.READY if ok else pb.HealthState.NOT_READY,
                    message=f"engine role is {self.config.role}",
                )
            )
            if not ok and state == pb.HealthState.READY:
                state = pb.HealthState.NOT_READY
        if message.include_inference_probe:
            checks.append(self._probe(message.model))
        return pb.HealthResponse(state=state, checks=checks)

    def _probe(self, model: str) -> pb.HealthCheck:
        if model and model != self.model and model not in self.config.aliases:
            return pb.HealthCheck(
                name="inference_probe", state=pb.HealthState.NOT_READY, message=f"unknown model {model!r}"
            )
        seq = gen.OutputSequence(seed=self.config.seed, rules=gen.StopRules(max_tokens=1))
        step = seq.next_step()
        return pb.HealthCheck(
            name="inference_probe", state=pb.HealthState.READY, message=f"generated token {step.token_id}"
        )

    def load(
        self, include_per_rank: bool, *, report_cancel_times: bool = False, lean: bool = False
    ) -> pb.LoadInfo:
        """``LoadInfo`` with the counters in ``attributes``; ``lean``: scalar counters only (the size
        of a real engine's attributes, for benchmarks); ``report_cancel_times``: plus ``cancel_seen_us``."""
        running = sum(len(s.running) for s in self.schedulers)
        queued = sum(s.queued for s in self.schedulers)
        running_tokens = waiting_tokens = prefill = decode = 0
        for req in self.requests.values():
            n = len(req.plan.prompt_ids) + req.completion_tokens
            if req.running:
                running_tokens += n
                prefill += req.phase == "prefill"
                decode += req.phase == "decode"
            else:
                waiting_tokens += n
        info = pb.LoadInfo(
            instance_id=self.instance_id,
            timestamp_unix_nanos=time.time_ns(),
            running_requests=running,
            queued_requests=queued,
            active_kv_sessions=self.open_sessions,
            used_kv_blocks=sum(c.used_blocks for c in self.caches),
            total_kv_blocks=sum(c.total_blocks for c in self.caches),
            running_tokens=running_tokens,
            waiting_tokens=waiting_tokens,
            prefill_batch_size=prefill,
            decode_batch_size=decode,
        )
        if include_per_rank:
            info.ranks = [
                pb.RankLoadInfo(
                    data_parallel_rank=s.rank,
                    running_requests=len(s.running),
                    queued_requests=s.queued,
                    used_kv_blocks=self.caches[s.rank].used_blocks,
                    total_kv_blocks=self.caches[s.rank].total_blocks,
                    prefill_batch_size=sum(1 for r in s.running if r.phase == "prefill"),
                    decode_batch_size=sum(1 for r in s.running if r.phase == "decode"),
                )
                for s in self.schedulers
            ]
        attrs = self.counters.snapshot(in_flight=self.in_flight, kv_sessions_open=self.open_sessions)
        attrs["draining"] = self.draining
        if lean:
            info.attributes = pb.Struct.from_dict({k: v for k, v in attrs.items() if not isinstance(v, dict)})
            return info
        attrs["recent_requests"] = dict(self.recent)
        if report_cancel_times:
            attrs["cancel_seen_us"] = dict(self.cancel_seen_us)
        info.attributes = pb.Struct.from_dict(attrs)
        return info

"""The sidecar's core state and services: one engine, its worker card, its streams.

:class:`Sidecar` is what the north planes talk to (``admit`` / ``run_stream`` / ``call``)
and what the run command starts: :meth:`Sidecar.startup` (connect with retry until the
startup deadline, negotiate, discover, wait for READY), then the long-lived services
:meth:`watch_engine` (health; on loss: not ready, reconnect with backoff, rediscover, refuse
to serve a changed engine) and :meth:`poll_load` (GetLoad every interval). Draining is
:meth:`drain`. Readiness is :meth:`not_ready_reason` (``None`` = ready).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import betterproto2
import msgspec
import trio

from sidecar.core import metrics, stream_spans
from sidecar.core.admission import admit as admit_request
from sidecar.core.card import WorkerCard, with_loras
from sidecar.core.discovery import compare_cards, discover, fetch_loras
from sidecar.core.engine_lane import EngineCallLane
from sidecar.core.errors import DiscoveryError, Rejection
from sidecar.core.handoff import KvSessionRelease, abort_kv_session_bytes
from sidecar.core.health import SERVING_HEALTH, EngineState, HealthStatus, ask_engine, state_name
from sidecar.core.lifecycle import CANCELLED, LifecycleConfig, Outcome, StreamHandle, StreamSupervisor
from sidecar.core.load import LoadStatus, MalformedLoadInfo, attributes_dict, split_load_info
from sidecar.core.shutdown import stop_budget
from sidecar.json_types import JSONObject
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, Keepalive
from sidecar.openengine.engine_errors import EngineClientError, EngineStatusError
from sidecar.openengine.message_limits import EngineLimits, run_sized
from sidecar.quoting import quote

if TYPE_CHECKING:
    from sidecar.tracing.otel import Tracer

log = logging.getLogger(__name__)

OUTCOME_DRAIN_DEADLINE = Outcome(CANCELLED, pb.ErrorCode.DRAINING, "drain deadline reached", retryable=True)
OUTCOME_SHUTDOWN = Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "the sidecar is shutting down", retryable=True)

#: A ``GetLoad`` answer up to this size is parsed, and attributes up to it converted, on the
#: event loop (a thread hop costs more); larger ones in a worker thread.
_INLINE_LOAD_BYTES = 4096

#: The body of a successful ``call`` (``sidecar.north.schema.CALL_RESULT_TYPES``).
CallResult = (
    WorkerCard
    | LoadStatus
    | HealthStatus
    | pb.ListLorasResponse
    | pb.LoadLoraResponse
    | pb.UnloadLoraResponse
    | pb.AbortResponse
)


@dataclass
class SidecarConfig:
    """Engine-facing settings of ``run`` (see its ``--help``)."""

    model: str | None = None
    expected_engine: str | None = None
    expected_release: str | None = None
    #: ``--handoff-profile``: the profile of a P/D engine that advertises none.
    handoff_profile: str | None = None
    #: ``--require-known-release``: refuse a schema release this build was not tested with.
    require_known_release: bool = False
    startup_deadline: float = 300.0
    health_interval: float = 1.0
    load_interval: float = 1.0
    load_stale_after: float = 5.0
    #: ``GetLoad`` attributes larger than this are not converted (counted, logged; the card
    #: shows none). Conversion costs ~50 µs of CPU per KiB every poll (in a worker thread).
    load_attributes_max_bytes: int = 256 * 1024
    call_timeout: float = 5.0
    #: HTTP/2 PING liveness of the engine connections (``--engine-keepalive-*``; 0: off).
    keepalive_interval: float = 10.0
    keepalive_timeout: float = 10.0
    reconnect_initial: float = 0.1
    reconnect_max: float = 5.0
    drain_timeout: float = 20.0
    drain_engine: bool = False
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    #: ``loadLora`` source paths must lie under this directory (``run --lora-root``); None: anywhere.
    lora_root: str | None = None
    #: Engine calls made for clients (LoRA, releaseKvSession) at once, and per connection
    #: (``sidecar.core.engine_lane``; 0: no limit).
    client_engine_calls: int = 8
    client_engine_calls_per_connection: int = 4
    #: Size bounds on what the engine sends (``--engine-max-event-bytes``,
    #: ``--engine-max-answer-bytes``); the run command opens its engine client with them.
    engine_limits: EngineLimits = field(default_factory=EngineLimits)


def engine_keepalive(config: SidecarConfig) -> Keepalive | None:
    """The engine connections' PING liveness for ``config`` (counted in ``engine_keepalive_timeouts``)."""
    if config.keepalive_interval <= 0:
        return None
    return Keepalive(config.keepalive_interval, config.keepalive_timeout, metrics.KEEPALIVE_TIMEOUTS.inc)


class StartupError(Exception):
    """The sidecar cannot start serving (``str(err)`` is the one-line reason for the operator)."""


class Sidecar:
    """Core state of one sidecar (see module doc). Create, then ``startup()``, then services."""

    def __init__(
        self, engine: EngineClient, config: SidecarConfig | None = None, *, tracer: Tracer | None = None
    ) -> None:
        from sidecar.core.card import LoadTracker

        self.engine = engine
        self.config = config or SidecarConfig()
        #: Spans of every stream (``run --otlp-endpoint``); None: tracing off, nothing done.
        self.tracer = tracer
        self.supervisor = StreamSupervisor(engine, self.config.lifecycle)
        self.lane = EngineCallLane(
            self.config.client_engine_calls, self.config.client_engine_calls_per_connection
        )
        self.supervisor.progress.on_change = self._readiness_changed
        self.load = LoadTracker(stale_after=self.config.load_stale_after)
        self._card: WorkerCard | None = None
        self._changed = trio.Event()
        self.engine_state: EngineState = "unknown"  # sidecar.core.health's vocabulary
        self.problem: str | None = "starting"  # blocks serving when set
        #: Why a serving plane (e.g. Dynamo's) cannot be reached by its clients; shown by
        #: ``/ready`` but never blocking admission (the other planes still serve).
        self.plane_problems: dict[str, str] = {}
        self._engine_lost = trio.Event()
        self._warned: set[str] = set()
        #: Where the KV bridge republishes (:meth:`set_kv_publish_endpoints`), kept in every card.
        self._kv_publish_endpoints: list[str] = []

    # -- readiness -------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self.supervisor.draining

    def not_ready_reason(self) -> str | None:
        """Why ``/ready`` is 503 (``None`` when ready): the engine's state, then a plane's."""
        reason = self.engine_not_ready_reason()
        if reason is None and self.plane_problems:
            return "; ".join(self.plane_problems.values())
        return reason

    def engine_not_ready_reason(self) -> str | None:
        """Why routers should send no new work to the engine (``None`` when it serves): the
        reasons new streams are refused, or its Generate path found stalled."""
        reason = self._admission_problem()
        if reason is None and self.supervisor.progress.stalled is not None:
            return f"engine Generate stalled ({self.supervisor.progress.stalled})"
        return reason

    def _admission_problem(self) -> str | None:
        """Why new streams are refused (``None``: admitted). A stalled Generate path does not
        refuse them: they are the probe that finds it working again (lifecycle.EngineProgress)."""
        if self.draining:
            return "draining"
        if self.problem is not None:
            return self.problem
        if self.card is None:
            return "engine not discovered"
        return None

    def _readiness_changed(self) -> None:
        metrics.READY.set(1 if self.not_ready_reason() is None else 0)

    def set_plane_problem(self, plane: str, problem: str | None) -> None:
        """Record (or clear, with ``None``) why ``plane`` cannot be reached by its clients."""
        if problem is None:
            if self.plane_problems.pop(plane, None) is not None:
                log.info("%s plane serving again", plane)
                self._notify_change()
        elif self.plane_problems.get(plane) != problem:
            self.plane_problems[plane] = problem
            log.warning("not ready: %s", problem)
            self._notify_change()
        metrics.READY.set(1 if self.not_ready_reason() is None else 0)

    def _set_problem(self, problem: str | None, *, announce: bool = True) -> None:
        """Record why the sidecar cannot serve (None: it can). ``announce`` False at startup:
        ``run`` says "ready" itself once every listener is bound."""
        if problem != self.problem:
            if problem is None and announce:
                log.info("ready: serving %s", self._engine_label())
            elif problem is not None:
                log.warning("not ready: %s", problem)
            self._notify_change()
        self.problem = problem
        metrics.READY.set(1 if self.not_ready_reason() is None else 0)

    # -- changes (readiness, card) -----------------------------------------------------------

    @property
    def card(self) -> WorkerCard | None:
        """The worker card (None before discovery); replacing it wakes :meth:`changes` waiters."""
        return self._card

    @card.setter
    def card(self, card: WorkerCard | None) -> None:
        if card is not self._card:
            old, self._card = self._card, card
            if card is not None and (
                old is None or (old.engine.name, old.role) != (card.engine.name, card.role)
            ):
                metrics.ENGINE_INFO.clear()
                metrics.ENGINE_INFO.labels(card.engine.name, card.role).set(1)
            self._notify_change()

    def set_kv_publish_endpoints(self, endpoints: list[str]) -> None:
        """Where the KV bridge republishes the engine's events: in the card from now on, and in
        every card a rediscovery makes."""
        self._kv_publish_endpoints = list(endpoints)
        if self.card is not None:
            self.card = msgspec.structs.replace(self.card, kv_publish_endpoints=list(endpoints))

    def changes(self) -> trio.Event:
        """An event set at the next change of readiness or of the card. Take it *before*
        reading the state it guards, then wait on it (no change can slip in between)."""
        return self._changed

    def _notify_change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _engine_label(self) -> str:
        if self.card is None:
            return str(self.engine.address)
        return f"{self.card.engine.name} {self.card.role} at {self.engine.address}"

    def current_card(self) -> WorkerCard | None:
        """The worker card with the latest load status folded in."""
        if self.card is None:
            return None
        return msgspec.structs.replace(self.card, load=self.load.status(now=trio.current_time()))

    # -- streams (the north planes' interface) ---------------------------------------------

    def admit(
        self, request: pb.GenerateRequest, metadata: dict[str, str], *, kv_session_bytes: bytes | None = None
    ) -> StreamHandle:
        """Admission before the engine; raises :class:`Rejection`. See ``sidecar.core.admission``;
        ``kv_session_bytes``: :meth:`StreamSupervisor.admit`. With :attr:`tracer`, the stream's
        span starts here (``sidecar.core.stream_spans``), a refused request's ends here."""
        tracer = self.tracer
        start_ns = time.time_ns() if tracer is not None else 0
        try:
            self.supervisor.refuse_if_draining()  # first: DRAINING, not "engine not ready: draining"
            reason = self._admission_problem()
            card = self.card
            if reason is not None or card is None:
                raise Rejection(pb.ErrorCode.INTERNAL, f"engine not ready: {reason}", True)
            admitted = admit_request(request, metadata, card)
            handle = self.supervisor.admit(
                admitted.request, admitted.metadata_pairs, kv_session_bytes=kv_session_bytes
            )
        except Rejection as rejection:
            if tracer is not None:
                role = self.card.role if self.card is not None else None
                stream_spans.refused(tracer, request, metadata, rejection, role, start_ns)
            raise
        if tracer is not None:
            stream_spans.admitted(tracer, handle, admitted, card.role, start_ns)
        return handle

    async def run_stream(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        outcome = await self.supervisor.run(handle, emit)
        if outcome.kind != CANCELLED and outcome.retryable and outcome.code == pb.ErrorCode.INTERNAL:
            self._engine_lost.set()  # a transport failure: check the engine now, not at the next tick
        return outcome

    async def call(
        self, method: str, request: betterproto2.Message | KvSessionRelease | None, *, owner: object = None
    ) -> CallResult:
        """A unary ``call`` of the north protocol; raises :class:`Rejection` on failure. Calls
        that reach the engine take a slot of :attr:`lane` (``owner``'s share: its connection).
        ``request`` is of the method's type (``sidecar.north.codec.CALL_REQUEST_TYPES``)."""
        if method == "describe":
            card = self.current_card()
            if card is None:
                raise Rejection(pb.ErrorCode.INTERNAL, "engine not discovered yet", True)
            return card
        if method == "load":
            assert isinstance(request, pb.GetLoadRequest)
            status = self.load.status(now=trio.current_time())
            if not request.include_per_rank and status.snapshot is not None and status.snapshot.ranks:
                # GetLoadRequest semantics: per-rank rows only when asked for
                status.snapshot = msgspec.structs.replace(status.snapshot, ranks=[])
            return status
        if method == "health":
            reason = self.not_ready_reason()
            local = HealthStatus(
                ready=reason is None,
                reason=reason,
                draining=self.draining,
                engine_state=self.engine_state,
                active_streams=len(self.supervisor.streams),
            )
            if request == pb.HealthRequest():  # nothing asked of the engine: the last check's view
                return local
            assert isinstance(request, pb.HealthRequest)
            with self.lane.slot(owner):
                return await ask_engine(self.engine, self.card, request, local, self.config.call_timeout)
        if method in ("listLoras", "loadLora", "unloadLora"):
            assert isinstance(request, pb.ListLorasRequest | pb.LoadLoraRequest | pb.UnloadLoraRequest)
            with self.lane.slot(owner):
                return await self._lora_call(method, request)
        if method == "releaseKvSession":
            assert isinstance(request, KvSessionRelease)
            with self.lane.slot(owner):
                return await self._release_kv_session(request)
        raise Rejection(pb.ErrorCode.UNSUPPORTED_FEATURE, f"unknown call method {quote(method)}")

    async def _release_kv_session(self, request: KvSessionRelease) -> pb.AbortResponse:
        """``releaseKvSession``: ``Abort{kv_session}`` with the client's bytes unchanged, so a
        prefill engine frees a session no decode will pull (a failed or abandoned P/D flow).
        Not counted as a stream Abort. An engine without that session answers ``NOT_FOUND``
        (a typed rejection); ``ALREADY_FINISHED`` is a success."""
        with trio.move_on_after(self.config.call_timeout):
            try:
                return await self.engine.abort(abort_kv_session_bytes(request.raw))
            except EngineStatusError as err:
                if err.status != "NOT_FOUND":
                    raise _call_rejection(err) from None
                raise Rejection(pb.ErrorCode.KV_SESSION_NOT_FOUND, str(err)) from None
            except EngineClientError as err:
                raise _call_rejection(err) from None
        raise Rejection(pb.ErrorCode.INTERNAL, "releaseKvSession: engine did not answer in time", True)

    async def _lora_call(
        self, method: str, request: pb.ListLorasRequest | pb.LoadLoraRequest | pb.UnloadLoraRequest
    ) -> pb.ListLorasResponse | pb.LoadLoraResponse | pb.UnloadLoraResponse:
        """``listLoras`` / ``loadLora`` / ``unloadLora`` (``request`` is of the method's type):
        schema rules first (nothing reaches the engine on a violation), then the engine, then the
        card's adapters are refreshed (so served model names follow). Engine refusals become
        typed rejections (``_call_rejection``)."""
        if isinstance(request, pb.LoadLoraRequest):
            _check_lora_adapter(request.adapter, self.config.lora_root)
        elif isinstance(request, pb.UnloadLoraRequest) and not request.lora_name:
            raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, "loraName must not be empty")
        models = self.card.models if self.card is not None else []
        if models and all(m.supports_lora is False for m in models):
            raise Rejection(pb.ErrorCode.UNSUPPORTED_FEATURE, "this worker's models do not support LoRA")
        with trio.move_on_after(self.config.call_timeout) as scope:
            try:
                if isinstance(request, pb.ListLorasRequest):
                    listed = await self.engine.list_loras()
                    if self.card is not None:
                        self.card = with_loras(self.card, listed.adapters)
                    return listed
                if isinstance(request, pb.LoadLoraRequest):
                    try:
                        reply: pb.LoadLoraResponse | pb.UnloadLoraResponse = await self.engine.load_lora(
                            request
                        )
                    except EngineStatusError as err:
                        # the same (id, name, path) again is a success even from an engine that
                        # answers ALREADY_EXISTS (schema: idempotent); a real conflict stays one
                        if err.status != "ALREADY_EXISTS":
                            raise
                        listed = await self.engine.list_loras()
                        if request.adapter not in listed.adapters:
                            raise
                        reply = pb.LoadLoraResponse(adapter=request.adapter, already_loaded=True)
                else:
                    reply = await self.engine.unload_lora(request)
            except EngineClientError as err:
                raise _call_rejection(err) from None
            await self._refresh_loras()
            return reply
        assert scope.cancelled_caught
        raise Rejection(pb.ErrorCode.INTERNAL, f"{method}: engine did not answer in time", True)

    async def _refresh_loras(self) -> None:
        """Re-list the adapters into the card after a load/unload; on failure the card says
        "unknown" (``None``) rather than keep a list that may be wrong."""
        if self.card is None:
            return
        try:
            adapters = await fetch_loras(self.engine)
        except EngineClientError as err:
            log.warning("ListLoras after a LoRA change failed (%s); loaded adapters unknown", err)
            adapters = None
        self.card = with_loras(self.card, adapters)

    # -- startup and the engine watch ------------------------------------------------------

    async def startup(self) -> WorkerCard:
        """Connect (retrying until ``startup_deadline``), negotiate, discover, wait for READY.

        Raises :class:`StartupError` with a one-line reason (negotiation / discovery failures
        fail closed at once; an unreachable or never-ready engine at the deadline).
        """
        cfg = self.config
        deadline = trio.current_time() + cfg.startup_deadline
        delay = cfg.reconnect_initial
        last = "no attempt yet"
        attempt = 0
        while True:
            attempt += 1
            try:
                with trio.fail_after(max(0.1, min(cfg.call_timeout, deadline - trio.current_time()))):
                    card = await self._discover()
                    health = await self.engine.health()
                self.card = card
                self.engine_state = state_name(health.state)
                if health.state in SERVING_HEALTH:
                    self._set_problem(None, announce=False)
                    return card
                last = f"engine health is {self.engine_state}"
            except DiscoveryError as err:
                raise StartupError(str(err)) from None
            except (EngineClientError, trio.TooSlowError) as err:
                last = str(err) or "engine did not answer in time"
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise StartupError(
                    f"engine at {self.engine.address} not ready after {cfg.startup_deadline:g}s: {last}"
                )
            if attempt == 1 or attempt % 10 == 0:
                log.info(
                    "waiting for engine at %s (%s); retrying for %.0fs more",
                    self.engine.address,
                    last,
                    remaining,
                )
            await trio.sleep(min(delay, remaining))
            delay = min(delay * 2, cfg.reconnect_max)

    async def _discover(self) -> WorkerCard:
        card = await discover(
            self.engine,
            expected_engine=self.config.expected_engine,
            expected_release=self.config.expected_release,
            model=self.config.model,
            handoff_profile=self.config.handoff_profile,
            require_known_release=self.config.require_known_release,
        )
        for warning in card.warnings:  # each once per process, not at every rediscovery
            if warning not in self._warned:
                self._warned.add(warning)
                log.warning("%s", warning)
        return msgspec.structs.replace(card, kv_publish_endpoints=list(self._kv_publish_endpoints))

    async def watch_engine(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Health every ``health_interval`` (or at once when a stream saw the engine fail).

        On loss: not ready; reconnect with backoff; rediscover; serve again only when the
        engine is the same (role, models, ranks, connector) — else stay not ready, with the
        reason in the log and on ``/ready``.

        An engine that refuses the connection or fails the call is lost at once; one that
        does not answer within ``call_timeout`` only on the second such check in a row (an
        overloaded host can delay one control call; turning not ready would then reject every
        new stream for nothing). ``openengine_sidecar_health_checks{result}`` counts both.
        A first slow check also sends one HTTP/2 PING on every engine connection
        (``EngineClient.probe_liveness``): a hung engine or a dead path answers none, and those
        connections — with their streams — are closed after the keepalive timeout.
        """
        task_status.started()
        cfg = self.config
        lost = False
        slow_in_a_row = 0
        delay = cfg.reconnect_initial
        while True:
            with trio.move_on_after(cfg.reconnect_max if lost else cfg.health_interval):
                await self._engine_lost.wait()
            self._engine_lost = trio.Event()
            try:
                with trio.fail_after(cfg.call_timeout):
                    health = await self.engine.health()
                    self.engine_state = state_name(health.state)
                    if lost or self.card is None:
                        new = await self._discover()
                        changes = compare_cards(self.card, new) if self.card is not None else []
                        if changes:
                            self._set_problem("engine changed since discovery: " + "; ".join(changes))
                            continue
                        self.card = msgspec.structs.replace(new, load=None)
                        if lost:
                            metrics.ENGINE_RECONNECTS.inc()
                            log.info("engine at %s is back; rediscovered", self.engine.address)
                        lost = False
                        self.supervisor.engine_reachable.open()
                        delay = cfg.reconnect_initial
                metrics.child(metrics.HEALTH_CHECKS, "ok").inc()
                slow_in_a_row = 0
                if health.state in SERVING_HEALTH:
                    self._set_problem(None)
                else:
                    self._set_problem(f"engine health is {self.engine_state}")
            except DiscoveryError as err:
                self._set_problem(f"rediscovery failed: {err}")
            except (EngineClientError, trio.TooSlowError) as err:
                slow = isinstance(err, trio.TooSlowError)
                metrics.child(metrics.HEALTH_CHECKS, "slow" if slow else "failed").inc()
                slow_in_a_row = slow_in_a_row + 1 if slow else 0
                if slow and slow_in_a_row == 1:
                    # a hung process or a dead path answers no PING either: find out now
                    # rather than at the connections' next keepalive (a slow Control service
                    # answers PINGs; its streams are left alone)
                    self.engine.probe_liveness()
                if slow_in_a_row == 1 and not lost and self.card is not None:
                    log.warning(
                        "engine health check got no answer in %.1fs; checking again", cfg.call_timeout
                    )
                    continue
                self.engine_state = "unreachable"
                if not lost:
                    log.warning("engine at %s lost: %s", self.engine.address, str(err) or "no answer in time")
                lost = True
                self.supervisor.engine_reachable.close()  # background Aborts wait for it
                self._set_problem(f"engine unreachable: {str(err) or 'no answer in time'}")
                await trio.sleep(delay)
                delay = min(delay * 2, cfg.reconnect_max)

    async def poll_load(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """GetLoad (per rank) every ``load_interval``, on a fixed schedule.

        A failed poll is counted (``openengine_sidecar_load_poll_errors``, the card's
        ``errorCount``) and marks the snapshot stale at once; the per-rank gauges are then
        removed rather than left showing old numbers. A snapshot is also stale once older
        than ``load_stale_after`` (at least two intervals).

        The answer is kept off the event loop's critical path: received as bytes (at most
        ``engine_limits.max_answer_bytes``), parsed without its ``attributes``; those are
        converted (and a large answer parsed) in a worker thread when over 4 KiB, and dropped
        (``openengine_sidecar_load_attributes_dropped``) when over ``load_attributes_max_bytes``.
        """
        cfg = self.config
        self.load.stale_after = max(self.load.stale_after, 2 * cfg.load_interval)
        task_status.started()
        next_poll = trio.current_time()
        warned = False
        while True:
            try:
                with trio.fail_after(cfg.call_timeout):
                    data = await self.engine.get_load_bytes(include_per_rank=True)
                info, raw = await run_sized(split_load_info, data, inline_max=_INLINE_LOAD_BYTES)
                attributes: JSONObject | None = None
                if raw is not None and len(raw) > cfg.load_attributes_max_bytes:
                    metrics.LOAD_ATTRIBUTES_DROPPED.inc()
                    if not warned:
                        warned = True
                        log.warning(
                            "GetLoad attributes of %d bytes exceed the limit of %d: not shown"
                            " (counted in openengine_sidecar_load_attributes_dropped; logged once)",
                            len(raw),
                            cfg.load_attributes_max_bytes,
                        )
                elif raw is not None:
                    attributes = await run_sized(attributes_dict, raw, inline_max=_INLINE_LOAD_BYTES)
                self.load.record(info, now=trio.current_time(), attributes=attributes)
                _export_load(info)
            except (EngineClientError, trio.TooSlowError, MalformedLoadInfo) as err:
                metrics.LOAD_POLL_ERRORS.inc()
                self.load.record_error(str(err) or "GetLoad timed out")
                _clear_load_gauges()
            next_poll = max(next_poll + cfg.load_interval, trio.current_time())
            await trio.sleep_until(next_poll)

    # -- drain -----------------------------------------------------------------------------

    async def drain(self) -> None:
        """Refuse new work (DRAINING), let admitted streams finish within ``drain_timeout``,
        then cancel (and abort) the rest. With ``drain_engine``, also ask the engine to drain."""
        cfg = self.config
        self.start_draining()
        active = len(self.supervisor.streams)
        log.info("draining: %d stream(s) in flight, grace %.0fs", active, cfg.drain_timeout)
        async with trio.open_nursery() as nursery:
            if cfg.drain_engine:
                nursery.start_soon(self._drain_engine)
            with trio.move_on_after(cfg.drain_timeout):
                await self.supervisor.wait_idle()
            if self.supervisor.streams:
                log.warning("drain deadline: cancelling %d stream(s)", len(self.supervisor.streams))
                await self.stop_streams(OUTCOME_DRAIN_DEADLINE)
            nursery.cancel_scope.cancel()
        log.info("drained")

    def start_draining(self) -> None:
        """Refuse new work from now on (``DRAINING``); ``/ready`` turns 503."""
        self.supervisor.start_draining()
        metrics.DRAINING.set(1)
        metrics.READY.set(0)
        self._notify_change()

    async def stop_streams(self, reason: Outcome) -> None:
        """Cancel every stream still running and wait for them to end (each sends its Abort):
        at most :func:`~sidecar.core.shutdown.stop_budget` seconds."""
        self.supervisor.cancel_all(reason)
        with trio.move_on_after(stop_budget(self.config.lifecycle.abort_timeout)):
            await self.supervisor.wait_idle()

    async def _drain_engine(self) -> None:
        compat = self.card.compatibility if self.card is not None else None
        if compat is not None and compat.features.get("drain") is False:
            log.info("engine schema %s has no Drain RPC; draining locally only", compat.known_release)
            return
        request = pb.DrainRequest(
            stop_accepting_new_requests=True,
            deadline_ms=int(self.config.drain_timeout * 1000),
            abort_after_deadline=True,
        )
        try:
            async with self.engine.drain(request) as stream:
                async for event in stream:
                    log.info("engine drain: %s", _drain_state_name(event))
        except EngineStatusError as err:
            if err.status == "UNIMPLEMENTED":
                log.info("engine has no Drain RPC; draining locally only")
            else:
                log.warning("engine drain failed: %s", err)
        except EngineClientError as err:
            log.warning("engine drain failed: %s", err)


def _drain_state_name(event: pb.DrainResponse) -> str:
    state = event.state if event.state is not None else pb.DrainState.UNSPECIFIED
    name = (state.proto_name if state.name else None) or "DRAIN_STATE_UNSPECIFIED"
    return f"{name} in_flight={event.in_flight_requests}"


def _check_lora_adapter(adapter: pb.LoraAdapter | None, root: str | None = None) -> None:
    """Schema rules checked before the engine: positive id, non-empty name, absolute normalized
    path; with ``root`` (``--lora-root``), the path must lie strictly under it. The check is
    lexical (the engine, not the sidecar, opens the path, maybe on another filesystem)."""
    if adapter is None:
        raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, "adapter is required")
    if adapter.lora_id <= 0:
        raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, "adapter.loraId must be positive")
    if not adapter.lora_name:
        raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, "adapter.loraName must not be empty")
    path = adapter.source_path
    if not path.startswith("/") or path.startswith("//") or os.path.normpath(path) != path:
        raise Rejection(
            pb.ErrorCode.INVALID_ARGUMENT,
            f"adapter.sourcePath must be an absolute, normalized path, got {quote(path)}",
        )
    if root is not None:
        base = os.path.normpath(root)
        if path == base or os.path.commonpath([base, path]) != base:
            raise Rejection(
                pb.ErrorCode.INVALID_ARGUMENT,
                f"adapter.sourcePath {quote(path)} is not under the LoRA root {quote(base)}",
            )


#: gRPC status of a failed LoRA call -> the code the client sees (the schema's api.md, "LoRA lifecycle").
_LORA_STATUS_CODES = {
    "NOT_FOUND": pb.ErrorCode.MODEL_NOT_FOUND,  # unknown adapter, or a source path the engine cannot see
    "ALREADY_EXISTS": pb.ErrorCode.INVALID_ARGUMENT,  # conflicts with a loaded adapter (id, name or path)
    "FAILED_PRECONDITION": pb.ErrorCode.UNSUPPORTED_FEATURE,  # LoRA disabled on the engine
    "UNIMPLEMENTED": pb.ErrorCode.UNSUPPORTED_FEATURE,
}


def _call_rejection(err: EngineClientError) -> Rejection:
    code = err.code if err.code is not None else pb.ErrorCode.INTERNAL
    if isinstance(err, EngineStatusError):
        code = _LORA_STATUS_CODES.get(err.status, code)
    return Rejection(code, str(err), err.retryable)


def _clear_load_gauges() -> None:
    from sidecar.core import load_metrics

    for gauge in (load_metrics.RUNNING, load_metrics.QUEUED, load_metrics.KV_USED, load_metrics.KV_TOTAL):
        gauge.clear()


def _export_load(info: pb.LoadInfo) -> None:
    from sidecar.core import load_metrics

    load_metrics.export(info)

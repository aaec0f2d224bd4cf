"""The life of one admitted Generate stream, and the supervisor that owns them all.

This module is the sidecar's cancellation contract (docs/LIFECYCLE.md):

- A stream is *admitted* by :meth:`StreamSupervisor.admit` (draining, capacity and
  duplicate ``request_id`` checks) and then *run* by :meth:`StreamSupervisor.run` in a task
  of its connection's nursery. The upstream ``Generate`` call is read by that task itself
  (``EngineClient.generate``: no task of its own), inside the stream's cancel scope.
- Leaving the stream for any reason — client ``cancel``, socket closed, drain deadline,
  inactivity timeout, engine error, shutdown — closes the upstream stream (HTTP/2 reset),
  then, unless a terminal event was seen or the engine refused the request, sends
  ``Abort{request_id}``: shielded, bounded by ``abort_timeout``; when the engine cannot be
  reached the Abort is handed to a background retrier (exponential backoff within
  ``abort_retry_window``) so the client's ``end`` is never held hostage by a dead engine.
  Still undelivered after that window (the engine unreachable: a partition, a hang), it is
  kept — at most ``max_undelivered_aborts``, the oldest dropped and counted — and re-sent
  once the engine answers again. ``ABORTED``, ``ALREADY_FINISHED`` and ``NOT_FOUND`` all count
  as done — but a ``NOT_FOUND`` for a request the engine had sent nothing on may mean the Abort
  (on the control connection) overtook the request (on its Generate connection: a packet
  retransmitted, a partition healing), so it is confirmed: sent again after each of
  ``abort_confirm_after``, the id kept out of admission meanwhile. Where each Abort stands is
  one state per request id (:mod:`sidecar.core.abort_ledger`). A stream that ends after the
  supervisor's service stopped (the stop deadline) still gets a direct, bounded Abort.
- :meth:`run` always returns exactly one :class:`Outcome`; the caller sends it as the
  stream's single ``end``.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from sidecar.core import idle_watch, metrics, stream_spans
from sidecar.core.abort_sender import AbortSender
from sidecar.core.errors import Rejection, error_code_name
from sidecar.core.handoff import splice_kv_session
from sidecar.logs import log_context
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, EngineStream
from sidecar.openengine.engine_errors import (
    EngineProtocolError,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)
from sidecar.openengine.stream_rules import Violation, violation_of
from sidecar.quoting import quote

if TYPE_CHECKING:
    from sidecar.tracing.otel import StreamTrace

log = logging.getLogger(__name__)

COMPLETED, CANCELLED, FAILED, REJECTED = "completed", "cancelled", "failed", "rejected"


@dataclass(frozen=True)
class Outcome:
    """How a stream ended: ``kind`` is the north ``end.outcome``; ``code`` None means no error;
    ``violation``: the engine's stream broke that rule (``Violation.check`` names the
    conformance check covering it)."""

    kind: str
    code: pb.ErrorCode | None = None
    message: str = ""
    retryable: bool = False
    violation: Violation | None = field(default=None, compare=False)

    @classmethod
    def from_rejection(cls, rejection: Rejection) -> Outcome:
        return cls(REJECTED, rejection.code, rejection.message, rejection.retryable)


OUTCOME_COMPLETED = Outcome(COMPLETED)
OUTCOME_CLIENT_CANCELLED = Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "cancelled by the client")
OUTCOME_CLIENT_GONE = Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "client connection closed")


class ClientGone(Exception):
    """Raised by an ``emit`` callback when the client can no longer receive events."""


@dataclass
class StreamHandle:
    """One admitted stream: its request, cancel scope and (once cancelled) why."""

    request: pb.GenerateRequest
    metadata: Sequence[tuple[str, str]] = ()
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cancel_reason: Outcome | None = None
    admitted_at: float = 0.0
    #: The stream's span (``sidecar.core.stream_spans``); None with tracing off.
    trace: StreamTrace | None = field(default=None, repr=False)
    #: Fields the plane adds to the stream's log records (``sidecar.logs.log_context``).
    log_fields: dict[str, object] | None = field(default=None, repr=False)
    #: Output tokens relayed, and the last event's usage (set when the relay ends).
    tokens_out: int = 0
    usage: pb.Usage | None = field(default=None, repr=False)
    #: The engine stream once opened (set by the relay; read through the properties below).
    _upstream: EngineStream[pb.GenerateResponse] | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def kv_session_bytes(self) -> bytes | None:
        """The engine's ``KvSessionRef`` exactly as received, from the moment this stream's
        ``PrefillReady`` is relayed (emitted); None before, or for a stream without one."""
        return self._upstream.kv_session_bytes if self._upstream is not None else None

    @property
    def started(self) -> bool:
        """Whether the engine has sent anything on this stream yet."""
        return self._upstream is not None and self._upstream.messages > 0

    @property
    def more_queued(self) -> bool:
        """Whether engine events have arrived that are not relayed yet (an ``emit`` that sees it
        may hold its write for them: they come at once)."""
        return self._upstream is not None and self._upstream.ready

    def cancel(self, reason: Outcome) -> None:
        """Cancel the stream (idempotent: the first reason wins)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            if self.trace is not None:
                self.trace.event("cancel", {"openengine.message": reason.message})
        self.scope.cancel()


@dataclass
class LifecycleConfig:
    """Bounds of the stream lifecycle (CLI flags of ``run``)."""

    abort_timeout: float = 2.0
    abort_retry_window: float = 30.0
    #: No event for this long after a stream's first event: the stream fails (0 = never).
    inactivity_timeout: float = 0.0
    #: No first event for this long (queueing + prefill): the stream fails (0 = never).
    first_event_timeout: float = 0.0
    max_streams: int = 4096
    error_emit_timeout: float = 1.0
    max_concurrent_aborts: int = 64
    #: Aborts kept for re-delivery after ``abort_retry_window`` (0: given up instead).
    max_undelivered_aborts: int = 4096
    #: Longest ``request_id`` a client may give (it is echoed in every event of the stream).
    max_request_id_length: int = 256
    #: Pauses after which an Abort answered NOT_FOUND is sent again when the engine had sent
    #: nothing on the stream (the request may arrive after its Abort; module doc).
    abort_confirm_after: tuple[float, ...] = (1.0, 10.0)


class EngineProgress:
    """Events received from the engine over all streams, and whether its Generate path is
    found stalled (``stalled``: why, or None).

    Stalled: a stream that had started hit the inactivity timeout while no stream received any
    event meanwhile — the whole Generate path stopped, not one request. Cleared by the next
    event on any stream. While stalled, streams get ``inactivity_timeout`` (not the longer
    first-event bound) for their first event, so requests still admitted meanwhile fail fast
    and retryably instead of waiting out a long prefill bound. ``on_change`` is called at
    each transition (readiness follows it).
    """

    __slots__ = ("events", "on_change", "stalled")

    def __init__(self) -> None:
        self.events = 0
        self.stalled: str | None = None
        self.on_change: Callable[[], None] | None = None

    def stall(self, why: str) -> None:
        if self.stalled is None:
            metrics.GENERATE_STALLS.inc()
            log.warning("engine Generate stalled: %s", why)
        self.stalled = why
        if self.on_change is not None:
            self.on_change()

    def resume(self) -> None:
        if self.stalled is not None:
            self.stalled = None
            log.info("engine Generate making progress again")
            if self.on_change is not None:
                self.on_change()


class StreamSupervisor:
    """Owns every admitted stream of the sidecar (all connections, all planes).

    Resources: a registry of in-flight request ids and the streams' Abort sender
    (:class:`~sidecar.core.abort_sender.AbortSender`, whose background service is
    :meth:`run_service`; :attr:`aborts` its ledger). After
    :meth:`start_draining` new work is refused with a typed ``DRAINING`` rejection;
    :meth:`wait_idle` returns once no stream is in flight.
    """

    def __init__(self, engine: EngineClient, config: LifecycleConfig | None = None) -> None:
        self.engine = engine
        self.config = config or LifecycleConfig()
        self.streams: dict[str, StreamHandle] = {}
        self._draining = False
        self._idle = trio.Event()
        self._idle.set()
        self.progress = EngineProgress()
        self.sender = AbortSender(engine, self.config)
        #: Every Abort still under way, by request id (not admitted again meanwhile).
        self.aborts = self.sender.aborts
        #: Closed by the engine watch while the engine is lost (background Aborts wait).
        self.engine_reachable = self.sender.engine_reachable
        # read when scraped, not set per stream (the process's supervisor is the last made)
        this = weakref.ref(self)
        metrics.ACTIVE_STREAMS.set_function(lambda: len(s.streams) if (s := this()) is not None else 0)

    async def run_service(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the streams' background Aborts until cancelled (start in the root nursery):
        :meth:`AbortSender.run_service <sidecar.core.abort_sender.AbortSender.run_service>`."""
        await self.sender.run_service(task_status=task_status)

    async def abort(
        self, request_id: str, *, unanswered: bool = False, trace: StreamTrace | None = None
    ) -> None:
        """Abort ``request_id``: :meth:`AbortSender.abort <sidecar.core.abort_sender.AbortSender.abort>`
        (returns within ``abort_timeout``)."""
        await self.sender.abort(request_id, unanswered=unanswered, trace=trace)

    # -- admission -------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """True once :meth:`start_draining` was called (never reset: a drain ends the process)."""
        return self._draining

    def start_draining(self) -> None:
        """Refuse new work from now on (:meth:`refuse_if_draining`); admitted streams go on."""
        self._draining = True

    def refuse_if_draining(self) -> None:
        """Raise the ``DRAINING`` :class:`Rejection` (retryable: send it elsewhere) once draining."""
        if self._draining:
            raise Rejection(pb.ErrorCode.DRAINING, "the sidecar is draining; send new work elsewhere", True)

    def new_request_id(self) -> str:
        """A sidecar-made request id: 128 random bits (unguessable: a client cannot claim the
        id another client's request will get), never one in flight here."""
        while True:
            request_id = "sc-" + secrets.token_hex(16)
            if not self._in_use(request_id):
                return request_id

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.streams or request_id in self.aborts

    def admit(
        self,
        request: pb.GenerateRequest,
        metadata: Sequence[tuple[str, str]] = (),
        *,
        kv_session_bytes: bytes | None = None,
    ) -> StreamHandle:
        """Register a stream or raise :class:`Rejection` (DRAINING, OVERLOADED, DUPLICATE_REQUEST,
        INVALID_ARGUMENT for a ``request_id`` over ``max_request_id_length``).

        An empty ``request_id`` is replaced by a sidecar-unique, random one. Every admitted
        stream has its own entry in :attr:`streams` until it ends: two streams never share an id.
        ``kv_session_bytes`` (a client's ``KvSessionRef`` bytes, already parsed into
        ``request.kv.session`` for the checks): the engine gets them byte for byte instead of a
        re-serialization (:func:`~sidecar.core.handoff.splice_kv_session`); the handle's
        ``request`` is what is sent.
        """
        self.refuse_if_draining()
        if len(self.streams) >= self.config.max_streams:
            raise Rejection(
                pb.ErrorCode.OVERLOADED,
                f"the sidecar is at its limit of {self.config.max_streams} streams",
                True,
            )
        limit = self.config.max_request_id_length
        if len(request.request_id) > limit:
            raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, f"request_id is longer than {limit} characters")
        if not request.request_id:
            request.request_id = self.new_request_id()
        elif request.request_id in self.streams:
            raise Rejection(
                pb.ErrorCode.DUPLICATE_REQUEST,
                f"request_id {quote(request.request_id)} is already in flight here",
            )
        elif request.request_id in self.aborts:
            raise Rejection(
                pb.ErrorCode.DUPLICATE_REQUEST,
                f"request_id {quote(request.request_id)} is still being aborted here; retry later",
                True,
            )
        request = splice_kv_session(request, kv_session_bytes)
        handle = StreamHandle(request, metadata, admitted_at=trio.current_time())
        self.streams[request.request_id] = handle
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        return handle

    def _release(self, handle: StreamHandle) -> None:
        if self.streams.get(handle.request_id) is handle:
            del self.streams[handle.request_id]
        if not self.streams:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no admitted stream is in flight."""
        while self.streams:
            await self._idle.wait()

    def cancel_all(self, reason: Outcome) -> None:
        for handle in list(self.streams.values()):
            handle.cancel(reason)

    # -- running ---------------------------------------------------------------------------

    async def run(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        """Relay the engine's events to ``emit`` in order; return the stream's one outcome.

        ``emit`` may block (back-pressure reaches the engine through HTTP/2 flow control) and
        raises :class:`ClientGone` when the client left (the outcome says so). Raises nothing but
        the ``Cancelled`` of an enclosing scope — and even then the upstream is closed and aborted
        first; a cancellation that arrives while the stream is already ending is left to the
        caller's next checkpoint.
        """
        with log_context(request_id=handle.request_id, **(handle.log_fields or {})):
            if handle.trace is None:
                return await self._run(handle, emit)
            outcome: Outcome | None = None
            try:
                outcome = await self._run(handle, emit)
                return outcome
            finally:
                stream_spans.ended(handle, outcome)

    async def _run(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        relay = _Relay(handle, emit, self.config, self.progress)
        try:
            with handle.scope:
                await relay.run(self.engine)
        except ClientGone:
            if handle.cancel_reason is None:
                handle.cancel(OUTCOME_CLIENT_GONE)
        finally:
            try:
                if relay.needs_abort():
                    assert relay.stream is not None
                    await self.abort(
                        handle.request_id, unanswered=relay.stream.messages == 0, trace=handle.trace
                    )
            finally:
                self._release(handle)
        if relay.outcome is not None:
            outcome = relay.outcome
        elif relay.saw_terminal():
            outcome = OUTCOME_COMPLETED
        else:
            outcome = handle.cancel_reason or Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "cancelled")
        metrics.child(
            metrics.STREAMS, outcome.kind, error_code_name(outcome.code) if outcome.code else ""
        ).inc()
        return outcome


class _Relay:
    """The upstream half of one stream (state for :meth:`StreamSupervisor.run`)."""

    def __init__(
        self,
        handle: StreamHandle,
        emit: Callable[[pb.GenerateResponse], Awaitable[None]],
        config: LifecycleConfig,
        progress: EngineProgress,
    ) -> None:
        self.handle = handle
        self.emit = emit
        self.config = config
        self.progress = progress
        self.stream: EngineStream[pb.GenerateResponse] | None = None
        self.outcome: Outcome | None = None
        self.refused = False
        self._events_seen = -1  # the engine-wide event count at this stream's last event

    def saw_terminal(self) -> bool:
        return self.stream is not None and self.stream.terminal_seen

    def needs_abort(self) -> bool:
        """Abort unless nothing was opened, a terminal was seen, or the engine refused the request."""
        return self.stream is not None and not self.stream.terminal_seen and not self.refused

    async def run(self, engine: EngineClient) -> None:
        h, cfg, progress = self.handle, self.config, self.progress
        first = cfg.first_event_timeout
        if progress.stalled is not None and cfg.inactivity_timeout:
            first = min(first, cfg.inactivity_timeout) if first else cfg.inactivity_timeout
        idle = trio.CancelScope()
        with idle:
            async with engine.generate(h.request, metadata=h.metadata) as stream:
                self.stream = h._upstream = stream
                try:
                    with idle_watch.waiter(idle) as waiter:
                        if first:
                            waiter.arm(first)
                        await self._pump(stream, waiter, cfg.inactivity_timeout)
                except EngineTerminalError as err:
                    self.outcome = Outcome(FAILED, err.code, err.message, err.retryable)
                    if isinstance(err.event, pb.GenerateResponse):
                        with trio.move_on_after(self.config.error_emit_timeout):
                            await self.emit(err.event)
                    return
                except (EngineStatusError, EngineUnavailable) as err:
                    before = stream.messages == 0
                    self.refused = before and isinstance(err, EngineStatusError)
                    self.outcome = Outcome(
                        REJECTED if before else FAILED,
                        err.code,
                        str(err),
                        err.retryable,
                        None if before else violation_of(err),
                    )
                    return
                except EngineProtocolError as err:
                    log.warning("stream %s: %s", quote(h.request_id), err)
                    self.outcome = Outcome(FAILED, err.code, str(err), err.retryable, violation_of(err))
                    return
        if idle.cancelled_caught:
            if self.stream is not None and self.stream.messages:
                timeout = cfg.inactivity_timeout
                message = f"no event from the engine for {timeout:g}s"
                if progress.events == self._events_seen:  # nothing on any stream meanwhile
                    progress.stall(f"no event on any stream for {timeout:g}s")
            else:
                message = f"no first event from the engine for {first:g}s"
            self.outcome = Outcome(
                FAILED, pb.ErrorCode.INTERNAL, message, retryable=True, violation=Violation.SILENT
            )
        elif not h.scope.cancel_called:
            self.outcome = OUTCOME_COMPLETED

    async def _pump(
        self, stream: EngineStream[pb.GenerateResponse], waiter: idle_watch.Waiter, timeout: float
    ) -> None:
        """Relay every event to ``emit``. Per token only a few integer operations: tokens are
        added to ``TOKENS`` in bulk (every ``TOKENS_FLUSH`` and at the end), ``TTFT`` once,
        ``ITL`` on a sample (the first gap, then one in ``ITL_SAMPLE``).

        ``waiter`` bounds only the waits for the engine: disarmed while events are relayed
        (``emit`` may wait for a slow client) and armed again (``timeout`` from now) only when
        the next event has not arrived yet (``stream.ready``)."""
        emit, started, now = self.emit, self.handle.admitted_at, trio.current_time
        flush, sample = metrics.TOKENS_FLUSH, metrics.ITL_SAMPLE
        progress = self.progress
        trace = self.handle.trace
        tokens = events = flushed = 0
        gap_start: float | None = None  # set at the token event that opens a sampled gap
        ev: pb.GenerateResponse | None = None
        try:
            async for ev in stream:
                if progress.stalled is not None:
                    progress.resume()
                progress.events += 1
                self._events_seen = progress.events
                token = ev.token
                if token is not None:
                    tokens += len(token.tokens) or 1
                    events += 1
                    if gap_start is not None:
                        metrics.ITL.observe(now() - gap_start)
                        gap_start = None
                    if events == 1:
                        gap_start = now()
                        metrics.TTFT.observe(gap_start - started)
                        if trace is not None:
                            trace.event("first_token")
                    elif events % sample == 0:
                        gap_start = now()
                    if tokens >= flush:
                        metrics.TOKENS.inc(tokens)
                        flushed += tokens
                        tokens = 0
                waiter.disarm()
                await emit(ev)
                if timeout and not stream.ready:
                    waiter.arm(timeout)
        finally:
            if tokens:
                metrics.TOKENS.inc(tokens)
            self.handle.tokens_out = flushed + tokens
            if ev is not None:
                self.handle.usage = ev.usage

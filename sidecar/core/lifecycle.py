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

import enum
import logging
import math
import random
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from sidecar.core import metrics
from sidecar.core.abort_ledger import REDELIVER_FIRST_PAUSE, REDELIVER_MAX_PAUSE, AbortLedger
from sidecar.core.errors import Rejection, error_code_name
from sidecar.core.handoff import splice_kv_session
from sidecar.logs import log_context
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, EngineStream
from sidecar.openengine.engine_errors import (
    EngineClientError,
    EngineProtocolError,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)
from sidecar.openengine.stream_rules import Violation, violation_of
from sidecar.quoting import quote

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


class Gate:
    """Open or closed; :meth:`wait_open` returns once open."""

    def __init__(self) -> None:
        self.is_open = True
        self._opened = trio.Event()
        self._opened.set()
        #: Called when a closed gate opens.
        self.on_open: Callable[[], None] | None = None

    def close(self) -> None:
        if self.is_open:
            self.is_open = False
            self._opened = trio.Event()

    def open(self) -> None:
        was_closed = not self.is_open
        self.is_open = True
        self._opened.set()
        if was_closed and self.on_open is not None:
            self.on_open()

    async def wait_open(self) -> None:
        while not self.is_open:
            await self._opened.wait()


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

    Resources: a registry of in-flight request ids, the ledger of Aborts still owed
    (:attr:`aborts`), a background nursery for Abort retries, confirmations and the re-delivery
    of undelivered Aborts (started with :meth:`run_service`). After
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
        self._retry_nursery: trio.Nursery | None = None
        #: Abort calls in flight at once (a mass disconnect queues here instead of timing out
        #: thousands of concurrent calls on the control channel).
        self._abort_slots = trio.CapacityLimiter(self.config.max_concurrent_aborts)
        #: Every Abort still under way, by request id: not admitted again until it is done (a
        #: late Abort would end the new stream).
        self.aborts = AbortLedger(self.config.max_undelivered_aborts)
        self.progress = EngineProgress()
        #: Closed by the engine watch while the engine is lost (background Aborts wait).
        self.engine_reachable = Gate()
        self.engine_reachable.on_open = self.aborts.answered

    # -- service ---------------------------------------------------------------------------

    async def run_service(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host background Abort retries, confirmations and the re-delivery of undelivered Aborts
        until cancelled (start in the root nursery). From the moment it stops, a stream that ends
        sends its Abort directly (bounded by ``abort_timeout``); first attempts under way finish
        (shielded, bounded); Aborts still undelivered then are logged."""
        try:
            async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
                if self.aborts.cap:
                    outer.start_soon(self._redeliver)
                self._retry_nursery = nursery
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    self._retry_nursery = None  # closing: no new background attempt from here
        finally:
            if undelivered := len(self.aborts.backlog()):
                log.warning("%d Aborts never reached the engine (unreachable until the end)", undelivered)

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
        metrics.ACTIVE_STREAMS.set(len(self.streams))
        return handle

    def _release(self, handle: StreamHandle) -> None:
        if self.streams.get(handle.request_id) is handle:
            del self.streams[handle.request_id]
        metrics.ACTIVE_STREAMS.set(len(self.streams))
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
        raises :class:`ClientGone` when the client left. Raises nothing but the ``Cancelled``
        of an enclosing scope — and even then the upstream is closed and aborted first.
        """
        with log_context(request_id=handle.request_id):
            return await self._run(handle, emit)

    async def _run(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        relay = _Relay(handle, emit, self.config, self.progress)
        try:
            with handle.scope:
                await relay.run(self.engine)
        except ClientGone:
            handle.cancel_reason = handle.cancel_reason or OUTCOME_CLIENT_GONE
        finally:
            try:
                if relay.needs_abort():
                    assert relay.stream is not None
                    await self.abort(handle.request_id, unanswered=relay.stream.messages == 0)
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

    # -- abort -----------------------------------------------------------------------------

    async def abort(self, request_id: str, *, unanswered: bool = False) -> None:
        """Abort ``request_id`` on the engine: shielded, bounded, retried in the background.

        Returns once the first attempt is answered, or after ``abort_timeout``, whichever comes
        first (``stop_budget`` relies on that bound). The attempt itself runs in the background
        (the retry nursery of :meth:`run_service`) exactly as it always did: it waits for one of
        ``max_concurrent_aborts`` slots (a mass disconnect queues there instead of timing out
        thousands of concurrent calls), then calls, each bounded by ``abort_timeout``; no slot,
        no answer or a retryable failure: it is retried there within ``abort_retry_window``.
        ``unanswered``: the engine sent nothing on the stream, so a NOT_FOUND is confirmed
        (:meth:`_confirm`). Without the background (no :meth:`run_service`, or it stopped: the
        stop deadline), or for an id whose Abort is under way already, one direct attempt.
        """
        with trio.CancelScope(shield=True):
            answered = trio.Event()
            nursery = self._retry_nursery
            if nursery is None or request_id in self.aborts:
                with trio.move_on_after(self.config.abort_timeout):
                    await self._first_attempt(request_id, answered)
                return
            self.aborts.begin(request_id, confirm=unanswered and bool(self.config.abort_confirm_after))
            nursery.start_soon(self._abort_in_background, request_id, answered)
            with trio.move_on_after(self.config.abort_timeout):
                await answered.wait()

    async def _abort_in_background(self, request_id: str, answered: trio.Event) -> None:
        parked = False
        try:
            # shielded: a service stopping meanwhile does not cut the first attempt short (it is
            # bounded: a slot, then the call, each within abort_timeout)
            with trio.CancelScope(shield=True):
                retry, attempted, unreachable = await self._first_attempt(request_id, answered)
            if retry:
                parked = await self._retry_abort_until_done(request_id, attempted, unreachable)
        finally:
            answered.set()
            if not parked and self.aborts.finish(request_id, can_confirm=self._retry_nursery is not None):
                self._start_confirm(request_id)

    def _start_confirm(self, request_id: str) -> None:
        """Confirm a NOT_FOUND in the background (:meth:`_confirm`); at once done with when the
        service stopped."""
        if self._retry_nursery is None:
            self.aborts.confirmed(request_id)
        else:
            self._retry_nursery.start_soon(self._confirm, request_id)

    async def _confirm(self, request_id: str) -> None:
        """Send a NOT_FOUND Abort again after each pause of ``abort_confirm_after`` until one
        finds the request (it arrived after its first Abort) or they are used up; its id stays
        out of admission until then (a confirmation must not end a new stream of that id)."""
        try:
            waited = 0.0
            for pause in self.config.abort_confirm_after:
                await trio.sleep(pause)
                waited += pause
                result = "no_answer"
                async with self._abort_slots:
                    with trio.move_on_after(self.config.abort_timeout):
                        try:
                            result = await self._abort_once(request_id)
                        except _RetryableAbort:
                            result = "no_answer"
                        except EngineClientError:
                            result = "failed"
                metrics.child(metrics.ABORT_CONFIRMATIONS, result).inc()
                if result in ("aborted", "already_finished"):
                    if result == "aborted":
                        log.warning(
                            "abort of %s: the request reached the engine after its Abort (answered "
                            "NOT_FOUND); aborted when confirmed %gs later",
                            quote(request_id),
                            waited,
                        )
                    return
        finally:
            self.aborts.confirmed(request_id)

    async def _redeliver(self) -> None:
        """Re-send the backlog's Aborts: the oldest first, as a probe; once it got an answer,
        all the others (within the Abort slots). No answer: pause (doubling up to
        ``REDELIVER_MAX_PAUSE``, cut short when the engine answers anything or the engine watch
        finds it back) and probe again."""
        pause = REDELIVER_FIRST_PAUSE
        while True:
            await self.aborts.wait_parked()
            await self.engine_reachable.wait_open()
            oldest = self.aborts.oldest_parked()
            if oldest is not None and not await self._deliver_kept(oldest):
                await self.aborts.pause(min(pause * random.uniform(0.5, 1.5), REDELIVER_MAX_PAUSE))
                pause = min(pause * 2, REDELIVER_MAX_PAUSE)
                continue
            pause = REDELIVER_FIRST_PAUSE
            async with trio.open_nursery() as nursery:
                for request_id in self.aborts.backlog():
                    nursery.start_soon(self._deliver_kept, request_id)

    async def _deliver_kept(self, request_id: str) -> bool:
        """One attempt for a kept Abort; True when it is done with (answered, or failed for
        good), False when the engine is still out of reach."""
        async with self._abort_slots:
            if not self.aborts.take(request_id):
                return True  # dropped, delivered by another round, or being sent now
            done = False
            try:
                done = await self._attempt(request_id) is _Try.DONE
                return done
            finally:
                if self.aborts.redelivered(request_id, done=done):
                    self._start_confirm(request_id)

    async def _first_attempt(self, request_id: str, answered: trio.Event) -> tuple[bool, bool, bool]:
        """One Abort attempt (a slot, then the call, each within ``abort_timeout``); sets
        ``answered`` when it is over. Returns (to be retried, a call was made, the engine gave
        no answer)."""
        try:
            slot = False
            with trio.move_on_after(self.config.abort_timeout):
                await self._abort_slots.acquire()
                slot = True
            if not slot:
                return True, False, True
            try:
                result = await self._attempt(request_id)
            finally:
                self._abort_slots.release()
            return result is not _Try.DONE, True, result is _Try.NO_ANSWER
        finally:
            answered.set()

    async def _attempt(self, request_id: str) -> _Try:
        """One Abort call within ``abort_timeout`` (the caller holds a slot); once it is over,
        counted in ``aborts_total`` by its result. :class:`_Try` says what came of it."""
        with trio.move_on_after(self.config.abort_timeout):
            try:
                metrics.child(metrics.ABORTS, await self._abort_once(request_id)).inc()
                return _Try.DONE
            except _RetryableAbort as err:
                return _Try.REFUSED if err.answered else _Try.NO_ANSWER
            except EngineClientError as err:
                metrics.child(metrics.ABORTS, "failed").inc()
                log.warning("abort of %s failed: %s", quote(request_id), err)
                return _Try.DONE
        return _Try.NO_ANSWER

    async def _abort_once(self, request_id: str) -> str:
        try:
            resp = await self.engine.abort(pb.AbortRequest(request_id=request_id))
        except EngineStatusError as err:
            if err.status == "NOT_FOUND":
                self.aborts.answered_not_found(request_id)
                return "not_found"
            if err.retryable:
                raise _RetryableAbort(answered=True) from err
            raise
        except EngineUnavailable as err:
            raise _RetryableAbort(answered=False) from err
        self.aborts.answered()
        if resp.status == pb.AbortStatus.ALREADY_FINISHED:
            return "already_finished"
        return "aborted"

    async def _retry_abort_until_done(self, request_id: str, attempted: bool, unreachable: bool) -> bool:
        """Retry an Abort in the background within ``abort_retry_window``. ``attempted`` False:
        it never got a slot (a mass disconnect's queue), so its first attempt is no retry: it
        waits for a slot without a backoff pause and is not counted in ``abort_retries``. While
        the engine is known to be lost
        (``engine_reachable`` closed by the engine watch), they wait and the window does not
        run: a frozen engine gets its Aborts when it runs again, however long it was gone.
        (Their number is bounded: a lost engine admits no new stream.) When the window is over
        and the last attempt got no answer at all (``unreachable``: no connection, or nothing
        back within ``abort_timeout``), the Abort is kept in the backlog for
        :meth:`_redeliver` (returns True), unless ``max_undelivered_aborts`` is 0. An engine
        that answers but keeps refusing (a retryable status) is given up on: it is there,
        and the request is its to time out."""
        deadline = trio.current_time() + self.config.abort_retry_window
        delay = 0.05
        while trio.current_time() < deadline:
            if not self.engine_reachable.is_open:
                paused = trio.current_time()
                await self.engine_reachable.wait_open()
                deadline += trio.current_time() - paused
            if attempted:
                # jittered exponential backoff: a mass disconnect must not retry in lockstep
                pause = delay * random.uniform(0.5, 1.5)
                await trio.sleep(min(pause, max(0.0, deadline - trio.current_time())))
                delay = min(delay * 2, 2.0)
                metrics.ABORT_RETRIES.inc()
            attempted = True
            async with self._abort_slots:
                result = await self._attempt(request_id)
            if result is _Try.DONE:
                return False
            unreachable = result is _Try.NO_ANSWER
        if self.aborts.cap and unreachable:
            log.info(
                "abort of %s undelivered after %.0fs; kept to be re-sent when the engine answers",
                quote(request_id),
                self.config.abort_retry_window,
            )
            self.aborts.park(request_id)
            return True
        metrics.child(metrics.ABORTS, "failed").inc()
        log.warning("abort of %s gave up after %.0fs", quote(request_id), self.config.abort_retry_window)
        return False


class _Try(enum.Enum):
    """What came of one Abort call (:meth:`StreamSupervisor._attempt`)."""

    #: Answered (aborted, not found, already finished), or failed for good (logged).
    DONE = "done"
    #: The engine answered with a retryable refusal: it is there.
    REFUSED = "refused"
    #: No connection, or nothing back within ``abort_timeout``.
    NO_ANSWER = "no_answer"


class _RetryableAbort(Exception):
    """An Abort to try again; ``answered``: the engine answered (a retryable status) rather
    than being out of reach."""

    def __init__(self, *, answered: bool) -> None:
        super().__init__()
        self.answered = answered


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
                if first:
                    idle.deadline = trio.current_time() + first
                try:
                    await self._pump(stream, idle, cfg.inactivity_timeout)
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
        self, stream: EngineStream[pb.GenerateResponse], idle: trio.CancelScope, timeout: float
    ) -> None:
        """Relay every event to ``emit``. Per token only a few integer operations: tokens are
        added to ``TOKENS`` in bulk (every ``TOKENS_FLUSH`` and at the end), ``TTFT`` once,
        ``ITL`` on a sample (the first gap, then one in ``ITL_SAMPLE``).

        ``idle``'s deadline bounds only the waits for the engine: it is lifted while events
        are relayed (``emit`` may wait for a slow client) and set again (``timeout`` from
        now) only when the next event has not arrived yet (``stream.ready``) — events that
        arrived together cost no deadline change between them."""
        emit, started, now = self.emit, self.handle.admitted_at, trio.current_time
        flush, sample = metrics.TOKENS_FLUSH, metrics.ITL_SAMPLE
        progress = self.progress
        armed = idle.deadline != math.inf  # the first-event bound
        tokens = events = 0
        gap_start: float | None = None  # set at the token event that opens a sampled gap
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
                    elif events % sample == 0:
                        gap_start = now()
                    if tokens >= flush:
                        metrics.TOKENS.inc(tokens)
                        tokens = 0
                if armed:
                    idle.deadline = math.inf
                    armed = False
                await emit(ev)
                if timeout and not stream.ready:
                    idle.deadline = now() + timeout
                    armed = True
        finally:
            if tokens:
                metrics.TOKENS.inc(tokens)

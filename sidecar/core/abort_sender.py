"""Sending Aborts: shielded, bounded, retried, kept, confirmed — never forgotten while the engine
may still hold the request (docs/LIFECYCLE.md, rule 3).

:class:`AbortSender` makes every Abort call of the sidecar's streams. The first attempt runs in
the background nursery of :meth:`AbortSender.run_service` (so a stream's ``end`` never waits for
a dead engine longer than ``abort_timeout``), shielded and bounded; a retryable failure is
retried there with jittered exponential backoff within ``abort_retry_window``; an Abort the
engine could not be reached for past that window is kept (bounded) and re-sent once it answers;
a NOT_FOUND for a stream the engine sent nothing on is confirmed after pauses. Where each Abort
stands is one state per request id, in :class:`~sidecar.core.abort_ledger.AbortLedger`
(:attr:`AbortSender.aborts`). Once the service stops (the stop deadline), an Abort is sent
directly, bounded by ``abort_timeout``.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from sidecar.core import metrics
from sidecar.core.abort_ledger import REDELIVER_FIRST_PAUSE, REDELIVER_MAX_PAUSE, AbortLedger
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient
from sidecar.openengine.engine_errors import EngineClientError, EngineStatusError, EngineUnavailable
from sidecar.quoting import quote

if TYPE_CHECKING:
    from sidecar.core.lifecycle import LifecycleConfig
    from sidecar.tracing.otel import StreamTrace

log = logging.getLogger(__name__)


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


class AbortSender:
    """Every Abort of the sidecar's streams (module doc).

    Resources: the ledger of Aborts still owed (:attr:`aborts`), at most
    ``max_concurrent_aborts`` Abort calls at once, and — while :meth:`run_service` runs — a
    background nursery for first attempts, retries, confirmations and re-delivery.
    :attr:`engine_reachable` is closed by the engine watch while the engine is lost (background
    Aborts wait for it, their retry window paused).
    """

    def __init__(self, engine: EngineClient, config: LifecycleConfig) -> None:
        self.engine = engine
        self.config = config
        self._retry_nursery: trio.Nursery | None = None
        #: Abort calls in flight at once (a mass disconnect queues here instead of timing out
        #: thousands of concurrent calls on the control connection).
        self._abort_slots = trio.CapacityLimiter(config.max_concurrent_aborts)
        #: Every Abort still under way, by request id: not admitted again until it is done (a
        #: late Abort would end the new stream).
        self.aborts = AbortLedger(config.max_undelivered_aborts)
        self.engine_reachable = Gate()
        self.engine_reachable.on_open = self.aborts.answered

    @property
    def serving(self) -> bool:
        """:meth:`run_service` runs (Aborts go to its background nursery)."""
        return self._retry_nursery is not None

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

    async def abort(
        self, request_id: str, *, unanswered: bool = False, trace: StreamTrace | None = None
    ) -> None:
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
        ``trace``: the stream's span; every call of this Abort gets a span under it.
        """
        with trio.CancelScope(shield=True):
            answered = trio.Event()
            nursery = self._retry_nursery
            if nursery is None or request_id in self.aborts:
                with trio.move_on_after(self.config.abort_timeout):
                    await self._first_attempt(request_id, answered)
                return
            self.aborts.begin(
                request_id, confirm=unanswered and bool(self.config.abort_confirm_after), trace=trace
            )
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
        """One Abort call: its result (``aborted``, ``already_finished``, ``not_found``), or
        :class:`_RetryableAbort` / :class:`EngineClientError`; a span when the stream had one."""
        traced = self.aborts.trace_of(request_id)
        if traced is None:
            return await self._call_abort(request_id)
        call = traced[0].abort_call(traced[1].value)
        result = "no_answer"  # unless it ends otherwise (abort_timeout)
        try:
            result = await self._call_abort(request_id)
            return result
        except _RetryableAbort as err:
            result = "refused" if err.answered else "no_answer"
            raise
        except EngineClientError:
            result = "failed"
            raise
        finally:
            call.answered(result)

    async def _call_abort(self, request_id: str) -> str:
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

"""Every Abort still owed to the engine: one state per request id, its transitions in one place.

An Abort is idempotent on the engine (``ABORTED``, ``ALREADY_FINISHED`` and ``NOT_FOUND`` all
mean done), so the sidecar may send it late and more than once. What it must not do is forget
one while the engine may still hold the request, nor admit a new stream under an id whose
Abort is still under way (a late Abort would end it). :class:`AbortLedger` keeps each such id
in exactly one :class:`AbortState`; :class:`~sidecar.core.lifecycle.StreamSupervisor` does the
sending and asks the ledger for each step::

    begin ──▶ SENDING ──finish──▶ (forgotten)
                 │  └────finish, NOT_FOUND to confirm──▶ CONFIRMING ──confirmed──▶ (forgotten)
                park (undelivered after the retry window)
                 ▼
              PARKED ──take──▶ REDELIVERING ──redelivered(done)──▶ finish (as above)
                 ▲                   │
                 └─redelivered(not done)

The parked ids form a bounded backlog (``--max-undelivered-aborts``), oldest first; when it is
full the oldest is dropped — counted (``openengine_sidecar_aborts_total{result="dropped"}``)
and logged, never silently. One being re-sent at that moment is forgotten when its attempt
ends. A ``NOT_FOUND`` for a request the engine had sent nothing on may mean the Abort overtook
the request (on another connection), so those are confirmed (re-sent after pauses) before the
id is free again.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from sidecar.core import metrics
from sidecar.quoting import quote

if TYPE_CHECKING:
    from sidecar.tracing.otel import StreamTrace

log = logging.getLogger(__name__)

#: Longest pause between two re-delivery rounds while the engine does not answer; a round
#: starts sooner when the engine answers anything (an Abort) or the engine watch finds it back.
REDELIVER_MAX_PAUSE = 5.0
REDELIVER_FIRST_PAUSE = 0.25


class AbortState(enum.Enum):
    """Where one request id's Abort stands."""

    #: The first attempt, or retries within ``--abort-retry-window``.
    SENDING = "sending"
    #: Undelivered after the retry window: kept in the backlog, re-sent once the engine answers.
    PARKED = "parked"
    #: A parked Abort being re-sent right now.
    REDELIVERING = "redelivering"
    #: Answered NOT_FOUND for a stream the engine had sent nothing on: re-sent after pauses.
    CONFIRMING = "confirming"


@dataclass
class _Record:
    state: AbortState
    #: The engine sent nothing on the stream: a NOT_FOUND answer is to be confirmed.
    confirm: bool
    #: Answered NOT_FOUND (while ``confirm``).
    not_found: bool = False
    #: Dropped from the full backlog while being re-sent: forgotten when that attempt ends.
    dropped: bool = False
    #: The stream's span (tracing on): each call of this Abort is traced under it.
    trace: StreamTrace | None = None


class AbortLedger:
    """The request ids whose Abort is still owed (module doc); ``cap`` bounds the backlog."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._records: dict[str, _Record] = {}
        self._backlog: dict[str, None] = {}  # parked or re-sent ids, oldest first
        self._parked = trio.Event()
        #: Set when the engine answered something: a re-delivery round may start at once.
        self.engine_answered = trio.Event()

    # -- questions -------------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        """The id's Abort is under way: it is not admitted again meanwhile."""
        return request_id in self._records

    def state(self, request_id: str) -> AbortState | None:
        record = self._records.get(request_id)
        return record.state if record is not None else None

    def trace_of(self, request_id: str) -> tuple[StreamTrace, AbortState] | None:
        """The span of the stream whose Abort this is, and where the Abort stands; None when
        untraced (tracing off) or not under way."""
        record = self._records.get(request_id)
        if record is None or record.trace is None:
            return None
        return record.trace, record.state

    def backlog(self) -> list[str]:
        """Parked ids (and the one being re-sent), oldest first."""
        return list(self._backlog)

    def oldest_parked(self) -> str | None:
        return next((rid for rid in self._backlog if self._records[rid].state is AbortState.PARKED), None)

    def __len__(self) -> int:
        return len(self._records)

    # -- transitions -----------------------------------------------------------------------

    def begin(self, request_id: str, *, confirm: bool, trace: StreamTrace | None = None) -> None:
        """→ SENDING. ``confirm``: the engine sent nothing on the stream (a NOT_FOUND answer is
        confirmed). The id must not be under way already (admission refuses it then).
        ``trace``: the stream's span (:meth:`trace_of`)."""
        if request_id in self._records:
            raise ValueError(f"the Abort of {request_id!r} is already under way")
        self._records[request_id] = _Record(AbortState.SENDING, confirm, trace=trace)

    def answered_not_found(self, request_id: str) -> None:
        """The engine answered NOT_FOUND: remembered where it has to be confirmed."""
        self.answered()
        record = self._records.get(request_id)
        if record is not None and record.confirm:
            record.not_found = True

    def park(self, request_id: str) -> None:
        """SENDING → PARKED (undelivered after the retry window); when the backlog is full, the
        oldest is dropped (logged and counted)."""
        record = self._expect(request_id, AbortState.SENDING)
        if len(self._backlog) >= self.cap:
            dropped = next(iter(self._backlog))
            del self._backlog[dropped]
            metrics.child(metrics.ABORTS, "dropped").inc()
            log.warning(
                "abort of %s dropped undelivered: %d Aborts already wait for the engine "
                "(--max-undelivered-aborts)",
                quote(dropped),
                self.cap,
            )
            if self._records[dropped].state is AbortState.REDELIVERING:
                self._records[dropped].dropped = True  # forgotten when its attempt ends
            else:
                del self._records[dropped]
        record.state = AbortState.PARKED
        self._backlog[request_id] = None
        metrics.ABORTS_PARKED.inc()
        self._backlog_changed()
        self._parked.set()

    def take(self, request_id: str) -> bool:
        """PARKED → REDELIVERING; False when it is not parked (dropped, or being re-sent)."""
        record = self._records.get(request_id)
        if record is None or record.state is not AbortState.PARKED:
            return False
        record.state = AbortState.REDELIVERING
        return True

    def redelivered(self, request_id: str, *, done: bool) -> bool:
        """REDELIVERING → done with (as :meth:`finish`) when ``done`` or dropped meanwhile, else
        back to PARKED. Returns True when the id now needs a confirmation (CONFIRMING)."""
        record = self._expect(request_id, AbortState.REDELIVERING)
        if done or record.dropped:
            self._backlog.pop(request_id, None)
            self._backlog_changed()
            return self._done(request_id, record, can_confirm=True)
        record.state = AbortState.PARKED
        return False

    def finish(self, request_id: str, *, can_confirm: bool = True) -> bool:
        """SENDING → forgotten, or → CONFIRMING when answered NOT_FOUND on a stream the engine
        sent nothing on (and ``can_confirm``: something will send the confirmations). Returns
        True for CONFIRMING: the caller starts the confirmation."""
        return self._done(request_id, self._expect(request_id, AbortState.SENDING), can_confirm=can_confirm)

    def _done(self, request_id: str, record: _Record, *, can_confirm: bool) -> bool:
        if record.not_found and can_confirm:
            record.state = AbortState.CONFIRMING
            return True
        del self._records[request_id]
        return False

    def confirmed(self, request_id: str) -> None:
        """CONFIRMING → forgotten (found late and aborted, or the confirmations used up)."""
        self._expect(request_id, AbortState.CONFIRMING)
        del self._records[request_id]

    def _expect(self, request_id: str, state: AbortState) -> _Record:
        record = self._records.get(request_id)
        if record is None or record.state is not state:
            found = record.state.value if record is not None else "none"
            raise ValueError(f"the Abort of {request_id!r} is {found}, not {state.value}")
        return record

    def _backlog_changed(self) -> None:
        metrics.ABORTS_UNDELIVERED.set(len(self._backlog))

    # -- waiting ---------------------------------------------------------------------------

    async def wait_parked(self) -> None:
        """Return once an Abort is parked."""
        while self.oldest_parked() is None:
            self._parked = trio.Event()
            await self._parked.wait()

    def answered(self) -> None:
        """The engine answered a call: wake a re-delivery round waiting out its pause."""
        self.engine_answered.set()

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the engine answers meanwhile."""
        self.engine_answered = trio.Event()
        with trio.move_on_after(seconds):
            await self.engine_answered.wait()

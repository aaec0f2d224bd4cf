"""Aborts the engine could not be reached for: kept (bounded) and re-sent once it answers.

An Abort is idempotent on the engine (``ABORTED``, ``ALREADY_FINISHED`` and ``NOT_FOUND``
all mean done), so the sidecar may send it late and more than once. What it must not do is
forget one while the engine still holds the request: a partition or a hang longer than
``--abort-retry-window`` would otherwise leave the engine running (or holding) a request
nobody reads. :class:`AbortBacklog` keeps those request ids — at most
``--max-undelivered-aborts``; when full, the oldest is dropped, counted
(``openengine_sidecar_aborts_total{result="dropped"}``) and logged, never silently — and
:meth:`StreamSupervisor._redeliver <sidecar.core.lifecycle.StreamSupervisor>` re-sends them.
"""

from __future__ import annotations

import logging

import trio

from sidecar.core import metrics
from sidecar.quoting import quote

log = logging.getLogger(__name__)

#: Longest pause between two re-delivery rounds while the engine does not answer; a round
#: starts sooner when the engine answers anything (an Abort) or the engine watch finds it back.
REDELIVER_MAX_PAUSE = 5.0
REDELIVER_FIRST_PAUSE = 0.25


class AbortBacklog:
    """Request ids whose Abort is still owed to the engine, oldest first (bounded)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._ids: dict[str, None] = {}  # insertion order = age
        self._added = trio.Event()
        #: Set when the engine answered something: a re-delivery round may start at once.
        self.engine_answered = trio.Event()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def add(self, request_id: str) -> str | None:
        """Keep ``request_id``; returns the oldest id dropped to make room, if one was."""
        dropped = None
        if len(self._ids) >= self.cap:
            dropped = next(iter(self._ids))
            del self._ids[dropped]
            metrics.child(metrics.ABORTS, "dropped").inc()
            log.warning(
                "abort of %s dropped undelivered: %d Aborts already wait for the engine "
                "(--max-undelivered-aborts)",
                quote(dropped),
                self.cap,
            )
        self._ids[request_id] = None
        metrics.ABORTS_PARKED.inc()
        metrics.ABORTS_UNDELIVERED.set(len(self._ids))
        self._added.set()
        return dropped

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)
        metrics.ABORTS_UNDELIVERED.set(len(self._ids))

    def oldest(self) -> str | None:
        return next(iter(self._ids), None)

    def ids(self) -> list[str]:
        return list(self._ids)

    async def wait_nonempty(self) -> None:
        while not self._ids:
            self._added = trio.Event()
            await self._added.wait()

    def answered(self) -> None:
        """The engine answered a call: wake a re-delivery round waiting out its pause."""
        self.engine_answered.set()

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the engine answers meanwhile."""
        self.engine_answered = trio.Event()
        with trio.move_on_after(seconds):
            await self.engine_answered.wait()

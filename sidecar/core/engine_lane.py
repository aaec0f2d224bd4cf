"""The lane of engine calls made on a client's behalf (``listLoras``, ``loadLora``,
``unloadLora``, ``releaseKvSession``, a ``health`` call with params for the engine): bounded,
and never in the way of the sidecar's own.

The sidecar's Health checks, GetLoad polls and Aborts share the engine client's control pool
with these calls. An HTTP/2 connection carries a limited number of streams at once (h2-based
servers: 100) and the pool a limited number of connections; past them calls wait — so an
unbounded number of client calls (a ``listLoras`` flood) would make the sidecar's own Health
checks time out and declare a healthy engine lost. Client calls therefore take a slot of this lane: at most
``capacity`` at once in the sidecar, at most ``per_owner`` of them for one connection; a call
that finds no slot is refused at once (``OVERLOADED``, retryable), never queued. With the
defaults (8) plus at most 64 Aborts (``LifecycleConfig.max_concurrent_aborts``), a Health
check and a GetLoad poll, the control connection stays below 100 streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sidecar.core import metrics
from sidecar.core.errors import Rejection
from sidecar.openengine import pb

__all__ = ["EngineCallLane"]


class EngineCallLane:
    """Slots for client-initiated engine calls (see module doc). ``0`` = no limit."""

    def __init__(self, capacity: int = 8, per_owner: int = 4) -> None:
        self.capacity = capacity
        self.per_owner = per_owner
        self.in_use = 0
        self._owners: dict[object, int] = {}

    @contextmanager
    def slot(self, owner: object = None) -> Iterator[None]:
        """Hold a slot for the body; raise :class:`Rejection` (``OVERLOADED``, retryable) at once
        when the lane or ``owner``'s share of it is full."""
        held = self._owners.get(owner, 0)
        if self.capacity and self.in_use >= self.capacity:
            metrics.child(metrics.LIMIT_REFUSALS, "client_engine_calls").inc()
            raise Rejection(
                pb.ErrorCode.OVERLOADED,
                f"{self.capacity} engine calls of clients are in progress (the sidecar's limit); retry later",
                True,
            )
        if self.per_owner and held >= self.per_owner:
            metrics.child(metrics.LIMIT_REFUSALS, "client_engine_calls").inc()
            raise Rejection(
                pb.ErrorCode.OVERLOADED,
                f"at most {self.per_owner} engine calls in progress per connection; retry later",
                True,
            )
        self.in_use += 1
        self._owners[owner] = held + 1
        try:
            yield
        finally:
            self.in_use -= 1
            left = self._owners[owner] - 1
            if left:
                self._owners[owner] = left
            else:
                del self._owners[owner]

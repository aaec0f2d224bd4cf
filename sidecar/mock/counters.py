"""Ground-truth counters of a simulated engine, published in ``GetLoad.attributes``.

Tests and benchmarks judge the sidecar from the engine's side with these, so each has
one exact meaning (Struct numbers are doubles: exact to 2^53):

Totals since start
  ``requests_accepted``            passed validation and admission (queued or running)
  ``requests_rejected``            refused before acceptance (non-OK status), also
                                   ``rejected_by_status`` {status name: n}
  ``requests_completed``           ended with their success terminal (last
                                   ``GenerationFinished`` / ``PrefillReady``) sent to a client
  ``requests_failed``              ended with a terminal ``EngineError`` (not from Abort)
  ``requests_cancelled_by_client`` the client closed the stream before the terminal
  ``requests_aborted``             ended by Abort (request id, KV session or all) or a
                                   drain deadline while their client was still connected
  ``requests_dropped``             stream closed OK without a terminal (fault)
  ``orphans_aborted``              leaked requests later released by Abort
  ``orphans_expired``              leaked requests released by ``--orphan-timeout``
  ``aborts_received``              Abort calls, any target or outcome (dropped ones too)
  ``aborts_received_by_id``        {request_id: Abort calls naming it} (first 10 000 ids)
  ``abort_outcomes``               {ABORTED | ALREADY_FINISHED | NOT_FOUND | INVALID | DROPPED: n}
  ``served_by_rank``               {"rank": requests accepted on that DP rank}
Gauges (now)
  ``streams_open``                 Generate calls whose handler is still running
  ``requests_leaked``              requests still held by the engine with no client
                                   (client gone, no Abort yet)
  ``requests_in_flight``           running + queued + leaked
  ``kv_sessions_open``             prefill KV sessions held for a decode pull

Invariant once the engine is idle: ``requests_accepted == requests_completed +
requests_failed + requests_cancelled_by_client + requests_aborted + requests_dropped``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

MAX_TRACKED_IDS = 10_000


class GroundTruthCounters:
    """Mutable counters; ``snapshot()`` renders them for ``LoadInfo.attributes``."""

    def __init__(self, dp_size: int) -> None:
        self.requests_accepted = 0
        self.requests_rejected = 0
        self.rejected_by_status: Counter[str] = Counter()
        self.requests_completed = 0
        self.requests_failed = 0
        self.requests_cancelled_by_client = 0
        self.requests_aborted = 0
        self.requests_dropped = 0
        self.orphans_aborted = 0
        self.orphans_expired = 0
        self.aborts_received = 0
        self.aborts_received_by_id: Counter[str] = Counter()
        self.aborts_untracked_ids = 0
        self.abort_outcomes: Counter[str] = Counter()
        self.served_by_rank = [0] * dp_size
        self.streams_open = 0
        self.requests_leaked = 0

    def rejected(self, status: str) -> None:
        self.requests_rejected += 1
        self.rejected_by_status[status] += 1

    def abort_received(self, request_id: str | None) -> None:
        self.aborts_received += 1
        if request_id is None:
            return
        if request_id in self.aborts_received_by_id or len(self.aborts_received_by_id) < MAX_TRACKED_IDS:
            self.aborts_received_by_id[request_id] += 1
        else:
            self.aborts_untracked_ids += 1

    def snapshot(self, *, in_flight: int, kv_sessions_open: int) -> dict[str, Any]:
        return {
            "requests_accepted": self.requests_accepted,
            "requests_rejected": self.requests_rejected,
            "rejected_by_status": dict(self.rejected_by_status),
            "requests_completed": self.requests_completed,
            "requests_failed": self.requests_failed,
            "requests_cancelled_by_client": self.requests_cancelled_by_client,
            "requests_aborted": self.requests_aborted,
            "requests_dropped": self.requests_dropped,
            "orphans_aborted": self.orphans_aborted,
            "orphans_expired": self.orphans_expired,
            "aborts_received": self.aborts_received,
            "aborts_received_by_id": dict(self.aborts_received_by_id),
            "aborts_untracked_ids": self.aborts_untracked_ids,
            "abort_outcomes": dict(self.abort_outcomes),
            "served_by_rank": {str(r): n for r, n in enumerate(self.served_by_rank)},
            "streams_open": self.streams_open,
            "requests_leaked": self.requests_leaked,
            "requests_in_flight": in_flight,
            "kv_sessions_open": kv_sessions_open,
        }

"""Load of the engine as the worker card shows it: the latest ``GetLoad`` snapshot and its age.

:class:`LoadTracker` is the I/O-free bookkeeping behind the run command's poller: it records
snapshots and failures and reports a :class:`LoadStatus` that flags a stale snapshot
(never silently keeps an old one as fresh). Presence is kept: ``None`` = not reported.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sidecar.openengine import pb

__all__ = ["LoadSnapshot", "LoadStatus", "LoadTracker", "RankLoad"]


class _LoadStruct(msgspec.Struct, kw_only=True, rename="camel"):
    """Base: lowerCamelCase JSON names, like the worker card."""


def _struct_dict(s: pb.Struct | None) -> dict[str, Any] | None:
    if s is None:
        return None
    d = s.to_dict()
    return d if isinstance(d, dict) else None


class RankLoad(_LoadStruct):
    data_parallel_rank: int | None
    running_requests: int | None
    queued_requests: int | None
    used_kv_blocks: int | None
    total_kv_blocks: int | None
    prefill_batch_size: int | None
    decode_batch_size: int | None


class LoadSnapshot(_LoadStruct):
    """One ``GetLoad`` answer, presence kept."""

    instance_id: str
    timestamp_unix_nanos: int | None
    running_requests: int | None
    queued_requests: int | None
    active_kv_sessions: int | None
    used_kv_blocks: int | None
    total_kv_blocks: int | None
    running_tokens: int | None
    waiting_tokens: int | None
    prefill_batch_size: int | None
    decode_batch_size: int | None
    ranks: list[RankLoad]
    attributes: dict[str, Any] | None

    @classmethod
    def from_pb(cls, info: pb.LoadInfo) -> LoadSnapshot:
        return cls(
            instance_id=info.instance_id,
            timestamp_unix_nanos=info.timestamp_unix_nanos,
            running_requests=info.running_requests,
            queued_requests=info.queued_requests,
            active_kv_sessions=info.active_kv_sessions,
            used_kv_blocks=info.used_kv_blocks,
            total_kv_blocks=info.total_kv_blocks,
            running_tokens=info.running_tokens,
            waiting_tokens=info.waiting_tokens,
            prefill_batch_size=info.prefill_batch_size,
            decode_batch_size=info.decode_batch_size,
            ranks=[
                RankLoad(
                    data_parallel_rank=r.data_parallel_rank,
                    running_requests=r.running_requests,
                    queued_requests=r.queued_requests,
                    used_kv_blocks=r.used_kv_blocks,
                    total_kv_blocks=r.total_kv_blocks,
                    prefill_batch_size=r.prefill_batch_size,
                    decode_batch_size=r.decode_batch_size,
                )
                for r in info.ranks
            ],
            attributes=_struct_dict(info.attributes),
        )


class LoadStatus(_LoadStruct):
    """Latest load snapshot with its age; a snapshot older than the stale limit is flagged."""

    snapshot: LoadSnapshot | None = None
    #: Seconds since the snapshot was received (``None`` before the first one).
    age_s: float | None = None
    #: True when there is no snapshot yet, the last poll failed, or it is older than the stale limit.
    stale: bool = True
    #: Failed polls since start / since the last success.
    error_count: int = 0
    consecutive_errors: int = 0
    last_error: str | None = None


class LoadTracker:
    """I/O-free bookkeeping for the load poller: record results, read a :class:`LoadStatus`.

    Times are the caller's clock (``trio.current_time()``); nothing here sleeps or polls.
    """

    def __init__(self, *, stale_after: float = 5.0) -> None:
        self.stale_after = stale_after
        self._snapshot: LoadSnapshot | None = None
        self._received_at: float | None = None
        self._errors = 0
        self._consecutive = 0
        self._last_error: str | None = None

    def record(self, info: pb.LoadInfo, *, now: float) -> None:
        self._snapshot = LoadSnapshot.from_pb(info)
        self._received_at = now
        self._consecutive = 0

    def record_error(self, reason: str) -> None:
        self._errors += 1
        self._consecutive += 1
        self._last_error = reason

    @property
    def snapshot(self) -> LoadSnapshot | None:
        return self._snapshot

    def status(self, *, now: float) -> LoadStatus:
        age = None if self._received_at is None else max(0.0, now - self._received_at)
        return LoadStatus(
            snapshot=self._snapshot,
            age_s=None if age is None else round(age, 3),
            # the last poll failed: whatever we hold is no longer known to be current
            stale=age is None or age > self.stale_after or self._consecutive > 0,
            error_count=self._errors,
            consecutive_errors=self._consecutive,
            last_error=self._last_error,
        )

"""Load of the engine as the worker card shows it: the latest ``GetLoad`` snapshot and its age.

:class:`LoadTracker` is the I/O-free bookkeeping behind the run command's poller: it records
snapshots and failures and reports a :class:`LoadStatus` that flags a stale snapshot
(never silently keeps an old one as fresh). Presence is kept: ``None`` = not reported.

The poller keeps ``GetLoad`` off the event loop's critical path: the answer arrives as bytes
(`EngineClient.get_load_bytes`), :func:`split_load_info` parses everything but ``attributes`` (a
``google.protobuf.Struct`` the engine may fill with anything: betterproto2 needs ~1 µs per
byte of it), and :func:`attributes_dict` converts those with a direct wire walker (~50 ns
per byte; the poller runs it in a worker thread when large, not at all beyond a limit).
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any

import msgspec

from sidecar.core.int64 import Uint64, u64
from sidecar.core.struct_wire import StructWireError, struct_to_dict
from sidecar.json_types import JSONObject
from sidecar.openengine import pb
from sidecar.openengine.schema.protobuf_wire import WireError, without_field

__all__ = [
    "ATTRIBUTES_FIELD",
    "LoadSnapshot",
    "LoadStatus",
    "LoadTracker",
    "MalformedLoadInfo",
    "RankLoad",
    "attributes_dict",
    "split_load_info",
]

#: Field number of ``LoadInfo.attributes`` (openengine.v1).
ATTRIBUTES_FIELD = 30


class MalformedLoadInfo(ValueError):
    """A ``GetLoad`` answer that is not a well-formed ``LoadInfo``."""


def split_load_info(data: bytes) -> tuple[pb.LoadInfo, bytes | None]:
    """Parse a serialized ``LoadInfo`` except its ``attributes``, returned as raw ``Struct``
    bytes (``None`` when absent; repeated occurrences are concatenated = merged, as protobuf
    does). Cost: the small fields only; the attributes are skipped by their length prefix.
    Raises :class:`MalformedLoadInfo`."""
    try:
        rest, attrs = without_field(data, ATTRIBUTES_FIELD)
    except WireError as err:
        raise MalformedLoadInfo(str(err)) from None
    try:
        info = pb.LoadInfo.parse(rest)
    except Exception as err:  # betterproto2 raises assorted errors on input it cannot use
        raise MalformedLoadInfo(f"not a LoadInfo: {type(err).__name__}: {err}") from None
    return info, (b"".join(attrs) if attrs else None)


def attributes_dict(raw: bytes | None) -> JSONObject | None:
    """The proto3 JSON form of raw ``Struct`` bytes (CPU-bound: run large ones in a thread).
    Raises :class:`MalformedLoadInfo`."""
    if raw is None:
        return None
    try:
        return struct_to_dict(raw)
    except StructWireError as err:
        raise MalformedLoadInfo(f"attributes: {err}") from None


class _LoadStruct(msgspec.Struct, kw_only=True, rename="camel"):
    """Base: lowerCamelCase JSON names, like the worker card."""


def _struct_dict(s: pb.Struct | None) -> JSONObject | None:
    if s is None:
        return None
    d = s.to_dict()
    return d if isinstance(d, dict) else None


class RankLoad(_LoadStruct):
    data_parallel_rank: int | None
    running_requests: int | None
    queued_requests: int | None
    used_kv_blocks: Uint64 | None
    total_kv_blocks: Uint64 | None
    prefill_batch_size: int | None
    decode_batch_size: int | None


class LoadSnapshot(_LoadStruct):
    """One ``GetLoad`` answer, presence kept."""

    instance_id: str
    timestamp_unix_nanos: Uint64 | None
    running_requests: int | None
    queued_requests: int | None
    active_kv_sessions: int | None
    used_kv_blocks: Uint64 | None
    total_kv_blocks: Uint64 | None
    running_tokens: Uint64 | None
    waiting_tokens: Uint64 | None
    prefill_batch_size: int | None
    decode_batch_size: int | None
    ranks: list[RankLoad]
    #: The engine's free-form attributes (a JSON object); untyped for msgspec, which cannot
    #: decode the recursive ``sidecar.json_types.JSONObject``.
    attributes: dict[str, Any] | None

    @classmethod
    def from_pb(
        cls, info: pb.LoadInfo, *, attributes: JSONObject | EllipsisType | None = ...
    ) -> LoadSnapshot:
        """``attributes``: the already converted attributes (default: convert ``info.attributes``)."""
        return cls(
            instance_id=info.instance_id,
            timestamp_unix_nanos=u64(info.timestamp_unix_nanos),
            running_requests=info.running_requests,
            queued_requests=info.queued_requests,
            active_kv_sessions=info.active_kv_sessions,
            used_kv_blocks=u64(info.used_kv_blocks),
            total_kv_blocks=u64(info.total_kv_blocks),
            running_tokens=u64(info.running_tokens),
            waiting_tokens=u64(info.waiting_tokens),
            prefill_batch_size=info.prefill_batch_size,
            decode_batch_size=info.decode_batch_size,
            ranks=[
                RankLoad(
                    data_parallel_rank=r.data_parallel_rank,
                    running_requests=r.running_requests,
                    queued_requests=r.queued_requests,
                    used_kv_blocks=u64(r.used_kv_blocks),
                    total_kv_blocks=u64(r.total_kv_blocks),
                    prefill_batch_size=r.prefill_batch_size,
                    decode_batch_size=r.decode_batch_size,
                )
                for r in info.ranks
            ],
            attributes=_struct_dict(info.attributes) if attributes is ... else attributes,
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

    def record(
        self, info: pb.LoadInfo, *, now: float, attributes: JSONObject | EllipsisType | None = ...
    ) -> None:
        """Keep ``info`` as the latest snapshot (``attributes``: see :meth:`LoadSnapshot.from_pb`)."""
        self._snapshot = LoadSnapshot.from_pb(info, attributes=attributes)
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

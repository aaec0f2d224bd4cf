"""A trio-native stand-in for ``EngineClient`` serving ``SubscribeKvEvents`` from a fake engine.

Same surface as the real client (``subscribe_kv_events(request)`` is an async context
manager yielding an async iterator; a terminal error raises ``EngineTerminalError``), over
an engine model with a bounded history: resume from ``start_sequence_number`` when held,
otherwise start from the oldest held batch (``resume_error=True``: answer with a terminal
non-retryable error instead); ``include_snapshot`` sends the current cache as one batch
(``snapshots=False``: refused with ``INVALID_ARGUMENT``), numbered per ``snapshot_style``. Faults: ``deliver=False`` keeps a
batch out of the live streams (an in-stream gap), ``end_streams()``, ``restart()``,
``gate`` (subscriptions wait for it), ``fail_next`` (errors raised at subscribe).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from sidecar.openengine import pb
from sidecar.openengine.errors import (
    EngineMessageTooLarge,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)

MEDIUM = {m.name: m for m in pb.StorageMedium if m.name != "UNSPECIFIED"}


def pb_hash(h: int | bytes) -> pb.KvBlockHash:
    if isinstance(h, int):
        return pb.KvBlockHash(value=h.to_bytes(8, "big"), encoding="int64")
    return pb.KvBlockHash(value=h, encoding="bytes")


def to_pb(ev: dict[str, Any]) -> pb.KvEvent:
    """An output-form event dict as the protobuf event an engine would send."""
    t = ev["type"]
    if t == "AllBlocksCleared":
        return pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())
    medium = MEDIUM.get(ev.get("medium") or "", pb.StorageMedium.UNSPECIFIED)
    if t == "BlockRemoved":
        return pb.KvEvent(
            block_removed=pb.BlockRemoved(
                block_hashes=[pb_hash(h) for h in ev["block_hashes"]],
                medium=medium,
                group_idx=ev.get("group_idx") or 0,
            )
        )
    parent = ev["parent_block_hash"]
    return pb.KvEvent(
        request_id="req",
        block_stored=pb.BlockStored(
            block_hashes=[pb_hash(h) for h in ev["block_hashes"]],
            parent_block_hash=pb_hash(parent) if parent is not None else None,
            token_ids=ev["token_ids"],
            block_size=ev["block_size"],
            lora_id=ev["lora_id"] or 0,
            lora_name=ev["lora_name"] or "",
            medium=medium,
            extra_keys=[pb.OpaqueKeyTuple(values=k or []) for k in ev.get("extra_keys") or []],
            group_idx=ev.get("group_idx") or 0,
            kv_cache_spec_kind=ev.get("kv_cache_spec_kind") or "",
            kv_cache_spec_sliding_window=ev.get("kv_cache_spec_sliding_window") or 0,
        ),
    )


def apply(cache: dict[Any, dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """The cache view a router keeps: block hash -> the BlockStored fields for it."""
    for ev in events:
        if ev["type"] == "AllBlocksCleared":
            cache.clear()
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                cache.pop(h, None)
        else:
            for h in ev["block_hashes"]:
                cache[h] = {"medium": ev["medium"], "lora_id": ev["lora_id"]}


class FakeGrpcEngine:
    def __init__(
        self,
        *,
        rank: int = 0,
        buffer_steps: int = 1000,
        resume_error: bool = False,
        snapshots: bool = True,
        snapshot_style: str = "last",
    ) -> None:
        self.rank = rank
        self.buffer_steps = buffer_steps
        self.resume_error = resume_error
        self.snapshots = snapshots
        # "last": a snapshot is numbered like the last batch folded into it; "next" (the mock
        # engines): like the first live batch after it, and starts with AllBlocksCleared
        self.snapshot_style = snapshot_style
        self.seq = 0
        self.history: deque[pb.KvEventBatch] = deque(maxlen=buffer_steps)
        self.cache: dict[Any, dict[str, Any]] = {}
        self.streams: list[trio.MemorySendChannel[Any]] = []
        self.requests: list[pb.SubscribeKvEventsRequest] = []
        self.fail_next: list[Exception] = []
        self.gate: trio.Event | None = None
        self.subscribed = trio.Event()

    def _batch(self, seq: int, events: list[pb.KvEvent]) -> pb.KvEventBatch:
        return pb.KvEventBatch(
            sequence_number=seq,
            timestamp_unix_nanos=time.time_ns(),
            data_parallel_rank=self.rank,
            events=events,
        )

    def publish(
        self, events: list[dict[str, Any]], *, deliver: bool = True, raw: pb.KvEventBatch | None = None
    ) -> int:
        seq = self.seq
        self.seq += 1
        batch = raw or self._batch(seq, [to_pb(e) for e in events])
        batch.sequence_number = seq
        apply(self.cache, events)
        self.history.append(batch)
        if deliver:
            for s in self.streams:
                s.send_nowait(pb.SubscribeKvEventsResponse(batch=batch))
        return seq

    def end_streams(self, exc: Exception | None = None) -> None:
        for s in self.streams:
            if exc is not None:
                s.send_nowait(exc)
            s.close()
        self.streams.clear()

    def restart(self) -> None:
        self.end_streams(EngineUnavailable("engine restarted"))
        self.seq = 0
        self.history.clear()
        self.cache.clear()

    def _snapshot(self) -> pb.KvEventBatch:
        events = [
            to_pb(
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    **v,
                    "lora_name": None,
                }
            )
            for h, v in self.cache.items()
        ]
        if self.snapshot_style == "next":
            return self._batch(self.seq, [to_pb({"type": "AllBlocksCleared"}), *events])
        return self._batch(max(self.seq - 1, 0), events)

    async def get_kv_event_sources(
        self, request: pb.GetKvEventSourcesRequest
    ) -> pb.GetKvEventSourcesResponse:
        return pb.GetKvEventSourcesResponse(
            sources=[pb.KvEventSource(transport="grpc", data_parallel_rank=self.rank, encoding="protobuf")]
        )

    @asynccontextmanager
    async def subscribe_kv_events(
        self, request: pb.SubscribeKvEventsRequest, *, max_message_bytes: int | None = None
    ) -> AsyncIterator[AsyncIterator[Any]]:
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            raise self.fail_next.pop(0)
        assert list(request.data_parallel_ranks) == [self.rank]
        send, receive = trio.open_memory_channel[Any](math.inf)
        start = request.start_sequence_number
        if request.include_snapshot:
            if not self.snapshots:
                raise EngineStatusError(
                    "INVALID_ARGUMENT", 3, "snapshots unsupported", pb.ErrorCode.INVALID_ARGUMENT
                )
            snap = self._snapshot()
            send.send_nowait(pb.SubscribeKvEventsResponse(batch=snap))
        elif self.history:
            oldest = self.history[0].sequence_number
            if start < oldest and self.resume_error and start > 0:
                err = pb.EngineError(
                    code=pb.ErrorCode.INVALID_ARGUMENT, message="start expired", retryable=False
                )
                send.send_nowait(EngineTerminalError(err, pb.SubscribeKvEventsResponse(error=err)))
            else:
                for b in self.history:
                    if b.sequence_number >= start:
                        send.send_nowait(pb.SubscribeKvEventsResponse(batch=b))
        self.streams.append(send)
        self.subscribed.set()

        async def stream() -> AsyncIterator[Any]:
            async for item in receive:
                if isinstance(item, Exception):
                    raise item
                # as the EngineClient: a message over the bound fails the stream unread
                if max_message_bytes is not None and len(bytes(item)) > max_message_bytes:
                    raise EngineMessageTooLarge(len(bytes(item)), max_message_bytes)
                yield item

        try:
            yield stream()
        finally:
            if send in self.streams:
                self.streams.remove(send)
            send.close()

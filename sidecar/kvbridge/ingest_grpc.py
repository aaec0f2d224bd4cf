"""Ingest of one DP rank over OpenEngine ``SubscribeKvEvents`` (through the ``EngineClient``).

One subscription at a time per rank. After an error or the end of a stream, resubscribe
from the next sequence number (exponential backoff, reset by the first delivered batch);
after a gap inside a stream, at once. When the engine cannot resume where asked (its first
batch is not that number, or it refuses the start with a non-retryable error), resubscribe
with ``include_snapshot`` and publish ``AllBlocksCleared`` before the snapshot — see
:class:`~sidecar.kvbridge.sequencer.GrpcSequencer`. An engine that also refuses snapshots
is then followed live after the ``AllBlocksCleared``.

Each batch is converted (:mod:`sidecar.kvbridge.decode_proto`, the field mapping) and
encoded in vLLM's tagged-map form, labelled with this rank.

A batch larger than ``IngestLimits.max_batch_bytes`` is refused before it is read (the
engine's length prefix): counted as a decode error, ``AllBlocksCleared`` published, and the
subscription resumed after it (a too-large snapshot: followed live instead).

Cancellation: cancel the surrounding scope; leaving the ``subscribe_kv_events`` block
resets the HTTP/2 stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

import trio

from sidecar.kvbridge.decode_proto import batch_from_proto
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import OutBatch, cleared_payload, encode_batch
from sidecar.kvbridge.ingest_limits import IngestLimits
from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.sequencer import Clear, Duplicate, Emit, GrpcAction, GrpcSequencer, Reason, Resubscribe
from sidecar.kvbridge.sources import GrpcSource
from sidecar.kvbridge.spans import KvSpans
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import (
    EngineClientError,
    EngineMessageTooLarge,
    EngineStatusError,
    EngineTerminalError,
)
from sidecar.quoting import clip

if TYPE_CHECKING:
    from sidecar.tracing.otel import Tracer

log = logging.getLogger(__name__)


class KvEventClient(Protocol):
    """The part of ``EngineClient`` the KV bridge uses."""

    def subscribe_kv_events(
        self, request: pb.SubscribeKvEventsRequest, *, max_message_bytes: int | None = None
    ) -> AbstractAsyncContextManager[AsyncIterator[pb.SubscribeKvEventsResponse]]: ...

    async def get_kv_event_sources(
        self, request: pb.GetKvEventSourcesRequest | None = None
    ) -> pb.GetKvEventSourcesResponse: ...


class GrpcIngest:
    """State of one gRPC ingest task; :meth:`run` is the task."""

    def __init__(
        self,
        client: KvEventClient,
        source: GrpcSource,
        out: trio.MemorySendChannel[list[OutBatch]],
        *,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
        limits: IngestLimits | None = None,
        cleared: bool = False,
        tracer: Tracer | None = None,
    ) -> None:
        self.client = client
        self.limits = limits or IngestLimits()
        self.source = source
        self.out = out
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.metrics = RankMetrics(source.rank)
        self.spans = KvSpans(tracer, source.rank, "grpc")
        self.sequencer: GrpcSequencer[pb.KvEventBatch] = GrpcSequencer(cleared=cleared)
        self._snapshot_refused = False
        self._rank_warned = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe and forward every batch to ``out`` until cancelled (or ``out`` is closed)."""
        rank = self.source.rank
        seqr = self.sequencer
        m = self.metrics
        delay = self.backoff_initial
        missing = 0  # numbers a gap skipped (the resumed subscription's span says)
        task_status.started()
        while True:
            start, snapshot = seqr.request()
            if snapshot and self._snapshot_refused:
                snapshot = False
            resuming = start > 0 and not snapshot
            replay = self.spans.replay(start, missing) if resuming else None
            missing = 0
            req = pb.SubscribeKvEventsRequest(
                data_parallel_ranks=[rank], include_snapshot=snapshot, start_sequence_number=start
            )
            log.info("KV rank %d: SubscribeKvEvents start=%d snapshot=%s", rank, start, snapshot)
            outcome: Resubscribe | None = None
            first = True
            try:
                async with self.client.subscribe_kv_events(
                    req, max_message_bytes=self.limits.max_batch_bytes
                ) as stream:
                    async for resp in stream:
                        batch = resp.batch
                        if batch is None:
                            continue
                        if first and resuming:
                            result = "ok" if batch.sequence_number == start else "failed"
                            m.replay(result)
                            self.spans.replayed(replay, result, 1)
                            replay = None
                        first = False
                        if batch.data_parallel_rank != rank and not self._rank_warned:
                            self._rank_warned = True
                            log.warning(
                                "KV rank %d: engine labels its batches rank %d",
                                rank,
                                batch.data_parallel_rank,
                            )
                        expected = seqr.next_seq or 0
                        outcome = await self._apply(seqr.on_batch(batch.sequence_number, batch))
                        if outcome is not None:
                            missing = max(0, batch.sequence_number - expected) if outcome.gap else 0
                            break
                        delay = self.backoff_initial
                log.info("KV rank %d: KV event stream ended", rank)
            except EngineMessageTooLarge as err:  # that batch is lost: resync, resume after it
                m.decode_errors.inc()
                log.warning("KV rank %d: %s; resyncing", rank, err)
                if snapshot:  # a snapshot too large to take: follow the engine live instead
                    self._snapshot_refused = True
                    await self._apply(seqr.clear(Reason.DECODE_ERROR))
                else:
                    await self._apply(seqr.skip())
            except (EngineTerminalError, EngineStatusError) as err:
                cannot_resume = not err.retryable and (resuming or snapshot)
                if resuming and first:
                    m.replay("failed")
                if cannot_resume and snapshot:
                    self._snapshot_refused = True
                seqr.on_failure(cannot_resume=cannot_resume)
                log.warning("KV rank %d: KV event subscription failed: %s", rank, err)
            except EngineClientError as err:  # unavailable, protocol error: retry
                log.warning("KV rank %d: KV event subscription lost: %s", rank, err)
            self.spans.replayed(replay, "failed", 0)  # still open: it never delivered
            if outcome is not None:
                if outcome.gap:
                    m.gaps.inc()
                continue  # resubscribe at once
            await trio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)

    def cleared(self) -> OutBatch:
        """An ``AllBlocksCleared`` batch for this rank (the map form, as every batch from this source)."""
        now = time.time()
        return OutBatch(cleared_payload(now, self.source.rank), 1, now)

    async def _apply(self, actions: list[GrpcAction[pb.KvEventBatch]]) -> Resubscribe | None:
        m = self.metrics
        rank = self.source.rank
        for a in actions:
            if type(a) is Emit:
                m.batches_in.inc()
                try:
                    batch = batch_from_proto(a.payload)
                except KvDecodeError as err:
                    m.decode_errors.inc()
                    log.warning(
                        "KV rank %d: batch %d does not decode (%s); resyncing",
                        rank,
                        a.seq,
                        clip(str(err), 200),
                    )
                    await self._apply(self.sequencer.clear(Reason.DECODE_ERROR))
                    continue
                n = len(batch.events)
                m.events_in.inc(n)
                batch.data_parallel_rank = rank
                await self.out.send([OutBatch(encode_batch(batch), n, batch.ts)])
            elif type(a) is Duplicate:
                m.duplicates.inc()
            elif type(a) is Clear:
                m.resync(a.reason)
                self.spans.resync(a.reason)
                log.warning("KV rank %d: publishing AllBlocksCleared (%s)", rank, a.reason)
                await self.out.send([self.cleared()])
            elif type(a) is Resubscribe:
                return a
        return None

"""``SubscribeKvEvents`` source of the simulated TensorRT-LLM engine (asyncio, no sockets).

Integration (for the engine)::

    kv = GrpcKvEvents(range(dp_size), advertise_host=h, advertise_port=p,
                      faults=KvFaults.from_kv_options(...))
    caches = [KvCache(r, bs, n, kv, ground_truth=gt) for r in ...]
    for c in caches: kv.attach_cache(c)            # snapshots read the cache

    async def subscribe_kv_events(self, message):   # Control handler (async generator)
        sub = kv.subscribe(message)                 # raises UnknownDpRank -> INVALID_ARGUMENT status
        async with sub:                             # unregisters on exit / cancellation
            async for response in sub:
                yield response
        # the iterator ends after a terminal ``error`` or when ``kv.close()`` ends all streams

    GetKvEventSources -> kv.sources(request.data_parallel_ranks)

Semantics (per requested rank; an empty ``data_parallel_ranks`` means all ranks;
batches of several ranks are interleaved in publish order; sequence numbers are
per rank, from 0):

* ``include_snapshot``: the stream starts with one snapshot batch per rank whose
  events are ``AllBlocksCleared`` followed by a ``BlockStored`` for every cached
  block (parents first), so applying it resets a consumer to the cache's state.
  Its ``sequence_number`` is the number of the first live batch NOT folded into it;
  the live batches that follow start at exactly that number (snapshot and first
  live batch share the number; the snapshot is recognisable as the first batch
  of the rank on a stream opened with ``include_snapshot`` and by its leading
  ``AllBlocksCleared``). ``start_sequence_number`` is ignored with a snapshot.
* ``start_sequence_number`` S > 0 without snapshot: resume. Held batches with
  ``seq >= S`` are replayed, then live ones. If S is older than the oldest held
  batch (history lost / buffer too small) or newer than the next batch (e.g. after
  a publisher restart), the stream cannot resume: its only message is a terminal
  ``error`` (``ERROR_CODE_INVALID_ARGUMENT``, ``retryable = false``, message
  starting ``"cannot resume"``), then it ends; resubscribe with ``include_snapshot``.
* S = 0 (proto default, no snapshot): everything still held, then live; never refused.
* A subscriber more than ``max_queue_size`` batches behind gets the batches
  already queued, then a terminal ``error`` (``ERROR_CODE_OVERLOADED``,
  ``retryable = true``); it can resume from its next sequence number.
* Faults (``KvFaults``): ``kv-gap`` drops batch N from live streams but keeps it
  for resume; ``kv-history-lost`` drops it and forgets it and all older batches;
  ``kv-publisher-restart`` restarts numbering at 0 and forgets the history.

Hashes: ``KvBlockHash{value = 8 bytes big-endian, encoding = "int64"}`` (read them
back unsigned: ``int.from_bytes(value, "big")``); see ``sidecar.mock.kvevents_wire``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from types import TracebackType

from sidecar.mock.kvcache import ClearedRecord, KvCache, KvEventRecord
from sidecar.mock.kvevents import UnknownDpRank
from sidecar.mock.kvevents_wire import BatchHistory, KvFaults, KvSequencer, batch_to_pb, large_batch_filler
from sidecar.openengine import pb
from sidecar.openengine.schema.protobuf_wire import length_delimited
from sidecar.openengine.serving.grpc_server import PreEncoded

__all__ = ["GrpcKvEvents", "KvSubscription"]

logger = logging.getLogger(__name__)

_Item = pb.SubscribeKvEventsResponse | PreEncoded | None  # None = end of stream; PreEncoded: a batch


def _terminal(item: _Item) -> bool:
    return item is None or (isinstance(item, pb.SubscribeKvEventsResponse) and item.error is not None)


def _error(code: pb.ErrorCode, message: str, *, retryable: bool) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(error=pb.EngineError(code=code, message=message, retryable=retryable))


class KvSubscription:
    """One ``SubscribeKvEvents`` stream: an async iterator of ``SubscribeKvEventsResponse``.

    Registered with its source from creation until :meth:`close` (also on leaving
    ``async with``), so no batch published in between is missed. Iteration ends
    after a terminal ``error`` or when the source closes. Cancelling a waiting
    ``__anext__`` is safe.
    """

    def __init__(self, source: GrpcKvEvents, ranks: list[int], max_queue: int) -> None:
        self._source = source
        self.ranks = ranks
        self._max_queue = max_queue
        self._queue: deque[_Item] = deque()
        self._wakeup = asyncio.Event()
        self._done = False  # a terminal item is queued: accept nothing more
        self._closed = False

    # ---- producer side (the source)
    def _put(self, item: _Item) -> None:
        if self._done:
            return
        self._queue.append(item)
        self._wakeup.set()
        if _terminal(item):
            self._done = True

    def _offer(self, batch: pb.KvEventBatch, filler: bytes = b"") -> None:
        if self._done:
            return
        if len(self._queue) >= self._max_queue:
            logger.warning("KV subscriber fell %d batches behind: ending its stream", len(self._queue))
            self._put(
                _error(
                    pb.ErrorCode.OVERLOADED,
                    f"subscriber fell more than {self._max_queue} batches behind; resume from the next sequence number",
                    retryable=True,
                )
            )
            self._source._unregister(self)
            return
        if filler:  # fault kv-large-batch: more events inside the batch's bytes (batch = field 1)
            self._put(PreEncoded(length_delimited(1, bytes(batch) + filler)))
        else:
            self._put(pb.SubscribeKvEventsResponse(batch=batch))

    # ---- consumer side
    def __aiter__(self) -> KvSubscription:
        return self

    async def __anext__(self) -> pb.SubscribeKvEventsResponse | PreEncoded:
        while not self._queue:
            if self._closed:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        item = self._queue.popleft()
        if item is None:
            self._closed = True
            self._source._unregister(self)
            raise StopAsyncIteration
        if _terminal(item):
            self._queue.clear()
            self._queue.append(None)
        return item

    def close(self) -> None:
        """Unregister from the source; iteration ends once the queue is drained. Idempotent."""
        self._source._unregister(self)
        self._put(None)

    async def __aenter__(self) -> KvSubscription:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _RankState:
    def __init__(self, buffer_steps: int, faults: KvFaults) -> None:
        self.sequencer: KvSequencer[pb.KvEventBatch] = KvSequencer(BatchHistory(buffer_steps), faults)
        self.cache: KvCache | None = None


class GrpcKvEvents:
    """Every DP rank's protobuf KV event stream with bounded history; a ``KvEventSink``."""

    def __init__(
        self,
        ranks: Iterable[int] | int = 1,
        *,
        advertise_host: str = "127.0.0.1",
        advertise_port: int = 0,
        buffer_steps: int = 10_000,
        max_queue_size: int = 10_000,
        faults: KvFaults | None = None,
    ) -> None:
        self.ranks = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
        self.advertise_host = advertise_host
        self.advertise_port = advertise_port
        self.buffer_steps = buffer_steps
        self.max_queue_size = max_queue_size
        self.faults = faults or KvFaults()
        self._ranks = {r: _RankState(buffer_steps, self.faults) for r in self.ranks}
        self._subs: list[KvSubscription] = []
        large = self.faults.large_batch
        self._filler = large_batch_filler(large) if large else b""
        self._filled: set[int] = set()  # ranks whose first live batch carried the filler
        self._spoiled: set[int] = set()  # ranks whose first batch carried an undecodable event

    def attach_cache(self, cache: KvCache) -> None:
        """Let snapshots of ``cache.dp_rank`` read ``cache``'s contents."""
        self._state(cache.dp_rank).cache = cache

    def _state(self, rank: int) -> _RankState:
        state = self._ranks.get(rank)
        if state is None:
            raise UnknownDpRank(f"no KV event source for DP rank {rank}")
        return state

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def next_sequence_number(self, rank: int) -> int:
        return self._state(rank).sequencer.next_seq

    # ---- sink
    def publish(self, dp_rank: int, events: Sequence[KvEventRecord]) -> int | None:
        state = self._state(dp_rank)
        seq = state.sequencer.next_seq
        batch = batch_to_pb(seq, time.time_ns(), dp_rank + self.faults.rank_offset, events)
        if self.faults.undecodable and dp_rank not in self._spoiled:
            self._spoiled.add(dp_rank)
            batch.events.append(pb.KvEvent())  # fault kv-undecodable: an event with none set
        decision = state.sequencer.next_batch(batch)
        if decision.seq != seq:  # restarted: renumber
            batch.sequence_number = decision.seq
        if decision.restarted:
            logger.warning("KV events rank %d: simulated publisher restart (seq back to 0)", dp_rank)
        if not decision.send_live:
            logger.warning("KV events rank %d: fault drops batch %d from live streams", dp_rank, decision.seq)
            return decision.seq
        filler = self._filler if dp_rank not in self._filled else b""
        for sub in list(self._subs):
            if dp_rank in sub.ranks:
                sub._offer(batch, filler)
                self._filled.add(dp_rank)
        return decision.seq

    # ---- subscriptions
    def subscribe(self, request: pb.SubscribeKvEventsRequest) -> KvSubscription:
        """Open a stream (synchronously: snapshot/replay and registration are atomic).

        Raises :class:`~sidecar.mock.kvevents.UnknownDpRank` (before acceptance: a
        non-OK status) for a rank this engine does not have.
        """
        ranks = list(dict.fromkeys(request.data_parallel_ranks)) or list(self.ranks)
        for r in ranks:
            self._state(r)
        sub = KvSubscription(self, ranks, self.max_queue_size)
        if self.faults.empty_response:
            sub._put(pb.SubscribeKvEventsResponse())
        start = request.start_sequence_number
        first: list[pb.KvEventBatch] = []
        for r in ranks:
            state = self._ranks[r]
            seqr = state.sequencer
            if request.include_snapshot:
                first.append(self._snapshot(r, state))
                continue
            oldest = seqr.buffer.oldest
            if start > 0 and (
                start > seqr.next_seq or (start < seqr.next_seq and (oldest is None or start < oldest))
            ):
                held = "nothing" if oldest is None else f"{oldest}..{seqr.next_seq - 1}"
                sub._put(
                    _error(
                        pb.ErrorCode.INVALID_ARGUMENT,
                        f"cannot resume rank {r} from sequence {start}: history holds {held}, "
                        f"next is {seqr.next_seq}; subscribe with include_snapshot",
                        retryable=False,
                    )
                )
                return sub
            skip = self.faults.replay_offset if start > 0 else 0
            first.extend(batch for _, batch in seqr.buffer.since(start + skip))
        for batch in first:
            sub._put(pb.SubscribeKvEventsResponse(batch=batch))
        if self.faults.event_after_error and request.include_snapshot:
            # not terminal to the queue (it is pre-encoded): the stream goes on after it
            error = _error(pb.ErrorCode.INTERNAL, "fault kv-event-after-error", retryable=True)
            sub._put(PreEncoded(bytes(error)))
            sub._put(pb.SubscribeKvEventsResponse(batch=first[-1]))
        self._subs.append(sub)
        return sub

    def _snapshot(self, rank: int, state: _RankState) -> pb.KvEventBatch:
        events: list[KvEventRecord] = [ClearedRecord()]
        if state.cache is not None:
            events.extend(state.cache.snapshot_events())
        return batch_to_pb(state.sequencer.next_seq, time.time_ns(), rank + self.faults.rank_offset, events)

    def _unregister(self, sub: KvSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    def close(self) -> None:
        """End every open stream (each ends cleanly after its queued batches)."""
        for sub in list(self._subs):
            sub.close()

    # ---- discovery
    def sources(self, ranks: Sequence[int] = ()) -> pb.GetKvEventSourcesResponse:
        """``GetKvEventSources``: one ``grpc`` / ``protobuf`` source per rank (the engine's own address)."""
        wanted = list(ranks) or self.ranks
        for r in wanted:
            self._state(r)
        return pb.GetKvEventSourcesResponse(
            sources=[
                pb.KvEventSource(
                    transport="grpc",
                    # The engine's own gRPC server; over a Unix socket there is no host:port to
                    # advertise, so the address is left out (clients use the connection they have).
                    endpoint_addr=pb.KvEndpoint(
                        host=self.advertise_host, port=self.advertise_port, protocol="grpc"
                    )
                    if self.advertise_port
                    else None,
                    data_parallel_rank=r,
                    encoding="protobuf",
                    buffer_steps=self.buffer_steps,
                    max_queue_size=self.max_queue_size,
                )
                for r in wanted
            ]
        )

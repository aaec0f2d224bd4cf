"""Watching an engine's KV events for the ``kv.*`` checks: native or ZMQ, plus ZMQ replay.

:func:`open_watcher` subscribes for the duration of an ``async with`` block and records
every batch (its sequence number, the rank it reports, the rank of the source it came
from, its events as decoded by the KV bridge's decoders), and as ``problems`` everything the
KV bridge would refuse: a response with no event, anything after a terminal ``EngineError``,
a message the client cannot take, a batch or ZMQ message that does not decode. Native
(``SubscribeKvEvents``) is used when the engine advertises a ``grpc`` source or none at
all; otherwise one ZMQ SUB per advertised ``zmq`` source.

A ZMQ subscriber joins asynchronously: :func:`open_watcher` waits (at most ``JOIN_WAIT``)
until each SUB socket completed its handshake with the publisher, so batches published
after the block started are not lost to a late join.

:func:`open_monitor` holds one watcher for a whole conformance run (opened before the first
check): ``kv.sequence`` judges contiguity over every batch from the first one the engine
published, wherever in the run a gap happened (:func:`kv_monitor`). The problems of every
watcher of a run are kept (:func:`kv_problems`).

Resources: the gRPC stream or the ZMQ context and its sockets, all closed (``linger=0``)
when the block ends; receiving runs in a nursery owned by the block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import betterproto2
import trio
import zmq

from sidecar.conformance.context import Context
from sidecar.conformance.model import Fail, Skip
from sidecar.kvbridge.decode_msgpack import MsgpackBatchDecoder
from sidecar.kvbridge.decode_proto import batch_from_proto
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import BlockStored, KvEvent
from sidecar.kvbridge.replay import parse_upstream_reply, seq_bytes
from sidecar.kvbridge.zmqio import recv_multipart
from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineClientError, EngineProtocolError, EngineStatusError

PROBE = 0.5
#: Longest wait for a ZMQ subscriber's handshake with its publisher.
JOIN_WAIT = 2.0

__all__ = [
    "KvWatcher",
    "SeenBatch",
    "kv_monitor",
    "kv_problems",
    "kv_sources",
    "kv_transport",
    "open_monitor",
    "open_watcher",
    "replay",
    "stored_runs",
    "watch_ranks",
]


@dataclass
class SeenBatch:
    seq: int
    reported_rank: int | None
    source_rank: int | None  # the rank subscribed to (native) or whose publisher sent it (ZMQ)
    events: list[KvEvent]

    @property
    def rank(self) -> int | None:
        """The rank this batch belongs to: its source's (ZMQ), else the one it reports."""
        return self.source_rank if self.source_rank is not None else self.reported_rank


@dataclass
class KvWatcher:
    transport: str
    batches: list[SeenBatch] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    ended: str = ""  # why a native stream ended ("" = all still open)
    _changed: trio.Event = field(default_factory=trio.Event)

    def _add(self, batch: SeenBatch) -> None:
        self.batches.append(batch)
        self._changed.set()
        self._changed = trio.Event()

    def _end(self, why: str) -> None:
        self.ended = why
        self._changed.set()
        self._changed = trio.Event()

    def by_rank(self, rank: int) -> list[SeenBatch]:
        return [b for b in self.batches if b.rank == rank]

    async def wait(self, pred: Callable[[KvWatcher], bool], timeout: float) -> bool:
        """Wait until ``pred(self)`` holds (False after ``timeout`` or when the stream ended)."""
        with trio.move_on_after(timeout):
            while not pred(self):
                if self.ended:
                    return pred(self)
                await self._changed.wait()
            return True
        return False


async def kv_sources(ctx: Context) -> list[pb.KvEventSource]:
    """``GetKvEventSources`` (cached; UNIMPLEMENTED → none)."""
    cached = ctx.cache.get("kv_sources")
    if cached is None:
        try:
            cached = list((await ctx.client().get_kv_event_sources()).sources)
        except EngineStatusError as err:
            if err.status != "UNIMPLEMENTED":
                raise Fail(f"GetKvEventSources answered {err.status}: {err.message}") from None
            cached = []
        ctx.cache["kv_sources"] = cached
    return list(cached)


def _zmq_sources(sources: Sequence[pb.KvEventSource]) -> list[pb.KvEventSource] | None:
    """The ZMQ sources to use, or None when the native stream should be used."""
    zmq_sources = [s for s in sources if s.transport == "zmq"]
    if any(s.transport == "grpc" for s in sources) or not zmq_sources:
        return None
    return zmq_sources


async def kv_transport(ctx: Context) -> str:
    """``zmq`` when the engine advertises ZMQ sources and no gRPC one, else ``grpc`` (native)."""
    return "grpc" if _zmq_sources(await kv_sources(ctx)) is None else "zmq"


async def watch_ranks(ctx: Context) -> list[int]:
    """The DP ranks a watcher can see: the advertised ZMQ sources' ranks, else the server's ranks."""
    zmq_sources = _zmq_sources(await kv_sources(ctx))
    if zmq_sources is None:
        return await ctx.dp_ranks()
    first = (await ctx.dp_ranks())[0]
    return sorted({first if s.data_parallel_rank is None else s.data_parallel_rank for s in zmq_sources})


def _endpoint(s: pb.KvEventSource) -> str:
    assert s.endpoint_addr is not None
    host = s.endpoint_addr.host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{s.endpoint_addr.port}"


async def _native(
    ctx: Context,
    watcher: KvWatcher,
    request: pb.SubscribeKvEventsRequest,
    rank: int,
    task_status: trio.TaskStatus[None],
) -> None:
    task_status.started()
    terminal = ""
    try:
        async with ctx.client().subscribe_kv_events(request, checked=False) as stream:
            async for resp in stream:
                name, value = betterproto2.which_one_of(resp, "event")
                if terminal:  # read on: nothing may follow the terminal EngineError
                    watcher.problems.append(
                        f"rank {rank}: a {name or 'response with no event'} after {terminal}"
                    )
                elif name == "batch" and isinstance(value, pb.KvEventBatch):
                    watcher._add(
                        SeenBatch(
                            value.sequence_number,
                            value.data_parallel_rank,
                            rank,
                            _events(watcher, rank, value),
                        )
                    )
                elif name == "error" and isinstance(value, pb.EngineError):
                    terminal = f"terminal EngineError {pb.ErrorCode(value.code).name}: {value.message}"
                    watcher._end(terminal)
                else:
                    watcher.problems.append(f"rank {rank}: a SubscribeKvEventsResponse with no event")
        watcher._end(terminal or "closed OK")
    except EngineStatusError as err:
        watcher._end(f"status {err.status}")
    except EngineProtocolError as err:
        watcher.problems.append(f"rank {rank}: a message the client cannot take: {err}")
        watcher._end(f"unreadable message: {err}")
    except EngineClientError as err:
        watcher._end(f"transport: {err}")


def _events(watcher: KvWatcher, rank: int, batch: pb.KvEventBatch) -> list[KvEvent]:
    """The batch's events as the KV bridge decodes them (none, and a problem, if it cannot)."""
    try:
        return batch_from_proto(batch).events
    except KvDecodeError as err:
        watcher.problems.append(f"rank {rank}: batch {batch.sequence_number} does not decode ({err})")
        return []


async def _zmq_one(sock: zmq.Socket, rank: int, watcher: KvWatcher, decoder: MsgpackBatchDecoder) -> None:
    while True:
        frames = await recv_multipart(sock)
        if len(frames) != 3 or len(frames[1]) != 8:
            watcher.problems.append(
                f"rank {rank}: a message of {len(frames)} frame(s), not topic, 8-byte sequence number, payload"
            )
            continue
        try:
            batch = decoder.decode(frames[2])
        except KvDecodeError as err:
            watcher.problems.append(f"rank {rank}: undecodable payload ({err})")
            continue
        seq = int.from_bytes(frames[1], "big")
        watcher._add(SeenBatch(seq, batch.data_parallel_rank, rank, batch.events))


@asynccontextmanager
async def open_watcher(
    ctx: Context,
    *,
    ranks: Sequence[int] = (),
    start: int = 0,
    snapshot: bool = False,
) -> AsyncIterator[KvWatcher]:
    """Subscribe to the engine's KV events for the block (see the module doc).

    ``ranks``: the DP ranks to watch (empty = all). Native: one ``SubscribeKvEvents`` per
    rank (so each batch's source rank is known), with ``start`` and ``snapshot`` in the
    request. Skips when the engine offers neither a native stream nor ZMQ sources.
    """
    sources = await kv_sources(ctx)
    zmq_sources = _zmq_sources(sources)
    if zmq_sources is None:
        watcher = KvWatcher("grpc")
        ctx.cache.setdefault("kv_watchers", []).append(watcher)
        async with open_background_nursery() as nursery:
            for rank in ranks or await ctx.dp_ranks():
                request = pb.SubscribeKvEventsRequest(
                    data_parallel_ranks=[rank], include_snapshot=snapshot, start_sequence_number=start
                )
                await nursery.start(_native, ctx, watcher, request, rank)
            if not sources:  # nothing advertised: is the native stream there at all?
                await watcher.wait(lambda w: bool(w.ended), PROBE)
            if watcher.ended.startswith("status UNIMPLEMENTED") and not watcher.batches:
                raise Skip("the engine offers no KV events (SubscribeKvEvents UNIMPLEMENTED, no ZMQ sources)")
            try:
                yield watcher
            finally:
                nursery.cancel_scope.cancel()
        return
    watcher = KvWatcher("zmq")
    ctx.cache.setdefault("kv_watchers", []).append(watcher)
    zctx = zmq.Context()
    socks: list[zmq.Socket] = []
    monitors: list[zmq.Socket] = []
    try:
        async with open_background_nursery() as nursery:
            first = (await ctx.dp_ranks())[0]
            for s in zmq_sources:
                rank = first if s.data_parallel_rank is None else s.data_parallel_rank
                if ranks and rank not in ranks:
                    continue
                sock = zctx.socket(zmq.SUB)
                socks.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
                monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
                sock.connect(_endpoint(s))
                nursery.start_soon(_zmq_one, sock, rank, watcher, MsgpackBatchDecoder())
            with trio.move_on_after(JOIN_WAIT):
                for monitor in monitors:
                    await recv_multipart(monitor)  # the only event asked for: handshake done
            for sock in socks:
                sock.disable_monitor()
            try:
                yield watcher
            finally:
                nursery.cancel_scope.cancel()
    finally:
        for sock in [*monitors, *socks]:
            sock.close(linger=0)
        zctx.term()


@asynccontextmanager
async def open_monitor(ctx: Context) -> AsyncIterator[None]:
    """Watch every rank of the engine for the block (a conformance run); :func:`kv_monitor`
    returns the watcher, or re-raises why there is none (``Skip`` / ``Fail``)."""
    entered = False
    try:
        async with open_watcher(ctx) as watcher:
            entered = True
            ctx.cache["kv_monitor"] = watcher
            yield
    except (Skip, Fail, EngineClientError) as err:
        if entered:
            raise
        ctx.cache["kv_monitor"] = err if not isinstance(err, EngineClientError) else Fail(f"KV events: {err}")
    if not entered:
        yield


def kv_monitor(ctx: Context) -> KvWatcher | None:
    """The run-wide watcher (``None`` when no run opened one, e.g. a check run on its own)."""
    cached = ctx.cache.get("kv_monitor")
    if isinstance(cached, Exception):
        raise cached
    return cached  # type: ignore[no-any-return]


def kv_problems(ctx: Context) -> list[str]:
    """What every watcher of the run found the KV bridge would refuse (see the module doc)."""
    watchers: list[KvWatcher] = ctx.cache.get("kv_watchers", [])
    return [p for w in watchers for p in w.problems]


async def replay(source: pb.KvEventSource, start: int, timeout: float = 3.0) -> tuple[list[int], str]:
    """Ask a ZMQ source's replay endpoint for everything from ``start``: (sequence numbers, problem)."""
    zctx = zmq.Context()
    dealer = zctx.socket(zmq.DEALER)
    seqs: list[int] = []
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(source.replay_endpoint)
        dealer.send_multipart([b"", seq_bytes(start)], zmq.NOBLOCK)
        with trio.move_on_after(timeout):
            while True:
                reply = parse_upstream_reply(await recv_multipart(dealer))
                if reply is None:
                    return seqs, ""
                seqs.append(reply[0])
        return seqs, f"no end marker within {timeout:g} s"
    except (zmq.ZMQError, KvDecodeError) as err:
        return seqs, f"replay failed: {err}"
    finally:
        dealer.close(linger=0)
        zctx.term()


def stored_runs(batch: SeenBatch) -> list[list[int]]:
    """The ``token_ids`` of each BlockStored event of ``batch``."""
    return [list(e.token_ids) for e in batch.events if isinstance(e, BlockStored)]

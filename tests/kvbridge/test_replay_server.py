"""The bridge's replay ROUTER against peers that ask and never read, on real ZMQ sockets:
nobody is waited on, slow replays are dropped, slots are capped, memory per peer is bounded
(docs/SECURITY.md "KV bridge")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio
import zmq

from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.replay import END_SEQ, ReplayBuffer
from sidecar.kvbridge.replay_server import ReplayLimits, serve_replay
from tests.kvbridge.fake_zmq_engine import zrecv
from tests.kvbridge.helpers import Metrics
from tests.polling import eventually

RANK = 7  # a rank of its own: metric deltas unaffected by other tests


def payload(seq: int, size: int) -> bytes:
    return seq.to_bytes(8, "big") * (size // 8)


@asynccontextmanager
async def router(
    limits: ReplayLimits, *, steps: int = 200, size: int = 1024
) -> AsyncIterator[tuple[str, ReplayBuffer, zmq.Context]]:
    buffer = ReplayBuffer(steps)
    for seq in range(steps):
        buffer.append(seq, payload(seq, size))
    ctx = zmq.Context()
    try:
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(
                partial(serve_replay, limits=limits),
                ctx,
                "tcp://127.0.0.1:0",
                buffer,
                b"t",
                RankMetrics(RANK),
            )
            yield endpoint, buffer, ctx
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


def stuck_peer(ctx: zmq.Context, endpoint: str, start: int = 0) -> zmq.Socket:
    """A DEALER that asks for a replay and never reads (its receive path fills at once)."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVHWM, 1)
    d.setsockopt(zmq.RCVBUF, 4096)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    return d


async def read_replay(ctx: zmq.Context, endpoint: str, start: int = 0) -> list[int]:
    """A well-behaved consumer: the seqs of one replay, in order, until the end marker."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while (frames := await zrecv(d))[2] != END_SEQ:
            assert frames[1] == b"t" and len(frames) == 4
            seqs.append(int.from_bytes(frames[2], "big"))
            assert frames[3] == payload(seqs[-1], len(frames[3]))
        return seqs
    finally:
        d.close(linger=0)


def active() -> float:
    return RankMetrics(RANK).replays_active._value.get()


async def test_a_whole_buffer_flows_through_a_small_pipe() -> None:
    with trio.fail_after(20):
        async with router(ReplayLimits(hwm=4), steps=3000, size=256) as (ep, _, ctx):
            assert await read_replay(ctx, ep) == list(range(3000))
            assert await read_replay(ctx, ep, 2990) == list(range(2990, 3000))
            assert await read_replay(ctx, ep, 5000) == []


async def test_peers_that_never_read_are_dropped_and_never_delay_a_reader() -> None:
    m = Metrics(RANK)
    limits = ReplayLimits(hwm=16, max_active=16, stall_timeout=0.5)
    with trio.fail_after(30):
        async with router(limits, steps=200, size=64 * 1024) as (ep, _, ctx):
            stuck = [stuck_peer(ctx, ep) for _ in range(10)]
            await eventually(lambda: m.delta("replay_requests_served") == 10)
            start = trio.current_time()
            assert await read_replay(ctx, ep) == list(range(200))  # served alongside them
            assert trio.current_time() - start < 3
            await eventually(lambda: m.delta("replay_requests_dropped", reason="slow") == 10)
            assert active() == 0
            for d in stuck:
                d.close(linger=0)


async def test_slots_are_capped_the_queue_too_and_a_stalled_replay_gives_way() -> None:
    m = Metrics(RANK)
    with trio.fail_after(30):
        # one slot, one place in the queue; a long stall timeout: nothing is evictable for 2 s
        limits = ReplayLimits(hwm=4, max_active=1, stall_timeout=20)
        async with router(limits, size=64 * 1024) as (ep, _, ctx):
            peers = [stuck_peer(ctx, ep)]
            await eventually(lambda: active() == 1)
            peers += [stuck_peer(ctx, ep), stuck_peer(ctx, ep)]  # one waits, one is refused
            await eventually(lambda: m.delta("replay_requests_dropped", reason="busy") == 1)
            assert m.delta("replay_requests_served") == 1
            for d in peers:
                d.close(linger=0)
        # a waiting reader takes the slot of a replay stalled for stall_timeout / 10
        limits = ReplayLimits(hwm=4, max_active=1, stall_timeout=0.5)
        async with router(limits, size=64 * 1024) as (ep, _, ctx):
            first = stuck_peer(ctx, ep)
            await eventually(lambda: active() == 1)
            start = trio.current_time()
            assert await read_replay(ctx, ep) == list(range(200))
            assert trio.current_time() - start < 2
            assert m.delta("replay_requests_dropped", reason="evicted") == 1
            first.close(linger=0)


async def test_a_new_request_supersedes_the_peers_old_one() -> None:
    m = Metrics(RANK)
    with trio.fail_after(20):
        async with router(ReplayLimits(hwm=2), steps=50, size=64 * 1024) as (ep, _, ctx):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 4096)
            d.connect(ep)
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            await eventually(lambda: active() == 1)
            d.send_multipart([b"", (45).to_bytes(8, "big")])
            await eventually(lambda: m.delta("replay_requests_dropped", reason="superseded") == 1)
            seqs = []
            while (frames := await zrecv(d))[2] != END_SEQ:
                seqs.append(int.from_bytes(frames[2], "big"))
            # what the first replay had queued, then the whole second one, one end marker
            assert seqs[-5:] == [45, 46, 47, 48, 49] and seqs[: len(seqs) - 5] == list(range(len(seqs) - 5))
            assert active() == 0
            d.close(linger=0)


async def test_a_replay_overtaken_by_the_publisher_ends_early_without_holes() -> None:
    with trio.fail_after(20):
        async with router(ReplayLimits(hwm=2), steps=20, size=64 * 1024) as (ep, buffer, ctx):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.setsockopt(zmq.RCVBUF, 4096)
            d.connect(ep)
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            first = await zrecv(d)
            for seq in range(20, 60):  # the publisher moves on: 0..39 are overwritten
                buffer.append(seq, payload(seq, 64 * 1024))
            seqs = [int.from_bytes(first[2], "big")]
            while (frames := await zrecv(d))[2] != END_SEQ:
                seqs.append(int.from_bytes(frames[2], "big"))
            assert seqs == list(range(len(seqs))) and len(seqs) < 20, seqs
            d.close(linger=0)


async def test_oversized_and_malformed_requests() -> None:
    m = Metrics(RANK)
    with trio.fail_after(20):
        async with router(ReplayLimits(), steps=5) as (ep, _, ctx):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(ep)
            d.send_multipart([b"", b"bad"])
            assert await zrecv(d) == [b"", b"", END_SEQ, b""]
            assert m.delta("replay_requests_dropped", reason="malformed") == 1
            d.send_multipart([b"", b"x" * 100_000])  # over the request size: that peer is cut off
            d.close(linger=0)
            assert await read_replay(ctx, ep) == list(range(5))

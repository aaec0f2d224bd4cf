"""SubscribeKvEvents source of the trtllm mock: protobuf batches, snapshot, resume, faults (unit level)."""

from __future__ import annotations

from typing import Any

import betterproto2
import pytest
import trio
import trio_asyncio

from sidecar.mock.kvcache import KvCache, KvGroundTruth, StoredRecord
from sidecar.mock.kvevents import UnknownDpRank, kv_event_sources
from sidecar.mock.kvevents_grpc import GrpcKvEvents, KvSubscription
from sidecar.mock.kvevents_wire import KvFaults
from sidecar.openengine import pb


async def nxt(sub: KvSubscription) -> pb.SubscribeKvEventsResponse:
    resp = await trio_asyncio.aio_as_trio(sub.__anext__)()
    return pb.SubscribeKvEventsResponse.parse(bytes(resp))  # what a gRPC client would see


async def batches(sub: KvSubscription, n: int) -> list[pb.KvEventBatch]:
    out = []
    for _ in range(n):
        resp = await nxt(sub)
        assert resp.batch is not None, resp
        out.append(resp.batch)
    return out


async def ended(sub: KvSubscription) -> bool:
    with pytest.raises(StopAsyncIteration):
        await trio_asyncio.aio_as_trio(sub.__anext__)()
    return True


def unsigned(h: pb.KvBlockHash) -> int:
    assert h.encoding == "int64" and len(h.value) == 8
    return int.from_bytes(h.value, "big")


def decoded(batch: pb.KvEventBatch) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for ev in batch.events:
        kind = betterproto2.which_one_of(ev, "event")[0]
        if kind == "block_stored":
            s = ev.block_stored
            assert s is not None
            parent = unsigned(s.parent_block_hash) if s.parent_block_hash is not None else None
            out.append((kind, ([unsigned(h) for h in s.block_hashes], parent, list(s.token_ids), s.lora_id)))
        elif kind == "block_removed":
            assert ev.block_removed is not None
            out.append((kind, [unsigned(h) for h in ev.block_removed.block_hashes]))
        else:
            out.append((kind, None))
    return out


def truth(ev: Any) -> tuple[str, Any]:
    if isinstance(ev, StoredRecord):
        return "block_stored", (
            list(ev.block_hashes),
            ev.parent_block_hash,
            list(ev.token_ids),
            ev.lora_id or 0,
        )
    if hasattr(ev, "block_hashes"):
        return "block_removed", list(ev.block_hashes)
    return "all_blocks_cleared", None


def setup(ranks: int = 1, **kw: Any) -> tuple[GrpcKvEvents, list[KvCache], KvGroundTruth]:
    gt = KvGroundTruth()
    source = GrpcKvEvents(ranks, advertise_host="10.0.0.5", advertise_port=7000, **kw)
    caches = [KvCache(r, 4, 12, source, ground_truth=gt) for r in range(ranks)]
    for c in caches:
        source.attach_cache(c)
    return source, caches, gt


async def test_live_batches_match_ground_truth(aio_loop: Any) -> None:
    source, [cache], gt = setup()
    with trio.fail_after(5):
        async with trio_asyncio.aio_as_trio(source.subscribe(pb.SubscribeKvEventsRequest())) as sub:
            a = cache.allocate(list(range(30)), lora_id=9)
            cache.release(a)
            cache.allocate(list(range(100, 130)))  # evicts
            cache.clear()
            got = await batches(sub, len(gt.batches(0)))
            assert [b.sequence_number for b in got] == [0, 1, 2]
            assert all(b.data_parallel_rank == 0 and b.timestamp_unix_nanos > 0 for b in got)
            assert [decoded(b) for b in got] == [[truth(e) for e in evs] for _, evs in gt.batches(0)]
            hashes = [h for b in got for kind, v in decoded(b) if kind == "block_stored" for h in v[0]]
            assert any(h >= 2**63 for h in hashes)  # unsigned range survives the int64 encoding
        assert source.subscribers == 0


async def test_large_batch_fault_fills_the_first_live_batch_only(aio_loop: Any) -> None:
    """``kv-large-batch``: the first batch sent live carries the filler inside its own bytes
    (its number, rank and events kept); later ones and replays do not."""
    source, [cache], gt = setup(faults=KvFaults(large_batch=100_000))
    with trio.fail_after(10):
        async with trio_asyncio.aio_as_trio(source.subscribe(pb.SubscribeKvEventsRequest())) as sub:
            cache.allocate(list(range(8)))
            cache.allocate(list(range(100, 108)))
            raw = await trio_asyncio.aio_as_trio(sub.__anext__)()
            assert 90_000 < len(bytes(raw)) < 110_000  # about the size asked
            first, second = pb.SubscribeKvEventsResponse.parse(bytes(raw)).batch, (await batches(sub, 1))[0]
            assert first is not None and (first.sequence_number, second.sequence_number) == (0, 1)
            (_, truth0), (_, truth1) = gt.batches(0)
            assert decoded(first)[: len(truth0)] == [truth(e) for e in truth0]
            [(kind, (filler, *_))] = decoded(first)[len(truth0) :]
            assert kind == "block_stored" and len(filler) > 1_000
            assert decoded(second) == [truth(e) for e in truth1]
        replay = source.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=0))
        assert decoded((await batches(replay, 1))[0]) == [truth(e) for e in truth0]
        replay.close()


async def test_snapshot_then_live(aio_loop: Any) -> None:
    source, [cache], _ = setup()
    with trio.fail_after(5):
        cache.allocate(list(range(8)))
        cache.allocate([0, 1, 2, 3, 5, 5, 5, 5, 5])
        sub = source.subscribe(pb.SubscribeKvEventsRequest(include_snapshot=True, start_sequence_number=1))
        [snap] = await batches(sub, 1)
        assert snap.sequence_number == 2  # the first live batch not folded into it
        kinds = decoded(snap)
        assert kinds[0] == ("all_blocks_cleared", None)
        stored = [v for k, v in kinds[1:] if k == "block_stored"]
        assert {h for hs, *_ in stored for h in hs} == set(cache.cached_hashes())
        seen: set[int | None] = {None}
        for hs, parent, tokens, _ in stored:  # parents first, tokens kept
            assert parent in seen and len(tokens) == 4
            seen.update(hs)
        cache.allocate([42] * 4)
        [live] = await batches(sub, 1)
        assert live.sequence_number == 2
        sub.close()
        assert await ended(sub)


async def test_resume_from_history_and_refusal(aio_loop: Any) -> None:
    source, [cache], _ = setup(buffer_steps=3)
    with trio.fail_after(5):
        for i in range(5):
            cache.allocate([i] * 4)  # batches 0..4, history holds 2..4
        sub = source.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=3))
        assert [b.sequence_number for b in await batches(sub, 2)] == [3, 4]
        cache.allocate([9] * 4)
        assert [b.sequence_number for b in await batches(sub, 1)] == [5]
        sub.close()
        # start == next: nothing replayed, live follows
        sub = source.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=6))
        cache.allocate([10] * 4)
        assert [b.sequence_number for b in await batches(sub, 1)] == [6]
        sub.close()
        # too old, or from the future (e.g. after a restart): one terminal error, then the end
        for start in (1, 99):
            sub = source.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=start))
            resp = await nxt(sub)
            assert resp.error is not None and resp.batch is None
            assert resp.error.code == pb.ErrorCode.INVALID_ARGUMENT and not resp.error.retryable
            assert resp.error.message.startswith("cannot resume")
            assert await ended(sub)
        # start 0: whatever is held, never refused
        sub = source.subscribe(pb.SubscribeKvEventsRequest())
        assert [b.sequence_number for b in await batches(sub, 3)] == [4, 5, 6]
        sub.close()
        assert source.subscribers == 0


async def test_rank_filter_sources_and_unknown_rank(aio_loop: Any) -> None:
    source, caches, _ = setup(ranks=2)
    with trio.fail_after(5):
        sub = source.subscribe(pb.SubscribeKvEventsRequest(data_parallel_ranks=[1]))
        caches[0].allocate([1] * 4)
        caches[1].allocate([2] * 4)
        caches[1].allocate([3] * 4)
        got = await batches(sub, 2)
        assert [(b.data_parallel_rank, b.sequence_number) for b in got] == [(1, 0), (1, 1)]
        sub.close()
        with pytest.raises(UnknownDpRank):
            source.subscribe(pb.SubscribeKvEventsRequest(data_parallel_ranks=[2]))
    srcs = kv_event_sources(source).sources
    assert [s.data_parallel_rank for s in srcs] == [0, 1]
    for s in srcs:
        assert s.transport == "grpc" and s.encoding == "protobuf" and s.replay_endpoint == ""
        assert s.endpoint_addr.host == "10.0.0.5" and s.endpoint_addr.port == 7000
    assert [s.data_parallel_rank for s in source.sources([1]).sources] == [1]
    assert kv_event_sources(None).sources == []


@pytest.mark.parametrize("fault", ["gap", "lost", "restart"])
async def test_faults(aio_loop: Any, fault: str) -> None:
    faults = {
        "gap": KvFaults(gap_at=1),
        "lost": KvFaults(history_lost_at=1),
        "restart": KvFaults(restart_at=2),
    }[fault]
    source, [cache], _ = setup(faults=faults)
    with trio.fail_after(5):
        sub = source.subscribe(pb.SubscribeKvEventsRequest())
        for i in range(4):
            cache.allocate([i] * 4)
        if fault == "restart":
            assert [b.sequence_number for b in await batches(sub, 4)] == [0, 1, 0, 1]
            return
        assert [b.sequence_number for b in await batches(sub, 3)] == [0, 2, 3]  # 1 is missing live
        resumed = source.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=1))
        resp = await nxt(resumed)
        if fault == "gap":
            assert resp.batch is not None and resp.batch.sequence_number == 1  # recoverable
        else:
            assert resp.error is not None and resp.error.message.startswith("cannot resume")


async def test_slow_subscriber_gets_overloaded_error_and_close_ends_streams(aio_loop: Any) -> None:
    source, [cache], _ = setup(max_queue_size=2)
    with trio.fail_after(5):
        slow = source.subscribe(pb.SubscribeKvEventsRequest())
        for i in range(3):
            cache.allocate([i] * 4)
        assert source.subscribers == 0  # the slow one was dropped at once
        other = source.subscribe(pb.SubscribeKvEventsRequest(start_sequence_number=3))
        assert [b.sequence_number for b in await batches(slow, 2)] == [0, 1]
        resp = await nxt(slow)
        assert resp.error is not None and resp.error.code == pb.ErrorCode.OVERLOADED and resp.error.retryable
        assert await ended(slow)
        assert source.subscribers == 1
        cache.allocate([7] * 4)
        assert [b.sequence_number for b in await batches(other, 1)] == [3]
        source.close()
        assert await ended(other)
        assert source.subscribers == 0

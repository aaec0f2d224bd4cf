"""The bridge over SubscribeKvEvents (a fake trio-native client), checked by the independent consumer."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from sidecar.kvbridge import GrpcSource
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineStatusError, EngineUnavailable
from tests.fake_engine import FakeEngine, apply
from tests.kvbridge import gen
from tests.kvbridge.consumer import Consumer
from tests.kvbridge.helpers import CLEARED, Metrics, flat, start_bridge


def batches(seed: int, n: int, size: int = 4, **kw: Any) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    return [gen.batch(rng, size, proto=True, **kw) for _ in range(n)]


def view(events: list[dict[str, Any]]) -> dict[Any, Any]:
    cache: dict[Any, Any] = {}
    apply(cache, events)
    return cache


async def test_stream_relayed_exactly_and_resumed_after_end_and_error() -> None:
    bs = batches(1, 30, hash_kind="int") + batches(2, 10, hash_kind="bytes")
    eng = FakeEngine()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics()
            info = await start_bridge(n, [GrpcSource(0)], client=eng)
            await eng.kv_subscribed.wait()
            assert info.ranks[0].source == "grpc"
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in bs[:10]:
                    eng.publish(b)
                await c.collect_events(len(flat(bs[:10])))
                eng.end_streams()  # the engine closes the stream OK
                for b in bs[10:20]:
                    eng.publish(b)
                await c.collect_events(len(flat(bs[:20])))
                eng.end_streams(EngineUnavailable("connection lost"))
                eng.kv_fail_next.append(EngineUnavailable("still down"))
                for b in bs[20:]:
                    eng.publish(b)
                assert await c.collect_events(len(flat(bs))) == flat(bs)
            starts = [(r.start_sequence_number, r.include_snapshot) for r in eng.kv_requests]
            assert starts[0] == (0, False) and starts[-1] == (20, False) and (10, False) in starts
            assert m.delta("replays", outcome="ok") == 2
            assert m.delta("resyncs", reason="history_lost") == m.delta("resyncs", reason="restart") == 0
            n.cancel_scope.cancel()


async def test_in_stream_gap_resubscribes_from_the_missing_number() -> None:
    bs = batches(3, 12)
    eng = FakeEngine()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics()
            info = await start_bridge(n, [GrpcSource(0)], client=eng)
            await eng.kv_subscribed.wait()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(bs):
                    eng.publish(b, deliver=i not in (4, 5))
                assert await c.collect_events(len(flat(bs))) == flat(bs)
            assert (4, False) in [(r.start_sequence_number, r.include_snapshot) for r in eng.kv_requests]
            assert m.delta("gaps") == 1
            n.cancel_scope.cancel()


@pytest.mark.parametrize("snapshot_style", ["last", "next"])
async def test_cannot_resume_takes_a_snapshot_after_clearing(snapshot_style: str) -> None:
    bs = batches(4, 20, clears=False)
    eng = FakeEngine(buffer_steps=3, snapshot_style=snapshot_style)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics()
            info = await start_bridge(n, [GrpcSource(0)], client=eng)
            await eng.kv_subscribed.wait()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in bs[:5]:
                    eng.publish(b)
                await c.collect_events(len(flat(bs[:5])))
                eng.kv_gate = trio.Event()
                eng.end_streams()
                for b in bs[5:15]:  # the engine keeps only 12..14: resuming from 5 is impossible
                    eng.publish(b)
                eng.kv_gate.set()
                got = await c.collect(lambda rs: any(r.events == [CLEARED] for r in rs) and len(rs) > 6)
                assert flat(r.events for r in got[:5]) == flat(bs[:5])
                assert got[5].events == [CLEARED]
                for b in bs[15:]:
                    eng.publish(b)
                await c.collect(lambda rs: len(rs) >= 7 + 5)
                assert view(flat(r.events for r in c.received)) == eng.cache
            assert [r.include_snapshot for r in eng.kv_requests][-1] is True
            assert m.delta("resyncs", reason="history_lost") == 1
            n.cancel_scope.cancel()


async def test_engine_restart_detected_and_resynced() -> None:
    bs = batches(5, 12, clears=False)
    eng = FakeEngine()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics()
            info = await start_bridge(n, [GrpcSource(0)], client=eng)
            await eng.kv_subscribed.wait()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in bs[:6]:
                    eng.publish(b)
                await c.collect_events(len(flat(bs[:6])))
                eng.kv_gate = trio.Event()
                eng.restart()  # streams fail; the new engine numbers from 0 with an empty cache
                for b in bs[6:9]:
                    eng.publish(b)
                eng.kv_gate.set()
                await eng_subscription_count(eng, 2)  # resumed from 6: the new engine has nothing there
                eng.publish(bs[9])  # its seq 3 < 6: a restart -> snapshot
                await c.collect(lambda rs: len(rs) >= 6 + 1 + 1)  # old batches, AllBlocksCleared, snapshot
                assert c.received[6].events == [CLEARED]
                for b in bs[10:]:
                    eng.publish(b)
                await c.collect(lambda rs: len(rs) >= 8 + 2)
                assert view(flat(r.events for r in c.received)) == eng.cache
            assert m.delta("resyncs", reason="restart") == 1
            n.cancel_scope.cancel()


async def test_refused_resume_then_refused_snapshot_falls_back_to_live() -> None:
    bs = batches(6, 10, clears=False)
    eng = FakeEngine(buffer_steps=2, resume_error=True, snapshots=False)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics()
            info = await start_bridge(n, [GrpcSource(0)], client=eng)
            await eng.kv_subscribed.wait()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in bs[:3]:
                    eng.publish(b)
                await c.collect_events(len(flat(bs[:3])))
                eng.kv_gate = trio.Event()
                eng.end_streams()
                for b in bs[3:8]:
                    eng.publish(b)
                eng.kv_gate.set()
                await eng_subscription_count(eng, 4)  # resume refused, snapshot refused, live
                for b in bs[8:]:
                    eng.publish(b)
                # the live subscription starts at the engine's oldest held batch (6)
                got = await c.collect(lambda rs: len(rs) >= 3 + 1 + 4)
                assert got[3].events == [CLEARED]
                assert flat(r.events for r in got[4:]) == flat(bs[6:])
            kinds = [(r.start_sequence_number, r.include_snapshot) for r in eng.kv_requests]
            assert kinds[:4] == [(0, False), (3, False), (0, True), (0, False)]
            assert m.delta("replays", outcome="failed") == 1
            n.cancel_scope.cancel()


async def eng_subscription_count(eng: FakeEngine, count: int) -> None:
    while len(eng.kv_streams) == 0 or len(eng.kv_requests) < count:
        eng.kv_subscribed = trio.Event()
        await eng.kv_subscribed.wait()


async def test_undecodable_batch_resyncs_and_discovery_through_the_client() -> None:
    bs = batches(7, 4, clears=False)
    source = pb.KvEventSource(transport="grpc", data_parallel_rank=2, encoding="protobuf")
    eng = FakeEngine(rank=2, sources=[source])
    bad = pb.KvEventBatch(events=[pb.KvEvent(request_id="no event")])
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics(rank=2)
            info = await start_bridge(n, None, client=eng)  # sources from GetKvEventSources
            assert [(r.rank, r.source) for r in info.ranks] == [(2, "grpc")]
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(bs):
                    eng.publish(b if i != 2 else [], raw=bad if i == 2 else None)
                expected = [*flat(bs[:2]), CLEARED, *flat(bs[3:])]
                assert await c.collect_events(len(expected)) == expected
                assert {r.rank for r in c.received} == {2}
            assert m.delta("decode_errors") == 1 and m.delta("resyncs", reason="decode_error") == 1
            n.cancel_scope.cancel()


async def test_status_error_at_subscribe_is_retried() -> None:
    bs = batches(8, 3)
    eng = FakeEngine()
    eng.kv_fail_next += [EngineStatusError("UNAVAILABLE", 14, "starting", None), EngineUnavailable("down")]
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            info = await start_bridge(n, [GrpcSource(0)], client=eng)
            await eng.kv_subscribed.wait()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in bs:
                    eng.publish(b)
                assert await c.collect_events(len(flat(bs))) == flat(bs)
            assert [r.start_sequence_number for r in eng.kv_requests] == [0, 0, 0]
            n.cancel_scope.cancel()


async def test_discovery_retries_then_fails_typed() -> None:
    from sidecar.kvbridge import KvBridgeConfig, KvSourceError, discover_sources

    class Flaky:
        def __init__(self, errors: list[Exception], hang: bool = False) -> None:
            self.errors, self.hang, self.calls = errors, hang, 0

        async def get_kv_event_sources(
            self, request: pb.GetKvEventSourcesRequest
        ) -> pb.GetKvEventSourcesResponse:
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            if self.hang:
                await trio.sleep_forever()
            return pb.GetKvEventSourcesResponse(
                sources=[pb.KvEventSource(transport="grpc", encoding="protobuf")]
            )

    config = KvBridgeConfig(backoff_initial=0.001, backoff_max=0.002, discovery_timeout=0.5, dp_ranks=(0, 1))
    with trio.fail_after(5):
        flaky = Flaky([EngineUnavailable("down"), EngineUnavailable("down")])
        assert await discover_sources(flaky, config) == [GrpcSource(0), GrpcSource(1)]
        assert flaky.calls == 3
        with pytest.raises(EngineStatusError):
            await discover_sources(Flaky([EngineStatusError("UNIMPLEMENTED", 12, "", None)]), config)
        with pytest.raises(KvSourceError, match="did not answer"):
            await discover_sources(Flaky([], hang=True), config)

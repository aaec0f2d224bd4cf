"""The bridge end to end over real ZMQ sockets: fake engine publishers in, independent consumer out."""

from __future__ import annotations

import random
from functools import partial

import msgspec
import pytest
import trio
import zmq

from sidecar.kvbridge import GrpcSource, KvConfigError, ZmqSource, run_kv_bridge
from sidecar.kvbridge.service import KvBridgeConfig
from tests.kvbridge import gen
from tests.kvbridge.consumer import Consumer, decode_payload
from tests.kvbridge.fake_zmq_engine import END, FakeZmqEngine, zrecv
from tests.kvbridge.helpers import Metrics, start_bridge


def source(eng: FakeZmqEngine, rank: int = 0) -> ZmqSource:
    return ZmqSource(rank, eng.endpoint, eng.topic.decode(), eng.replay_endpoint)


@pytest.mark.parametrize(
    ("style", "hash_kind", "negative"),
    [
        ("vllm-map", "int", False),
        ("vllm-map", "bytes", False),
        ("vllm-array", "int", True),
        ("vllm-array", "bytes", False),
        ("sglang", "int", False),
        ("sglang-array", "int", True),
    ],
)
async def test_every_event_once_in_order(style: str, hash_kind: str, negative: bool) -> None:
    rng = random.Random(style + hash_kind)
    batches = [gen.batch(rng, 16, hash_kind=hash_kind, style=style) for _ in range(60)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n, style=style, negative_hashes=negative) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)], topic="out")
            (rank,) = info.ranks
            assert rank.source == "zmq" and rank.source_endpoint == eng.endpoint
            await eng.wait_subscribed()
            async with Consumer(rank.publish_endpoint, rank.replay_endpoint, b"out") as c:
                for b in batches:
                    eng.publish(b)
                events = await c.collect_events(16 * 60)
                assert events == eng.as_sent(*batches)
                assert all(r.rank == 0 for r in c.received)
                assert len(c.received) == 60
                sent = [p for _, p in eng.buffer]
                if style == "sglang-array":  # [ts, events] from the engine: only the rank slot added
                    assert [msgspec.msgpack.decode(r.payload) for r in c.received] == [
                        [*msgspec.msgpack.decode(p), 0] for p in sent
                    ]
                else:  # the engine's own bytes
                    assert [r.payload for r in c.received] == sent
            assert m.delta("events_in") == m.delta("events_out") == 16 * 60
            assert m.delta("batches_out") == 60
            assert m.delta("gaps") == 0 and m.delta("resyncs", reason="no_replay") == 0
            assert eng.replay_requests == []
            n.cancel_scope.cancel()


async def test_what_the_engine_wrote_arrives_as_written() -> None:
    """vLLM 0.32's locality / ownership / session_id, SGLang 0.5.23's signed int64 hashes and
    cache_salt, a field no engine has yet, bytes and > int64 hashes: each payload goes out as the
    engine's own bytes, decoded by the consumer to exactly what the engine sent."""
    vllm_stored = {
        "type": "BlockStored",
        "block_hashes": [(1 << 64) - 1, b"\x01" * 32],
        "parent_block_hash": 1 << 63,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["mm:1", 0], None],
        "group_idx": 1,
        "locality": "REMOTE",
        "ownership": "tier-2",
        "session_id": "agent-7",
    }
    vllm_removed = {
        "type": "BlockRemoved",
        "block_hashes": [b"\x01" * 32],
        "medium": "GPU",
        "locality": "LOCAL",
    }
    sglang_stored = {
        "type": "BlockStored",
        "block_hashes": [-4611686018427387911, -1],
        "parent_block_hash": -(1 << 63),
        "token_ids": [5, 6],
        "block_size": 1,
        "lora_id": None,
        "medium": "CPU_PINNED",
        "cache_salt": "salt",
        "session_id": "s1",
        "lora_name": "ad",
        "a_future_field": {"nested": [1, [2, b"\x00"]]},
    }
    sglang_removed = {"type": "BlockRemoved", "block_hashes": [-4611686018427387911], "medium": "EXTERNAL"}
    batches = [[vllm_stored, vllm_removed], [sglang_stored], [sglang_removed]]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            payloads = [msgspec.msgpack.encode([1.5 + i, b, 0]) for i, b in enumerate(batches)]
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b, p in zip(batches, payloads, strict=True):
                    eng.publish(b, payload=p)
                assert await c.collect_events(4) == [e for b in batches for e in b]
                assert [r.payload for r in c.received] == payloads
                assert (
                    c.received[1].events[0]["block_hashes"][0] == -4611686018427387911
                )  # not 13835058055282163705
            n.cancel_scope.cancel()


async def test_injected_gap_is_replayed() -> None:
    rng = random.Random(1)
    batches = [gen.batch(rng, 4) for _ in range(30)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(batches):
                    eng.publish(b, send=not 10 <= i < 15)
                assert await c.collect_events(4 * 30) == eng.as_sent(*batches)
            assert eng.replay_requests == [10]
            assert m.delta("gaps") == 1 and m.delta("replays", outcome="ok") == 1
            assert m.delta("resyncs", reason="history_lost") == 0
            n.cancel_scope.cancel()


async def test_lost_history_clears_then_continues_live() -> None:
    rng = random.Random(2)
    batches = [gen.batch(rng, 3, clears=False) for _ in range(16)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n, buffer_steps=3) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(batches[:13]):
                    eng.publish(b, send=not 5 <= i < 12)  # the engine keeps only 10, 11, 12 by then
                first = [*eng.as_sent(*batches[:5]), eng.cleared, *eng.as_sent(*batches[10:13])]
                assert await c.collect_events(len(first)) == first
                for b in batches[13:]:
                    eng.publish(b)
                expected = [*first, *eng.as_sent(*batches[13:])]
                assert await c.collect_events(len(expected)) == expected
            assert eng.replay_requests == [5]
            assert m.delta("resyncs", reason="history_lost") == 1 and m.delta("gaps") == 1
            n.cancel_scope.cancel()


async def test_gap_without_replay_endpoint_clears() -> None:
    rng = random.Random(3)
    batches = [gen.batch(rng, 2, clears=False) for _ in range(4)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n, replay=False) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(batches):
                    eng.publish(b, send=i != 2)
                expected = [*eng.as_sent(*batches[:2]), eng.cleared, *eng.as_sent(*batches[3:])]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("resyncs", reason="no_replay") == 1
            n.cancel_scope.cancel()


@pytest.mark.parametrize("style", ["vllm-map", "vllm-array", "sglang-array"])
async def test_a_clear_takes_the_form_of_the_sources_events(style: str) -> None:
    """Joining late without a replay endpoint: the AllBlocksCleared comes before any batch was
    decoded, yet in the form the engine writes (a consumer decoding with that engine's classes
    reads it), then the batches as the engine wrote them."""
    rng = random.Random(style)
    batches = [gen.batch(rng, 3, clears=False, style=style) for _ in range(3)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n, style=style, replay=False) as eng:
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(batches):
                    eng.publish(b, send=i > 0)  # the first one is missed: seq 1 is the first seen
                expected = [eng.cleared, *eng.as_sent(*batches[1:])]
                assert await c.collect_events(len(expected)) == expected
                assert eng.cleared == (
                    ["AllBlocksCleared"] if style.endswith("array") else {"type": "AllBlocksCleared"}
                )
            n.cancel_scope.cancel()


@pytest.mark.parametrize("first_new_sent", [True, False])
async def test_publisher_restart_is_detected(first_new_sent: bool) -> None:
    rng = random.Random(4)
    old = [gen.batch(rng, 2, clears=False) for _ in range(5)]
    new = [gen.batch(rng, 2, clears=False) for _ in range(3)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in old:
                    eng.publish(b)
                await c.collect_events(len(eng.as_sent(*old)))
                await eng.restart()  # a new engine process on the same ports
                await eng.wait_subscribed()  # the bridge's SUB reconnected
                for i, b in enumerate(new):  # the new process's seq 0 may be missed live
                    eng.publish(b, send=first_new_sent or i > 0)
                expected = [*eng.as_sent(*old), eng.cleared, *eng.as_sent(*new)]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("resyncs", reason="restart") == 1
            assert m.delta("resyncs", reason="history_lost") == 0
            n.cancel_scope.cancel()


async def test_malformed_engine_payload_resyncs() -> None:
    rng = random.Random(5)
    batches = [gen.batch(rng, 2, clears=False) for _ in range(4)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for i, b in enumerate(batches):
                    eng.publish(b, payload=b"\xc1garbage" if i == 2 else None)
                eng.pub.send_multipart([b"kv", b"short", b"x"])  # type: ignore[union-attr]
                expected = [*eng.as_sent(*batches[:2]), eng.cleared, *eng.as_sent(*batches[3:])]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("decode_errors") == 2 and m.delta("resyncs", reason="decode_error") == 1
            n.cancel_scope.cancel()


async def test_two_ranks_two_engine_flavours() -> None:
    rng = random.Random(6)
    per_rank = {
        r: [gen.batch(rng, 8, style=s) for _ in range(20)] for r, s in ((0, "vllm-map"), (1, "sglang"))
    }
    with trio.fail_after(10):
        async with (
            trio.open_nursery() as n,
            FakeZmqEngine(n, rank=0, style="vllm-map") as e0,
            FakeZmqEngine(n, rank=1, style="sglang") as e1,
        ):
            info = await start_bridge(n, [source(e1, 1), source(e0, 0)])
            assert [r.rank for r in info.ranks] == [1, 0]
            assert (
                len({r.publish_endpoint for r in info.ranks} | {r.replay_endpoint for r in info.ranks}) == 4
            )
            d = info.to_dict()
            assert d["format"] == "vllm-zmq" and {r["dpRank"] for r in d["ranks"]} == {0, 1}
            await e0.wait_subscribed()
            await e1.wait_subscribed()
            for i in range(20):
                e0.publish(per_rank[0][i])
                e1.publish(per_rank[1][i])
            for r in info.ranks:
                async with Consumer(r.publish_endpoint, r.replay_endpoint) as c:
                    assert await c.collect_events(8 * 20) == {0: e0, 1: e1}[r.rank].as_sent(*per_rank[r.rank])
                    assert {p.rank for p in c.received} == {r.rank}
            n.cancel_scope.cancel()


async def test_replay_from_our_router_including_an_expired_start() -> None:
    rng = random.Random(7)
    batches = [gen.batch(rng, 2) for _ in range(12)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)], buffer_steps=5, topic="t")
            (rank,) = info.ranks
            await eng.wait_subscribed()
            async with Consumer(rank.publish_endpoint, rank.replay_endpoint, b"t") as c:
                for i, b in enumerate(batches):  # lock-step, so the small buffer never loses anything
                    eng.publish(b)
                    await c.collect(lambda rs, i=i: len(rs) > i)
                assert [r.seq for r in c.received] == list(range(12)) and not c.lost
                requests_before = m.delta("replay_requests_served")

                async def ask(start: int) -> list[int]:
                    got = await c.replay(start)
                    assert all(t == b"t" for t, _, _ in got)
                    for _, seq, payload in got:
                        _ts, events, r = decode_payload(payload)
                        assert events == eng.as_sent(batches[seq]) and r == 0
                        assert payload == c.received[seq].payload  # replay: exactly what went out live
                    return [seq for _, seq, _ in got]

                assert await ask(0) == [7, 8, 9, 10, 11]  # expired: from the oldest held batch
                assert await ask(9) == [9, 10, 11]
                assert await ask(11) == [11]
                assert await ask(12) == []
                assert await ask(2**64 - 1) == []
                assert m.delta("replay_requests_served") - requests_before == 5

                # a request without delimiter is answered in kind; a malformed one gets the end marker
                dealer = c.ctx.socket(zmq.DEALER)
                dealer.connect(rank.replay_endpoint)  # type: ignore[arg-type]
                dealer.send_multipart([(10).to_bytes(8, "big")])
                assert [f[1] for f in [await zrecv(dealer), await zrecv(dealer)]] == [
                    b"\x00" * 7 + b"\x0a",
                    b"\x00" * 7 + b"\x0b",
                ]
                assert await zrecv(dealer) == [b"", END, b""]
                dealer.send_multipart([b"", b"bad"])
                assert await zrecv(dealer) == [b"", b"", END, b""]
                dealer.close(linger=0)
            n.cancel_scope.cancel()


async def test_bad_config_and_bind_failure_raise_before_started() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            with pytest.raises(KvConfigError):
                await n.start(
                    partial(
                        run_kv_bridge, KvBridgeConfig(buffer_steps=0), sources=[ZmqSource(0, "tcp://h:1")]
                    )
                )
            with pytest.raises(KvConfigError):
                await n.start(run_kv_bridge, KvBridgeConfig())  # neither sources nor a client
            with pytest.raises(KvConfigError):
                two = [ZmqSource(0, "tcp://h:1"), ZmqSource(0, "tcp://h:2")]
                await n.start(partial(run_kv_bridge, KvBridgeConfig(), sources=two))
            with pytest.raises(KvConfigError):
                await n.start(partial(run_kv_bridge, KvBridgeConfig(), sources=[GrpcSource(0)]))  # no client
            ctx = zmq.Context()
            taken = ctx.socket(zmq.PUB)
            taken.bind("tcp://127.0.0.1:0")
            endpoint = taken.getsockopt(zmq.LAST_ENDPOINT).decode()
            try:
                with pytest.raises(OSError):
                    await start_bridge(n, [ZmqSource(0, "tcp://127.0.0.1:9")], publish_endpoint=endpoint)
            finally:
                ctx.destroy(linger=0)


async def test_cancel_closes_every_socket() -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as inner:
                    info = await start_bridge(inner, [source(eng)])
                    scope.cancel()
            # the ports are free again: bind them ourselves
            ctx = zmq.Context()
            try:
                for ep in (info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint):
                    s = ctx.socket(zmq.PUB)
                    s.bind(ep)  # type: ignore[arg-type]
                    s.close(linger=0)
            finally:
                ctx.destroy(linger=0)
            n.cancel_scope.cancel()


async def test_crashed_ingest_is_resynced_and_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.kvbridge import decode_msgpack

    real = decode_msgpack.MsgpackBatchDecoder.decode
    boom = {"armed": True}

    def flaky(self: decode_msgpack.MsgpackBatchDecoder, payload: bytes) -> object:
        if payload == b"BOOM" and boom.pop("armed", False):
            raise RuntimeError("a bug")
        return real(self, payload)

    monkeypatch.setattr(decode_msgpack.MsgpackBatchDecoder, "decode", flaky)
    rng = random.Random(8)
    batches = [gen.batch(rng, 2, clears=False) for _ in range(6)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)], backoff_max=0.01)
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                for b in batches[:2]:
                    eng.publish(b)
                await c.collect_events(4)
                eng.publish([], payload=b"BOOM")
                await eng.wait_subscribed()  # the restarted ingest subscribed again
                for b in batches[2:]:
                    eng.publish(b)
                # after the resync the new ingest replays the engine's history from 0; the
                # payload that crashed the old one now fails to decode: resync again
                expected = [
                    *eng.as_sent(*batches[:2]),
                    eng.cleared,
                    *eng.as_sent(*batches[:2]),
                    eng.cleared,
                    *eng.as_sent(*batches[2:]),
                ]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("resyncs", reason="ingest_restart") == 1
            n.cancel_scope.cancel()


async def test_idle_heartbeat_is_an_empty_batch_that_reveals_a_lost_one() -> None:
    """``heartbeat``: after that many idle seconds a batch with no events goes out under the next
    number — nothing for a consumer to apply (no event arrives twice), and a visible gap for one
    that lost batches (here: published before it subscribed), filled by replay."""
    rng = random.Random(5)
    first, last = gen.batch(rng, 4), gen.batch(rng, 4)
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)], heartbeat=0.2)
            await eng.wait_subscribed()
            (rank,) = info.ranks
            eng.publish(first)
            async with Consumer(rank.publish_endpoint, rank.replay_endpoint) as early:
                eng.publish(last)  # the late consumer below never sees these live
                await early.collect_events(8)
            async with Consumer(rank.publish_endpoint, rank.replay_endpoint) as late:
                await late.collect(lambda rs: len(rs) >= 5)  # first + last by replay, then heartbeats
                got = late.received
                assert [r.seq for r in got] == list(range(len(got)))
                assert [r.events for r in got] == [
                    eng.as_sent(first),
                    eng.as_sent(last),
                    *[[]] * (len(got) - 2),
                ]
                assert all(r.rank == 0 and isinstance(r.ts, float) for r in got)
                assert sum(len(r.events) for r in got) == 8  # every event once, however long idle
                replayed = await late.replay(0)  # replay: exactly what went out live
                assert [(s, p) for _, s, p in replayed][: len(got)] == [(r.seq, r.payload) for r in got]
            assert m.delta("heartbeats") >= 3 and m.delta("batches_out") == 2 and m.delta("events_out") == 8
            n.cancel_scope.cancel()

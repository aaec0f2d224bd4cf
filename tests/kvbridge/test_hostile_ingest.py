"""What the bridge takes from the engine is bounded (issue 15, finding 9; docs/SECURITY.md
"KV bridge"): any batch that does not decode — nested too deep, wrong types — is a counted
decode error and a resync, never a crashed ingest; an engine replay that never ends is
abandoned at a bound of batches, bytes or time; a batch over ``--kv-max-batch-bytes`` is
dropped and resynced, on ZMQ and on ``SubscribeKvEvents``. Real ZMQ sockets, the fake
engines of this package, the independent consumer."""

from __future__ import annotations

import random
from dataclasses import replace
from functools import partial
from typing import Any

import msgspec
import pytest
import trio
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kvbridge import GrpcSource, IngestLimits, ZmqSource
from sidecar.kvbridge.decode_msgpack import MAX_NESTING, MsgpackBatchDecoder
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import encode_batch
from tests.fake_engine import FakeEngine
from tests.kvbridge import gen
from tests.kvbridge.consumer import Consumer
from tests.kvbridge.fake_zmq_engine import FakeZmqEngine, zrecv
from tests.kvbridge.helpers import CLEARED, Metrics, flat, start_bridge

TS = b"\xcb" + b"\x00" * 8  # msgpack float64 0.0


def deep_payload(depth: int) -> bytes:
    """``[ts, [[[[...]]]]]``: a batch whose events list nests ``depth`` arrays."""
    return b"\x92" + TS + b"\x91" * depth + b"\xc0"


def deep_metadata_payload(depth: int) -> bytes:
    """A well-typed BlockStored whose SGLang ``metadata`` map nests ``depth`` levels."""
    value: Any = 1
    for _ in range(depth):
        value = {"k": value}
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
             "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None, "metadata": value}  # fmt: skip
    return msgspec.msgpack.encode([0.0, [event], 0])


@pytest.mark.parametrize(
    "payload",
    [
        deep_payload(100_000),  # msgspec: RecursionError
        deep_payload(2_000),
        b"\x92" + TS + b"\x91" + b"\x81\x91\x01\x02",  # a map keyed by an array
        deep_metadata_payload(MAX_NESTING + 1),  # decodes, but too deep to pass on
        msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 1, None, "GPU", None, [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]),
    ],
    ids=["nested-100k", "nested-2k", "array-key", "deep-metadata", "deep-extra-keys"],
)  # fmt: skip
def test_any_undecodable_payload_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KvDecodeError):
        MsgpackBatchDecoder().decode(payload)


def test_nesting_within_the_bound_is_kept() -> None:
    batch = MsgpackBatchDecoder().decode(deep_metadata_payload(MAX_NESTING - 1))
    assert batch.events[0].metadata  # type: ignore[union-attr]


def source(eng: FakeZmqEngine, replay_endpoint: str | None = None) -> ZmqSource:
    return ZmqSource(0, eng.endpoint, eng.topic.decode(), replay_endpoint or eng.replay_endpoint)


async def test_a_deeply_nested_batch_resyncs_without_restarting_the_ingest() -> None:
    """Before: ``RecursionError`` escaped the decoder, the ingest crashed and was restarted
    (``ingest_restart``; in a sidecar, no batch for the 5 s restart backoff)."""
    rng = random.Random(9)
    batches = [gen.batch(rng, 2, clears=False) for _ in range(5)]
    with trio.fail_after(10):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            info = await start_bridge(n, [source(eng)])
            await eng.wait_subscribed()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                bad = {1: deep_payload(100_000), 3: deep_metadata_payload(64)}
                for i, b in enumerate(batches):
                    eng.publish(b, payload=bad.get(i))
                expected = [*flat(batches[:1]), CLEARED, *flat(batches[2:3]), CLEARED, *flat(batches[4:])]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("decode_errors") == 2 and m.delta("resyncs", reason="decode_error") == 2
            assert m.delta("resyncs", reason="ingest_restart") == 0
            n.cancel_scope.cancel()


async def _endless_replay(
    ctx: zmq.Context,
    *,
    payload: bytes,
    every: float = 0.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """An engine replay ROUTER that answers every request with batches and never the end marker."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind("tcp://127.0.0.1:0")
    try:
        task_status.started(router.getsockopt(zmq.LAST_ENDPOINT).decode())
        ident, _, start_b = await zrecv(router)
        seq = int.from_bytes(start_b, "big")
        while True:
            try:
                router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                seq += 1
            except zmq.Again:
                pass
            await trio.sleep(every)  # (the pace of a hostile engine, not a synchronization)
    finally:
        router.close(linger=0)


@pytest.mark.parametrize(
    ("limits", "every"),
    [
        (IngestLimits(replay_max_batches=2_000), 0.0),
        (IngestLimits(replay_max_bytes=1024 * 1024), 0.0),
        (IngestLimits(replay_deadline=1.0), 0.01),  # each message well within the replay timeout
    ],
    ids=["batches", "bytes", "deadline"],
)
async def test_an_engine_replay_without_end_is_abandoned_as_lost_history(
    limits: IngestLimits, every: float
) -> None:
    """Before: the bridge buffered such a replay without limit (2.3 GB in 18 s) and published
    nothing meanwhile."""
    rng = random.Random(10)
    batches = [gen.batch(rng, 2, clears=False) for _ in range(3)]
    with trio.fail_after(20):
        async with trio.open_nursery() as n, FakeZmqEngine(n, replay=False) as eng:
            ctx = zmq.Context()
            try:
                payload = eng.encode(gen.batch(rng, 4, clears=False))
                endless = await n.start(partial(_endless_replay, ctx, payload=payload, every=every))
                m = Metrics()
                info = await start_bridge(n, [source(eng, endless)], ingest_limits=limits)
                await eng.wait_subscribed()
                async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                    eng.publish(batches[0])
                    eng.publish(batches[1], send=False)  # a gap: the bridge asks for a replay
                    eng.publish(batches[2])
                    expected = [*flat(batches[:1]), CLEARED, *flat(batches[2:])]
                    assert await c.collect_events(len(expected)) == expected
                assert m.delta("replays", outcome="over_limit") == 1
                assert m.delta("resyncs", reason="history_lost") == 1
                n.cancel_scope.cancel()
            finally:
                ctx.destroy(linger=0)


async def test_a_zmq_batch_over_the_size_bound_is_dropped_and_resynced() -> None:
    rng = random.Random(11)
    batches = [gen.batch(rng, 2, clears=False) for _ in range(3)]
    with trio.fail_after(20):
        async with trio.open_nursery() as n, FakeZmqEngine(n) as eng:
            m = Metrics()
            limits = IngestLimits(max_batch_bytes=64 * 1024)
            info = await start_bridge(n, [source(eng)], ingest_limits=limits)
            await eng.wait_subscribed()
            eng.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # type: ignore[union-attr]  # see the resubscription even
            # while the dropped connection is still registered
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                eng.publish(batches[0])
                await c.collect_events(len(flat(batches[:1])))
                big = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared", "pad": b"x" * 200_000}], 0])
                eng.publish([], payload=big)  # over the bound: libzmq drops the connection
                await eng.wait_subscribed()  # the bridge's subscriber is back
                eng.publish(batches[1])  # reveals the gap; its replay holds the huge batch again
                eng.publish(batches[2])
                expected = [*flat(batches[:1]), CLEARED, *flat(batches[1:])]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("resyncs", reason="ingest_restart") == 0
            n.cancel_scope.cancel()


async def test_a_grpc_batch_over_the_size_bound_is_skipped_and_resynced() -> None:
    rng = random.Random(12)
    batches = [gen.batch(rng, 3, proto=True) for _ in range(4)]
    huge = [dict(gen.batch(rng, 1, proto=True, clears=False)[0])]
    huge[0]["token_ids"] = list(range(50_000))
    eng = FakeEngine()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            m = Metrics()
            limits = IngestLimits(max_batch_bytes=16 * 1024)
            info = await start_bridge(n, [GrpcSource(0)], client=eng, ingest_limits=limits)
            await eng.kv_subscribed.wait()
            async with Consumer(info.ranks[0].publish_endpoint, info.ranks[0].replay_endpoint) as c:
                eng.publish(batches[0])
                eng.publish(huge)
                for b in batches[1:]:
                    eng.publish(b)
                expected = [*flat(batches[:1]), CLEARED, *flat(batches[1:])]
                assert await c.collect_events(len(expected)) == expected
            assert m.delta("decode_errors") == 1 and m.delta("resyncs", reason="decode_error") == 1
            starts = [r.start_sequence_number for r in eng.kv_requests]
            assert starts == [0, 2], starts  # resumed after the skipped batch, once
            n.cancel_scope.cancel()


def test_limits_are_validated() -> None:
    assert IngestLimits().problems() == []
    assert len(replace(IngestLimits(), max_batch_bytes=10, replay_max_batches=0).problems()) == 2


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_nested = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
    max_leaves=40,
)


def _deep(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


@settings(max_examples=300, deadline=None)
@given(
    shape=st.sampled_from(["batch", "event", "metadata", "extra_keys", "raw"]),
    value=_nested,
    depth=st.integers(0, 3 * MAX_NESTING),
    raw=st.binary(max_size=64),
)
def test_property_nothing_but_a_decode_error_escapes(shape: str, value: Any, depth: int, raw: bytes) -> None:
    """Arbitrary, arbitrarily nested values in every slot: a batch that re-encodes, or a
    KvDecodeError — never another exception (which would crash the ingest)."""
    value = _deep(depth, value)
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
              "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    if shape == "batch":
        payload = msgspec.msgpack.encode(value)
    elif shape == "event":
        payload = msgspec.msgpack.encode([0.0, [value], 0])
    elif shape == "metadata":
        payload = msgspec.msgpack.encode([0.0, [{**stored, "metadata": value}], 0])
    elif shape == "extra_keys":
        payload = msgspec.msgpack.encode([0.0, [{**stored, "extra_keys": [value]}], 0])
    else:
        payload = raw
    try:
        batch = MsgpackBatchDecoder().decode(payload)
    except KvDecodeError:
        return
    encode_batch(batch)  # whatever decoded can be published

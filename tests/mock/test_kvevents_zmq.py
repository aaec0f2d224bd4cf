"""ZMQ KV events of the vLLM / SGLang mocks, checked by an independent subscriber.

The subscriber below decodes frames per docs/design/engine-facts.md ("KV events over
ZMQ") with plain pyzmq + msgspec's untyped msgpack decoder; it does not use the
mock's encoder. The expected events come from the cache's ground truth records.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
import pytest
import trio
import trio_asyncio
import zmq

from sidecar.mock.kvcache import (
    ClearedRecord,
    KvCache,
    KvEventRecord,
    KvGroundTruth,
    RemovedRecord,
    StoredRecord,
)
from sidecar.mock.kvevents import ZmqKvEvents, kv_event_sources, routable_host
from sidecar.mock.kvevents_wire import KvFaults

END = b"\xff" * 8
ARRAY_FIELDS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}
REQUIRED = {
    "BlockStored": {
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    },
    "BlockRemoved": {"block_hashes", "medium"},
    "AllBlocksCleared": set(),
}


# --------------------------------------------------------------------------- independent subscriber


async def arecv(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Receive one multipart message without blocking trio (ZMQ's FD is edge-triggered)."""
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            continue
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))


def decode_event(raw: Any) -> tuple[str, dict[str, Any], str]:
    """(type, fields, form) from a tagged map or a tagged array."""
    if isinstance(raw, dict):
        kind = raw["type"]
        fields = {k: v for k, v in raw.items() if k != "type"}
        assert REQUIRED[kind] <= fields.keys(), f"{kind} map lacks {REQUIRED[kind] - fields.keys()}"
        return kind, fields, "map"
    assert isinstance(raw, list) and isinstance(raw[0], str)
    kind = raw[0]
    assert len(raw) - 1 >= len(REQUIRED[kind])
    return kind, dict(zip(ARRAY_FIELDS[kind], raw[1:], strict=False)), "array"


def decode_payload(payload: bytes) -> tuple[float, list[tuple[str, dict[str, Any], str]], int | None]:
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and math.isfinite(ts)
    assert isinstance(events, list)
    return ts, [decode_event(e) for e in events], rank


def expected(ev: KvEventRecord, style: str) -> tuple[str, dict[str, Any]]:
    """What docs/design/engine-facts.md says the wire carries for a ground-truth record."""
    if isinstance(ev, StoredRecord):
        lora_name: Any = ev.lora_name
        if style == "sglang" and ev.cache_salt is not None:
            lora_name = {"cache_salt": ev.cache_salt, "session_id": ev.session_id}
        fields: dict[str, Any] = {
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": "GPU",
            "lora_name": lora_name,
        }
        if ev.extra_keys is not None:
            fields["extra_keys"] = [None if k is None else list(k) for k in ev.extra_keys]
        return "BlockStored", fields
    if isinstance(ev, RemovedRecord):
        return "BlockRemoved", {"block_hashes": list(ev.block_hashes), "medium": "GPU"}
    assert isinstance(ev, ClearedRecord)
    return "AllBlocksCleared", {}


class Subscriber:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, topic: bytes) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://{host}:{port}")

    async def batch(self) -> tuple[bytes, int, bytes]:
        frames = await arecv(self.sock)
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload


async def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int, *, style: str, topic: bytes = b""
) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            frames = await arecv(dealer)
            if style == "sglang":
                assert len(frames) == 3, frames  # no topic frame
                empty, seq, payload = frames
            else:
                assert len(frames) == 4, frames
                empty, frame_topic, seq, payload = frames
                assert frame_topic in (topic, b"")
                if seq != END:
                    assert frame_topic == topic
            assert empty == b"" and len(seq) == 8
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def zctx() -> Any:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # closes sockets a failed test left open


async def open_events(**kw: Any) -> Any:
    return trio_asyncio.aio_as_trio(ZmqKvEvents(**kw))


async def wait_subscribed(events: ZmqKvEvents, rank: int) -> None:
    await trio_asyncio.aio_as_trio(events.publishers[rank].wait_subscribers)(1)


def workload(cache: KvCache) -> None:
    """A few steps: stores (some salted / LoRA / media), an eviction, a clear."""
    a = cache.allocate(list(range(40)), request_id="r1")
    b = cache.allocate(list(range(16)) + [9] * 9, lora_id=3, lora_name="ad", media_hashes=["img-1"])
    cache.release(a)
    c = cache.allocate(list(range(500, 520)), cache_salt="tenant", request_id="r3")
    cache.release(b)
    cache.release(c)
    d = cache.allocate(list(range(900, 960)))  # needs evictions
    cache.release(d)
    cache.clear()


# --------------------------------------------------------------------------- tests


def test_routable_host_never_a_wildcard() -> None:
    assert routable_host("127.0.0.1") == "127.0.0.1"
    assert routable_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    for wildcard in ("0.0.0.0", "*", "::", ""):
        assert routable_host(wildcard) not in ("0.0.0.0", "*", "::", "")


@pytest.mark.parametrize(
    ("style", "tagged"), [("vllm", False), ("vllm", True), ("sglang", False), ("sglang", True)]
)
async def test_wire_format_seq_and_replay(aio_loop: Any, zctx: Any, style: str, tagged: bool) -> None:
    gt = KvGroundTruth()
    faults = KvFaults(tagged_arrays=tagged)
    with trio.fail_after(10):
        async with await open_events(ranks=2, port=0, topic="kv", style=style, faults=faults) as events:
            sources = kv_event_sources(events).sources
            assert [s.data_parallel_rank for s in sources] == [0, 1]
            subs = {}
            for src in sources:
                assert src.transport == "zmq" and src.encoding == "msgpack" and src.topic == "kv"
                assert src.endpoint_addr.host == "127.0.0.1" and src.replay_endpoint.startswith(
                    "tcp://127.0.0.1:"
                )
                subs[src.data_parallel_rank] = Subscriber(
                    zctx, src.endpoint_addr.host, src.endpoint_addr.port, b"kv"
                )
                await wait_subscribed(events, src.data_parallel_rank)
            caches = {r: KvCache(r, 4, 24, events, ground_truth=gt) for r in (0, 1)}
            workload(caches[0])
            caches[1].allocate(list(range(8)))

            big_hash_seen = False
            for rank, sub in subs.items():
                truth = gt.batches(rank)
                payloads = []
                for want_seq, (gt_seq, gt_events) in enumerate(truth):
                    topic, seq, payload = await sub.batch()
                    assert topic == b"kv" and seq == want_seq == gt_seq  # contiguous from 0
                    _, events_, batch_rank = decode_payload(payload)
                    assert batch_rank == rank  # dp_rank / attn_dp_rank slot
                    assert {form for _, _, form in events_} == {"array" if tagged else "map"}
                    got = [(kind, fields) for kind, fields, _ in events_]
                    assert got == [expected(e, style) for e in gt_events]
                    for kind, fields in got:
                        if kind == "BlockStored":
                            assert "group_idx" not in fields  # defaulted fields omitted
                            assert len(fields["token_ids"]) == fields["block_size"] * len(
                                fields["block_hashes"]
                            )
                            big_hash_seen |= any(h >= 2**63 for h in fields["block_hashes"])
                    payloads.append(payload)
                # replay: everything from 0, then from the middle; identical payloads
                src = sources[rank]
                replayed = await replay(zctx, src.replay_endpoint, 0, style=style, topic=b"kv")
                assert replayed == list(enumerate(payloads))
                assert await replay(zctx, src.replay_endpoint, 1, style=style, topic=b"kv") == replayed[1:]
            assert big_hash_seen  # hashes use the full unsigned 64-bit range
            kinds = {k for r in (0, 1) for e in gt.events(r) for k in [type(e).__name__]}
            assert kinds == {"StoredRecord", "RemovedRecord", "ClearedRecord"}
            if style == "sglang":
                salted = [e for e in gt.events(0) if isinstance(e, StoredRecord) and e.cache_salt]
                assert salted and salted[0].session_id == "r3"


async def test_replay_start_older_than_buffer_returns_oldest(aio_loop: Any, zctx: Any) -> None:
    with trio.fail_after(10):
        async with await open_events(ranks=1, port=0, buffer_steps=3) as events:
            cache = KvCache(0, 4, 100, events)
            for i in range(6):
                cache.allocate([i] * 4)
            endpoint = events.sources().sources[0].replay_endpoint
            replayed = await replay(zctx, endpoint, 0, style="vllm")
            assert [seq for seq, _ in replayed] == [3, 4, 5]
            assert await replay(zctx, endpoint, 5, style="vllm") == replayed[2:]
            assert await replay(zctx, endpoint, 6, style="vllm") == []  # only the end marker


async def test_an_idle_replay_is_not_logged_at_info(
    aio_loop: Any, zctx: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar's silence probe asks for newer batches every --kv-silence-probe seconds while
    the engine is idle: that was an INFO line every 10 s. A replay that sends batches still is."""
    caplog.set_level(logging.DEBUG, logger="sidecar.mock.kvevents")
    with trio.fail_after(10):
        async with await open_events(ranks=1, port=0, buffer_steps=3) as events:
            KvCache(0, 4, 100, events).allocate([1] * 4)
            endpoint = events.sources().sources[0].replay_endpoint
            for _ in range(3):
                assert await replay(zctx, endpoint, 1, style="vllm") == []  # nothing new
            assert len(await replay(zctx, endpoint, 0, style="vllm")) == 1
    replays = [r for r in caplog.records if "replay from" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in replays] == [
        (logging.DEBUG, "KV events rank 0: replay from 1: 0 batches")
    ] * 3 + [(logging.INFO, "KV events rank 0: replay from 0: 1 batches (first 0)")]


async def _faulted(
    zctx: Any, faults: KvFaults, batches: int
) -> tuple[list[int], list[bytes], KvGroundTruth, dict[int, list[tuple[int, bytes]]]]:
    """Publish one batch per step under ``faults``: live seqs and payloads, ground truth, replays from 0..n-1."""
    dropped = (faults.gap_at is not None) + (faults.history_lost_at is not None)
    async with await open_events(ranks=1, port=0, faults=faults) as events:
        src = events.sources().sources[0]
        sub = Subscriber(zctx, src.endpoint_addr.host, src.endpoint_addr.port, b"")
        await wait_subscribed(events, 0)
        gt = KvGroundTruth()
        cache = KvCache(0, 4, 100, events, ground_truth=gt)
        for i in range(batches):
            cache.allocate([i] * 4)
        live: list[int] = []
        payloads: list[bytes] = []
        while len(live) < batches - dropped:
            _, seq, payload = await sub.batch()
            live.append(seq)
            payloads.append(payload)
        replays = {
            start: await replay(zctx, src.replay_endpoint, start, style="vllm") for start in range(batches)
        }
    return live, payloads, gt, replays


async def test_fault_gap_is_recoverable_by_replay(aio_loop: Any, zctx: Any) -> None:
    with trio.fail_after(10):
        live, _, gt, replays = await _faulted(zctx, KvFaults(gap_at=1), 4)
    assert live == [0, 2, 3]  # 1 never arrived live
    first_seq, payload = replays[1][0]
    assert first_seq == 1  # ... but the replay has it
    _, events_, _ = decode_payload(payload)
    assert [(k, f) for k, f, _ in events_] == [expected(e, "vllm") for e in gt.batches(0)[1][1]]


async def test_fault_history_lost_replay_starts_later(aio_loop: Any, zctx: Any) -> None:
    with trio.fail_after(10):
        live, _, _, replays = await _faulted(zctx, KvFaults(history_lost_at=1), 4)
    assert live == [0, 2, 3]
    assert [seq for seq, _ in replays[1]] == [2, 3]  # asked for 1, got a later start
    assert [seq for seq, _ in replays[0]] == [2, 3]  # batch 0 is forgotten too


async def test_fault_publisher_restart_sequence_back_to_zero(aio_loop: Any, zctx: Any) -> None:
    with trio.fail_after(10):
        live, payloads, gt, replays = await _faulted(zctx, KvFaults(restart_at=2), 5)
    assert live == [0, 1, 0, 1, 2]
    assert [seq for seq, _ in replays[0]] == [0, 1, 2]  # the old history is gone
    assert [p for _, p in replays[0]] == payloads[2:]
    assert [seq for seq, _ in gt.batches(0)] == [0, 1, 0, 1, 2]


def test_fault_options_parsing() -> None:
    assert KvFaults.from_options([("kv-gap", None), ("stall", "3"), ("kv-tagged-arrays", None)]) == KvFaults(
        gap_at=1, tagged_arrays=True
    )
    assert KvFaults.from_options({"kv-publisher-restart": "7", "kv-history-lost": ""}) == KvFaults(
        restart_at=7, history_lost_at=1
    )
    with pytest.raises(ValueError):
        KvFaults.from_options([("kv-nope", None)])
    assert KvFaults.from_kv_options({"kv_gap": 3, "kv_history_lost": True}) == KvFaults(
        gap_at=3, history_lost_at=1
    )

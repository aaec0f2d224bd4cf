"""The engine's KV events as an independent subscriber sees them (ZMQ msgpack and gRPC)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
import trio_asyncio
import zmq

from sidecar.mock import tokenizer as tok
from sidecar.mock.kvcache import compute_block_hashes
from sidecar.openengine import pb

from .helpers import collect, engine, request

PROMPT = " ba be bi bo bu" * 8  # 41 tokens with BOS: two full blocks of 16


def prompt_ids(text: str) -> list[int]:
    return [tok.BOS_ID, *tok.encode(text)]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_zmq_block_stored_matches_the_prompt(aio_loop: Any, flavor: str) -> None:
    async with engine(flavor=flavor, kv_events="zmq", dp_size=2) as (eng, client):
        sources = (await client.get_kv_event_sources()).sources
        assert [s.data_parallel_rank for s in sources] == [0, 1]
        src = sources[1]
        assert src.transport == "zmq" and src.encoding == "msgpack" and src.endpoint_addr is not None
        assert src.endpoint_addr.host == "127.0.0.1" and src.replay_endpoint.startswith("tcp://127.0.0.1:")
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.connect(f"tcp://{src.endpoint_addr.host}:{src.endpoint_addr.port}")
            with trio.fail_after(10):
                await trio_asyncio.aio_as_trio(eng.engine.kv_events.publishers[1].wait_subscribers)()
                await collect(
                    client,
                    request("a", prompt=PROMPT, max_tokens=1),
                    metadata={"openengine-target-dp-rank": "1"},
                )
                topic, seq, payload = await trio.to_thread.run_sync(sub.recv_multipart)
        finally:
            sub.close()
            ctx.term()
        assert topic == b"" and int.from_bytes(seq, "big") == 0
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert rank == 1 and isinstance(ts, float)
        [stored] = events
        assert stored["type"] == "BlockStored" and stored["block_size"] == 16
        assert stored["block_hashes"] == compute_block_hashes(prompt_ids(PROMPT), 16)
        assert stored["parent_block_hash"] is None
        assert stored["token_ids"] == prompt_ids(PROMPT)[:32]


async def test_grpc_source_with_snapshot(aio_loop: Any) -> None:
    async with engine(flavor="trtllm", kv_events="auto") as (eng, client):
        [src] = (await client.get_kv_event_sources()).sources
        assert (src.transport, src.encoding) == ("grpc", "protobuf")
        assert (
            src.endpoint_addr is not None
            and f"{src.endpoint_addr.host}:{src.endpoint_addr.port}" == eng.address
        )
        await collect(client, request("a", prompt=PROMPT, max_tokens=1))
        with trio.fail_after(10):
            async with client.subscribe_kv_events(
                pb.SubscribeKvEventsRequest(include_snapshot=True)
            ) as stream:
                first = await stream.__anext__()
        assert first.batch is not None
        kinds = [e.block_stored is not None for e in first.batch.events]
        assert first.batch.events[0].all_blocks_cleared is not None and sum(kinds) == 2
        hashes = [int.from_bytes(e.block_stored.block_hashes[0].value, "big") for e in first.batch.events[1:]]  # type: ignore[union-attr]
        assert hashes == compute_block_hashes(prompt_ids(PROMPT), 16)


async def test_zmq_flavour_has_no_grpc_stream_and_none_has_no_sources(aio_loop: Any) -> None:
    from sidecar.openengine.engine_errors import EngineStatusError

    async with engine(flavor="vllm", kv_events="zmq") as (_, client):
        with pytest.raises(EngineStatusError) as info, trio.fail_after(5):
            async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as stream:
                await stream.__anext__()
        assert info.value.status == "UNIMPLEMENTED"
        with pytest.raises(EngineStatusError) as info:
            await client.get_kv_event_sources(pb.GetKvEventSourcesRequest(data_parallel_ranks=[3]))
        assert info.value.status == "INVALID_ARGUMENT"
    async with engine(kv_events="none") as (_, client):
        assert (await client.get_kv_event_sources()).sources == []


async def test_lora_and_salt_reach_the_block_hashes(aio_loop: Any, tmp_path: Any) -> None:
    (tmp_path / "ad").mkdir()
    async with engine(flavor="trtllm", kv_events="grpc") as (eng, client):
        await client.load_lora(
            pb.LoadLoraRequest(
                adapter=pb.LoraAdapter(lora_id=5, lora_name="ad", source_path=str(tmp_path / "ad"))
            )
        )
        await collect(
            client, request("a", prompt=PROMPT, max_tokens=1, lora_name="ad", kv=pb.KvOptions(cache_salt="s"))
        )
        cache = eng.engine.caches[0]
        expected = compute_block_hashes(prompt_ids(PROMPT), 16, lora_id=5, cache_salt="s")
        assert all(cache.contains(h) for h in expected)
        assert not cache.contains(compute_block_hashes(prompt_ids(PROMPT), 16)[0])

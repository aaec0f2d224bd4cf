"""The sidecar in front of real vLLM (``vllm-engine`` on the tiny model), real processes end to end.

Worker card from vLLM's own configuration; streamed generation; a cancel mid-stream that leaves
nothing in vLLM (by vLLM's own scheduler stats and request table) after exactly one Abort;
drain with streams in flight; vLLM's real KV events through the sidecar's bridge, read by an
independent subscriber, a shared prefix showing up as the blocks vLLM stored.
"""

from __future__ import annotations

import re
import signal
from typing import Any

import httpx
import trio

from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import sidecar
from tests.kvbridge.consumer import Consumer
from tests.vllm.harness import (
    BLOCK,
    KV_BLOCKS,
    MAX_MODEL_LEN,
    MODEL,
    VllmProc,
    attributes,
    token_ids,
    wait_request_gone,
)

KV_BRIDGED = re.compile(r"KV events bridged from \S+ to rank 0: (\S+) \(replay (\S+)\)")


def request(rid: str, ids: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A north ``request`` (proto3 JSON) on token ids, ``max_tokens`` exactly (EOS ignored)."""
    return {
        "requestId": rid,
        "model": MODEL,
        "tokenIds": {"ids": ids},
        "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
        **extra,
    }


async def run(ws: str, req: dict[str, Any]) -> tuple[list[Any], Any]:
    async with open_sidecar(ws) as client, client.generate(req) as stream:
        events = [e.response async for e in stream]
    return events, stream.end


async def test_worker_card_is_vllms_own_configuration(aio_loop: Any, vllm_engine: VllmProc) -> None:
    with trio.fail_after(60):
        async with sidecar(vllm_engine.address) as sc, httpx.AsyncClient() as http:
            card = (await http.get(sc.http + "/v1/worker", timeout=10)).json()
    assert card["engine"]["name"] == "vllm" and card["engine"]["version"] == "0.32.0"
    assert card["role"] == "aggregated" and card["dpRanks"] == [0] and card["problems"] == []
    assert card["capacity"]["kvBlockSize"] == BLOCK and int(card["capacity"]["totalKvBlocks"]) == KV_BLOCKS
    (model,) = card["models"]
    assert model["servedModelName"] == MODEL and model["maxContextLength"] == MAX_MODEL_LEN
    assert model["tokenizer"]["source"] == model["modelId"]  # the model directory
    assert model["generation"]["supportsCacheSalt"] is True and model["supportsLora"] is False
    (source,) = card["kvEventSources"]
    assert source["transport"] == "zmq" and source["endpoint"]["host"] == "127.0.0.1"
    assert card["kvPublishEndpoints"], "the sidecar bridges vLLM's KV events"


async def test_streamed_generation(aio_loop: Any, vllm_engine: VllmProc) -> None:
    with trio.fail_after(90):
        async with sidecar(vllm_engine.address) as sc:
            events, end = await run(sc.ws, request("stream-1", token_ids(1, 40), 24))
            assert end.outcome == "completed", end
            tokens = [t for e in events if e.token is not None for t in e.token.tokens]
            assert len(tokens) == 24 and all(0 <= t.token_id < 2048 for t in tokens)
            assert [e.token.output_index for e in events if e.token is not None] == [0] * sum(
                1 for e in events if e.token is not None
            )
            last = events[-1]
            assert last.finished is not None and last.finished.reason == "FINISH_REASON_LENGTH"
            assert last.usage.prompt_tokens == 40 and last.usage.completion_tokens == 24
            assert all(e.usage is None for e in events[:-1])
            # two outputs, a text prompt, greedy and seeded: both outputs finish, usage counts both
            text_req = {
                "requestId": "stream-2",
                "model": MODEL,
                "prompt": "Bakeno dafi, and the bakeno is dafi.",
                "sampling": {"numSequences": 2, "temperature": 0.8, "seed": "7"},
                "stopping": {"maxTokens": 5, "ignoreEos": True},
            }
            events, end = await run(sc.ws, text_req)
            assert end.outcome == "completed", end
            finished = [e.finished for e in events if e.finished is not None]
            assert sorted(f.output_index for f in finished) == [0, 1]
            assert events[-1].usage.completion_tokens == 10


async def test_cancel_mid_stream_frees_vllm_after_one_abort(aio_loop: Any, vllm_engine: VllmProc) -> None:
    rid = "cancel-mid-stream"
    with trio.fail_after(90):
        async with sidecar(vllm_engine.address) as sc:
            # 30 s for the end after the cancel (the client's default is 5): a fresh-clone CI saw
            # the sidecar's event loop starved for 4.8 s ("event loop stalled") while vLLM ran the
            # request on the 2-core machine; a starved machine is not this test's subject, and a
            # sidecar that never ends the stream still fails it.
            async with open_sidecar(sc.ws, cancel_timeout=30) as client:
                async with client.generate(request(rid, token_ids(2, 50), 1900)) as stream:
                    seen = 0
                    async for event in stream:
                        seen += event.response.token is not None
                        if seen == 3:
                            break  # leaving the block cancels the stream
                assert stream.end is not None and stream.end.outcome == "cancelled", stream.end
            await wait_request_gone(vllm_engine.address)  # vLLM's own stats: nothing running or waiting
        attrs = await attributes(vllm_engine.address)  # the sidecar has exited: no Abort still due
    assert attrs["aborts_by_request"].get(rid) == 1, attrs["aborts_by_request"]
    assert attrs["vllm_unfinished_requests"] == 0 and attrs["in_flight"] == 0


#: Tokens per stream in the drain test (~16 s of the tiny model for four; it allows 8192 in all).
DRAIN_TOKENS = 6000


async def test_drain_finishes_streams_in_flight(aio_loop: Any, vllm_engine: VllmProc) -> None:
    # Long streams: the late request must find the sidecar still draining. With 300 tokens
    # the tiny model had finished all four (drained 1 ms after SIGTERM, the sidecar gone)
    # before a CPU-starved test process sent it; the grace is far beyond their length.
    ends: list[Any] = []
    with trio.fail_after(240):
        async with sidecar(vllm_engine.address, "--drain-timeout", "180") as sc:
            started = trio.Semaphore(0)
            # 30 s of silence allowed: CI twice saw no frame for 10 s while vLLM ran four long
            # streams on a 2-core machine; a starved machine is not this test's subject, and a
            # sidecar that hangs still fails it (its streams do not complete).
            async with open_sidecar(sc.ws, keepalive_timeout=30) as client:

                async def one(i: int) -> None:
                    async with client.generate(
                        request(f"drain-{i}", token_ids(10 + i, 40), DRAIN_TOKENS)
                    ) as s:
                        first = True
                        async for _ in s:
                            if first:
                                started.release()
                                first = False
                    ends.append(s.end)

                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
                    for _ in range(4):
                        await started.acquire()
                    sc.proc.signal(signal.SIGTERM)
                    await sc.proc.wait_for_line(re.compile("draining"))
                    async with client.generate(request("drain-late", token_ids(20, 8), 4)) as late:
                        assert [e async for e in late] == []
                    assert late.end.outcome == "rejected" and late.end.error.code == "ERROR_CODE_DRAINING"
            assert await sc.proc.wait(timeout=200) == 0
    assert [e.outcome for e in ends] == ["completed"] * 4, ends
    attrs = await wait_request_gone(vllm_engine.address)
    assert all(f"drain-{i}" not in attrs["aborts_by_request"] for i in range(4))


def stored(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored"]


def covering(events: list[dict[str, Any]], ids: list[int]) -> list[dict[str, Any]]:
    """The BlockStored events whose tokens are a block-aligned slice of ``ids``."""
    out = []
    for e in stored(events):
        toks = list(e["token_ids"])
        for start in range(0, len(ids) - len(toks) + 1, BLOCK):
            if toks and ids[start : start + len(toks)] == toks:
                out.append({**e, "start": start})
                break
    return out


async def test_kv_bridge_republishes_vllm_events_with_shared_prefix(
    aio_loop: Any, vllm_engine: VllmProc
) -> None:
    prefix = token_ids(30, 2 * BLOCK)
    first = prefix + token_ids(31, BLOCK + 8)
    second = prefix + token_ids(32, BLOCK + 8)
    with trio.fail_after(120):
        async with sidecar(vllm_engine.address) as sc, httpx.AsyncClient() as http:
            m = await sc.proc.wait_for_line(KV_BRIDGED)
            (source,) = (await http.get(sc.http + "/v1/worker", timeout=10)).json()["kvEventSources"]
            engine_pub = "tcp://{host}:{port}".format(**source["endpoint"])
            direct_consumer = Consumer(engine_pub, source["replayEndpoint"])
            async with Consumer(m.group(1), m.group(2)) as bridged, direct_consumer as direct:
                _, end1 = await run(sc.ws, request("kv-first", first, 1))
                events2, end2 = await run(sc.ws, request("kv-second", second, 1))
                assert end1.outcome == end2.outcome == "completed"
                assert events2[-1].usage.cached_prompt_tokens == 2 * BLOCK  # the prefix was cached

                def both_seen(received: list[Any]) -> bool:
                    events = [e for r in received for e in r.events]
                    return len(covering(events, first)) >= 1 and len(covering(events, second)) >= 1

                await bridged.collect(both_seen)
                await direct.collect(both_seen)
    out_events = [e for r in bridged.received for e in r.events]
    a = {e["start"]: e for e in covering(out_events, first)}
    b = {e["start"]: e for e in covering(out_events, second)}
    # the first request stored the prefix and its own third block; the second only its third block,
    # chained to the prefix's last block (the prefix was not stored twice)
    hashes_a = [h for start in sorted(a) for h in a[start]["block_hashes"]]
    assert len(hashes_a) == 3, a
    assert min(b) == 2 * BLOCK and len(b[2 * BLOCK]["block_hashes"]) == 1, b
    assert b[2 * BLOCK]["parent_block_hash"] == hashes_a[1]
    assert all(e["medium"] == "GPU" and e["block_size"] == BLOCK for e in a.values())
    # what the bridge published is what vLLM published
    in_events = [e for r in direct.received for e in r.events]
    for ids in (first, second):
        src = {e["start"]: (e["block_hashes"], e["parent_block_hash"]) for e in covering(in_events, ids)}
        out = {e["start"]: (e["block_hashes"], e["parent_block_hash"]) for e in covering(out_events, ids)}
        assert src == out

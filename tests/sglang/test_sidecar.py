"""The sidecar in front of real SGLang (``sglang-engine`` on the tiny model), real processes end to end.

Worker card from SGLang's own configuration; streamed generation; a cancel mid-stream that leaves
nothing in SGLang (its tokenizer manager's request table, its scheduler's load) after exactly
one Abort; SGLang's real KV events through the sidecar's bridge, read by an independent
subscriber next to one reading SGLang's own publisher: every field of every event the same.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import msgspec
import trio
import zmq

from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import sidecar
from tests.kvbridge.fake_zmq_engine import zrecv
from tests.sglang.harness import MAX_TOTAL_TOKENS, MODEL, PAGE, attributes, wait_request_gone
from tests.vllm.harness import EngineProc, token_ids

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


async def test_worker_card_is_sglangs_own_configuration(aio_loop: Any, sglang_engine: EngineProc) -> None:
    with trio.fail_after(60):
        async with sidecar(sglang_engine.address) as sc, httpx.AsyncClient() as http:
            card = (await http.get(sc.http + "/v1/worker", timeout=10)).json()
    assert card["engine"]["name"] == "sglang" and card["engine"]["version"] == "0.5.23"
    assert card["role"] == "aggregated" and card["dpRanks"] == [0] and card["problems"] == []
    capacity = card["capacity"]
    assert capacity["kvBlockSize"] == PAGE and int(capacity["totalKvBlocks"]) == MAX_TOTAL_TOKENS // PAGE
    (model,) = card["models"]
    assert model["servedModelName"] == MODEL and model["supportsLora"] is False
    assert model["generation"]["supportsCacheSalt"] is True
    (source,) = card["kvEventSources"]
    assert source["transport"] == "zmq" and source["endpoint"]["host"] == "127.0.0.1"
    assert source["replayEndpoint"].startswith("tcp://127.0.0.1:")
    assert card["kvPublishEndpoints"], "the sidecar bridges SGLang's KV events"


async def test_streamed_generation(aio_loop: Any, sglang_engine: EngineProc) -> None:
    with trio.fail_after(90):
        async with sidecar(sglang_engine.address) as sc:
            events, end = await run(sc.ws, request("sg-stream-1", token_ids(101, 40), 12))
            assert end.outcome == "completed", end
            tokens = [t for e in events if e.token is not None for t in e.token.tokens]
            assert len(tokens) == 12 and all(0 <= t.token_id < 2048 for t in tokens)
            last = events[-1]
            assert last.finished is not None and last.finished.reason == "FINISH_REASON_LENGTH"
            assert last.usage.prompt_tokens == 40 and last.usage.completion_tokens == 12
            assert all(e.usage is None for e in events[:-1])
            # two outputs (SGLang's parallel sampling), a text prompt: both finish, usage counts both
            text_req = {
                "requestId": "sg-stream-2",
                "model": MODEL,
                "prompt": "Bakeno dafi, and the bakeno is dafi.",
                "sampling": {"numSequences": 2, "temperature": 0.8},
                "stopping": {"maxTokens": 5, "ignoreEos": True},
            }
            events, end = await run(sc.ws, text_req)
            assert end.outcome == "completed", end
            finished = [e.finished for e in events if e.finished is not None]
            assert sorted(f.output_index for f in finished) == [0, 1]
            assert events[-1].usage.completion_tokens == 10


async def test_cancel_mid_stream_frees_sglang_after_one_abort(
    aio_loop: Any, sglang_engine: EngineProc
) -> None:
    rid = "sg-cancel-mid-stream"
    with trio.fail_after(90):
        async with sidecar(sglang_engine.address) as sc:
            async with open_sidecar(sc.ws, cancel_timeout=30) as client:
                async with client.generate(request(rid, token_ids(102, 50), 4000)) as stream:
                    seen = 0
                    async for event in stream:
                        seen += event.response.token is not None
                        if seen == 3:
                            break  # leaving the block cancels the stream
                assert stream.end is not None and stream.end.outcome == "cancelled", stream.end
            await wait_request_gone(sglang_engine.address)  # SGLang's own table and load: nothing left
        attrs = await attributes(sglang_engine.address)  # the sidecar has exited: no Abort still due
    assert attrs["aborts_by_request"].get(rid) == 1, attrs["aborts_by_request"]
    assert attrs["sglang_held_requests"] == 0 and attrs["in_flight"] == 0
    assert attrs["outcomes"].get("aborted", 0) + attrs["outcomes"].get("cancelled", 0) >= 1


class Subscriber:
    """An independent ZMQ subscriber: every published batch as decoded msgpack, nothing checked."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.events: list[dict[str, Any]] = []

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    async def collect(self, until: Any) -> None:
        while not until(self.events):
            frames = await zrecv(self.sub)
            _ts, events, _rank = msgspec.msgpack.decode(frames[-1])
            self.events.extend(events)


def stored_covering(events: list[dict[str, Any]], ids: list[int]) -> list[dict[str, Any]]:
    """The BlockStored events whose tokens are a block-aligned slice of ``ids``."""
    out = []
    for e in events:
        toks = list(e.get("token_ids") or ())
        if e["type"] != "BlockStored" or not toks:
            continue
        if any(ids[s : s + len(toks)] == toks for s in range(0, len(ids) - len(toks) + 1, PAGE)):
            out.append(e)
    return out


async def test_kv_bridge_passes_sglangs_events_through_unchanged(
    aio_loop: Any, sglang_engine: EngineProc
) -> None:
    prefix = token_ids(130, 2 * PAGE)
    first = prefix + token_ids(131, PAGE + 4)
    second = prefix + token_ids(132, PAGE + 4)
    with trio.fail_after(120):
        async with sidecar(sglang_engine.address) as sc, httpx.AsyncClient() as http:
            m = await sc.proc.wait_for_line(KV_BRIDGED)
            (source,) = (await http.get(sc.http + "/v1/worker", timeout=10)).json()["kvEventSources"]
            direct = Subscriber("tcp://{host}:{port}".format(**source["endpoint"]))
            bridged = Subscriber(m.group(1))
            try:
                await trio.sleep(0.5)  # ZMQ's slow joiner: what is published before the SUBs join is lost
                _, end1 = await run(sc.ws, request("sg-kv-first", first, 1))
                events2, end2 = await run(sc.ws, request("sg-kv-second", second, 1))
                assert end1.outcome == end2.outcome == "completed"
                assert events2[-1].usage.cached_prompt_tokens == 2 * PAGE  # the prefix was cached

                def both(events: list[dict[str, Any]]) -> bool:
                    return bool(stored_covering(events, first)) and bool(stored_covering(events, second))

                await direct.collect(both)
                await bridged.collect(both)
            finally:
                direct.close()
                bridged.close()
    for ids in (first, second):
        src = stored_covering(direct.events, ids)
        out = stored_covering(bridged.events, ids)
        assert out == src, (out, src)  # every field, signed hashes included, as SGLang sent it
    stored = stored_covering(direct.events, first)
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert len(hashes) == 3 and all(e["block_size"] == PAGE and e["medium"] == "GPU" for e in stored)
    (after,) = stored_covering(direct.events, second)  # only its own block, chained to the prefix
    assert after["parent_block_hash"] == hashes[1] and len(after["block_hashes"]) == 1

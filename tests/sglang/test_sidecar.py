"""The sidecar in front of real SGLang (``sglang-engine`` on the tiny model), real processes end to end.

Worker card from SGLang's own configuration; streamed generation; a cancel mid-stream that leaves
nothing in SGLang (its tokenizer manager's request table, its scheduler's load) after exactly
one Abort; SGLang's real KV events through the sidecar's bridge, read by an independent
subscriber next to one reading SGLang's own publisher: every field of every event the same.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import zmq

from tests import real_engines
from tests.e2e.harness import sidecar
from tests.kvbridge.fake_zmq_engine import zrecv
from tests.real_engines import EngineProc, request, run, token_ids
from tests.sglang.harness import IDLE, MAX_TOTAL_TOKENS, PAGE


async def test_worker_card_is_sglangs_own_configuration(aio_loop: Any, sglang_engine: EngineProc) -> None:
    card = await real_engines.worker_card(sglang_engine.address)
    real_engines.check_card(card, "sglang", "0.5.23")
    capacity = card["capacity"]
    assert capacity["kvBlockSize"] == PAGE and int(capacity["totalKvBlocks"]) == MAX_TOTAL_TOKENS // PAGE
    assert card["kvEventSources"][0]["replayEndpoint"].startswith("tcp://127.0.0.1:")


async def test_streamed_generation(aio_loop: Any, sglang_engine: EngineProc) -> None:
    # the second request: two outputs (SGLang's parallel sampling), a text prompt
    rids = ("sg-stream-1", "sg-stream-2")
    await real_engines.check_streamed_generation(
        sglang_engine.address, rids, token_ids(101, 40), 12, {"temperature": 0.8}
    )


async def test_cancel_mid_stream_frees_sglang_after_one_abort(
    aio_loop: Any, sglang_engine: EngineProc
) -> None:
    ids = token_ids(102, 50)
    attrs = await real_engines.check_cancel_mid_stream(
        sglang_engine.address, "sg-cancel-mid-stream", ids, 4000, IDLE, "sglang_held_requests"
    )
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
    first, second = real_engines.shared_prefix_prompts(130, PAGE, 4)
    with trio.fail_after(120):
        async with sidecar(sglang_engine.address) as sc:
            bridged_pub, _, engine_pub, _ = await real_engines.kv_bridge_endpoints(sc)
            direct = Subscriber(engine_pub)
            bridged = Subscriber(bridged_pub)
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

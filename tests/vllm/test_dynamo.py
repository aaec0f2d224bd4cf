"""Dynamo worker mode over real vLLM: ``run --dynamo`` in front of ``vllm-engine``, Dynamo's real frontend.

The frontend tokenizes with the engine's model directory (the tiny model's tokenizer), vLLM
generates, the sidecar relays: completions and chat, streaming or not, carry exactly what the
WebSocket plane gives for the same token ids (greedy); a client that leaves mid-stream frees
the request in vLLM with one Abort. Then KV-aware routing across two vLLM engines: a prompt cached
on one engine outside Dynamo is known to Dynamo only through vLLM's own KV events (engine →
sidecar bridge → Dynamo's relay → event plane), and the frontend's ``--router-mode kv`` sends the
prompt (plus a suffix), and its repeats, to that engine. File discovery, tcp request plane, zmq
event plane (``tests.dynamo.planes``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import dynamo_env, dynamo_sidecar, encode, frontend
from tests.dynamo.routing import scores_of, words
from tests.e2e.harness import eventually
from tests.real_engines import attributes, check_worker_through_dynamo, ws_ids
from tests.vllm.harness import BLOCK, IDLE, MODEL, VllmProc

pytestmark = pytest.mark.dynamo  # and vllm, as everything under tests/vllm


async def test_vllm_worker_through_dynamo(aio_loop: Any, tmp_path: Path, vllm_engine: VllmProc) -> None:
    await check_worker_through_dynamo(
        vllm_engine,
        tmp_path,
        max_tokens=12,
        long_tokens=1500,
        chat=True,
        idle=IDLE,
        held="vllm_unfinished_requests",
    )


async def make_router(cls: Any, endpoint: Any, config: Any) -> Any:
    return cls(endpoint, BLOCK, config)


async def test_kv_routing_across_two_vllm_engines(
    aio_loop: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vllm_engine: VllmProc,
    vllm_engine_b: VllmProc,
) -> None:
    import trio_asyncio
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    tok = vllm_engine.model
    engines = [vllm_engine, vllm_engine_b]
    with trio.fail_after(240):
        async with (
            dynamo_sidecar(tmp_path, vllm_engine.address, name="s0") as s0,
            dynamo_sidecar(tmp_path, vllm_engine_b.address, name="s1") as s1,
            frontend(tmp_path, "--router-mode", "kv") as fe,
        ):
            for key, value in dynamo_env(tmp_path).items():
                monkeypatch.setenv(key, value)  # this process joins the deployment as an observer
            await fe.wait_models(MODEL, timeout=60)
            runtime = DistributedRuntime(aio_loop, "file", "tcp", event_plane="zmq")
            try:
                endpoint = runtime.endpoint("dynamo.backend.generate")
                router = await trio_asyncio.aio_as_trio(make_router)(KvRouter, endpoint, KvRouterConfig())

                async def overlap(ids: list[int]) -> dict[int, int]:
                    return scores_of(await trio_asyncio.aio_as_trio(router.get_overlap_scores)(ids))

                async def served() -> list[int]:
                    return [int((await attributes(e.address))["requests_accepted"]) for e in engines]

                sidecars = [s0, s1]
                worker_of: dict[int, int] = {}
                for i in range(2):
                    target = i
                    prefix = words(100 + i, 200)
                    ids = encode(tok, prefix)
                    assert len(ids) >= 8 * BLOCK, len(ids)
                    assert not await overlap(ids)
                    await ws_ids(sidecars[target].ws, ids, 1)  # cached on the target, outside Dynamo

                    async def indexed(ids: list[int] = ids) -> dict[int, int]:
                        return await overlap(ids)

                    scores = await eventually(indexed, 20)  # vLLM -> bridge -> Dynamo relay -> event plane
                    assert len(scores) == 1 and min(scores.values()) >= len(ids) // BLOCK, scores
                    (worker,) = scores
                    assert worker_of.setdefault(target, worker) == worker
                    body = {
                        "model": MODEL,
                        "prompt": prefix + " ba be bi",
                        "max_tokens": 2,
                        "ignore_eos": True,
                    }

                    async def routed(body: dict[str, Any] = body) -> list[int]:
                        before = await served()
                        resp = await fe.http.post("/v1/completions", json=body)
                        assert resp.status_code == 200, resp.text
                        after = await served()
                        return [a - b for a, b in zip(after, before, strict=True)]

                    # the frontend's own indexer follows the event plane a moment after this
                    # process's did: the first request may still race it (bounded) ...
                    hit = [int(k == target) for k in range(2)]
                    await eventually(lambda hit=hit: _is(routed(), hit), 20)  # type: ignore[misc]
                    # ... from then on every request goes to the engine holding the prefix
                    for _ in range(3):
                        assert await routed() == hit, (
                            f"prompt {i} cached on engine {target} was routed elsewhere"
                        )
                assert len(set(worker_of.values())) == 2
            finally:
                runtime.shutdown()


async def _is(value: Awaitable[list[int]], expected: list[int]) -> bool:
    return await value == expected

"""Dynamo's KV router sees the engines' cache through the sidecars' KV events.

Two mock engines, each behind ``run --dynamo`` (KV relay on), and a frontend with
``--router-mode kv``, on etcd discovery, with the zmq and with the NATS event plane. A long prompt is first cached on one chosen engine *outside Dynamo*
(through that sidecar's WebSocket plane), so Dynamo can only know about it from the KV
events: engine → sidecar KV bridge → Dynamo ``KvEventPublisher`` (ZMQ relay) → event plane.
An independent Dynamo ``KvIndexer`` in the test process, subscribed to the same events as
the frontend's router, shows when they arrived (and that Dynamo's block hashes of the
frontend's tokens match them); then the prompt (plus a new suffix), and its repeats,
through the frontend must land on that engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import MODEL, dynamo_sidecar, encode, frontend, tokenizer_dir
from tests.dynamo.planes import deployment
from tests.dynamo.routing import make_router, scores_of, warm, words
from tests.e2e.harness import engine_counters, eventually, mock_engine

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


@pytest.mark.parametrize("event_plane", ["zmq", "nats"])
async def test_kv_router_routes_to_the_engine_holding_the_prefix(
    aio_loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, event_plane: str
) -> None:
    import trio_asyncio
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    tok = tokenizer_dir(tmp_path)
    engine_args = ["--flavor", "vllm", "--tokenizer-source", str(tok)]
    with trio.fail_after(150):
        async with (
            deployment(tmp_path, "tcp", event_plane) as dep,
            mock_engine(tmp_path, *engine_args, name="e0") as e0,
            mock_engine(tmp_path, *engine_args, name="e1") as e1,
            dynamo_sidecar(dep, e0.address, name="s0") as s0,
            dynamo_sidecar(dep, e1.address, name="s1") as s1,
            frontend(dep, "--router-mode", "kv") as fe,
        ):
            for key, value in dep.env().items():
                monkeypatch.setenv(key, value)  # this process joins the deployment as an observer
            await fe.wait_models(MODEL)
            runtime = DistributedRuntime(aio_loop, dep.discovery, dep.request_plane, event_plane=event_plane)
            try:
                # an independent KV router fed by the same KV events as the frontend's (queried only)
                endpoint = runtime.endpoint("dynamo.backend.generate")
                router = await trio_asyncio.aio_as_trio(make_router)(KvRouter, endpoint, KvRouterConfig())

                async def overlap(ids: list[int]) -> dict[int, int]:
                    reply = await trio_asyncio.aio_as_trio(router.get_overlap_scores)(ids)
                    return scores_of(reply)

                engines, sidecars = [e0, e1], [s0, s1]
                worker_of: dict[int, int] = {}  # engine index -> Dynamo worker id

                async def served() -> list[int]:
                    return [int((await engine_counters(e.address))["requests_accepted"]) for e in engines]

                for i in range(4):
                    target = i % 2
                    prefix = words(i, 160)  # 10 blocks of 16 tokens
                    ids = encode(tok, prefix)
                    assert not await overlap(ids)
                    await warm(sidecars[target].ws, ids)

                    async def indexed(ids: list[int] = ids) -> dict[int, int]:
                        return await overlap(ids)

                    scores = await eventually(indexed, 10)  # engine -> bridge -> Dynamo relay -> event plane
                    assert len(scores) == 1 and min(scores.values()) >= len(ids) // 16, scores
                    (worker,) = scores
                    assert worker_of.setdefault(target, worker) == worker
                    for _ in range(3):  # the long prompt, and its repeats, land on the engine holding it
                        before = await served()
                        await fe.complete(prefix + " ba be bi", max_tokens=2, ignore_eos=True)
                        after = await served()
                        assert [a - b for a, b in zip(after, before, strict=True)] == [
                            int(k == target) for k in range(2)
                        ], f"prompt {i} cached on engine {target} was routed elsewhere"
                assert len(set(worker_of.values())) == 2
            finally:
                runtime.shutdown()

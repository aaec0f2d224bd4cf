"""NATS restarted under a KV-routed deployment (NATS event plane): KV events resume and the
router's view of every engine's cache is right again afterwards — also for cache changes
made while NATS was down.

Two mock engines behind ``run --dynamo`` sidecars, a frontend with ``--router-mode kv``, and
an observer ``KvRouter`` in the test process subscribed to the same events. Prompts are cached
on a chosen engine through its sidecar's WebSocket plane (outside Dynamo), so Dynamo can learn
about them only from the KV events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import MODEL, dynamo_sidecar, encode, frontend, tokenizer_dir
from tests.dynamo.planes import deployment
from tests.dynamo.routing import make_router, scores_of, warm, words
from tests.e2e.harness import eventually, mock_engine

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


async def test_nats_restart_kv_events_resume_and_the_view_resyncs(
    aio_loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_asyncio
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    tok = tokenizer_dir(tmp_path)
    engine_args = ["--flavor", "vllm", "--tokenizer-source", str(tok)]
    with trio.fail_after(200):
        async with (
            deployment(tmp_path, "tcp", "nats") as dep,
            mock_engine(tmp_path, *engine_args, name="e0") as e0,
            mock_engine(tmp_path, *engine_args, name="e1") as e1,
            dynamo_sidecar(dep, e0.address, name="s0") as s0,
            dynamo_sidecar(dep, e1.address, name="s1") as s1,
            frontend(dep, "--router-mode", "kv") as fe,
        ):
            assert dep.nats is not None
            for key, value in dep.env().items():
                monkeypatch.setenv(key, value)
            await fe.wait_models(MODEL)
            runtime = DistributedRuntime(aio_loop, dep.discovery, dep.request_plane, event_plane="nats")
            try:
                endpoint = runtime.endpoint("dynamo.backend.generate")
                router = await trio_asyncio.aio_as_trio(make_router)(KvRouter, endpoint, KvRouterConfig())

                async def overlap(ids: list[int]) -> dict[int, int]:
                    return scores_of(await trio_asyncio.aio_as_trio(router.get_overlap_scores)(ids))

                sidecars = [s0, s1]
                prompts = {name: encode(tok, words(i, 160)) for i, name in enumerate("ABCD")}

                async def cached(name: str, target: int) -> dict[int, int]:
                    ids = prompts[name]
                    await warm(sidecars[target].ws, ids)

                    async def seen() -> dict[int, int]:
                        return await overlap(ids)

                    return await eventually(seen, 20)

                a = await cached("A", 0)
                t0 = trio.current_time()
                await dep.nats.server.stop()
                await warm(s0.ws, prompts["C"])  # cached while the event plane is down
                await trio.sleep(2)  # the outage (a fault the test injects, not a wait for state)
                await dep.nats.server.start()
                # events resume: a change made once NATS is back reaches the router. The first may
                # be published before the worker's relay has reconnected (core NATS keeps no
                # history), so a new one is made until one arrives (bounded)
                b: dict[int, int] = {}
                for attempt in range(6):
                    prompts[f"B{attempt}"] = encode(tok, words(10 + attempt, 160))
                    with trio.move_on_after(5):
                        b = await cached(f"B{attempt}", 1)
                    if b:
                        break
                assert b, "no KV event reached the router 30 s after NATS came back"
                resumed = trio.current_time() - t0
                print(f"NATS restarted: events flow again {resumed:.1f}s after it went down")

                # the change made on s0 during the outage: the router learns it from s0's
                # worker-local indexer once it sees s0's event numbers jump, at s0's next change
                # (no event is delivered twice, so nothing else re-sends it)
                prompts["D"] = encode(tok, words(30, 160))
                await warm(s0.ws, prompts["D"])

                async def c_known() -> dict[int, int]:
                    return await overlap(prompts["C"])

                c = await eventually(c_known, 30)
                print(
                    f"NATS restarted: the change made during the outage known after {trio.current_time() - t0:.1f}s"
                )
                assert set(c) == set(a) and set(b) != set(a), (a, b, c)
            finally:
                runtime.shutdown()

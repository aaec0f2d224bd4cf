"""Worker modes of the ``vllm`` scenario: the same streams through the sidecar and directly (``EngineClient``).

Both run ``streams`` concurrent greedy requests of ``tokens`` tokens each on seeded random
token-id prompts that bypass vLLM's prefix cache (so the two modes do the same work), and
record, per stream, when the request was sent and when each token event arrived. Results:
TTFT and inter-token gaps (ms), tokens, wall time and the CPU seconds of every sampled process.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import trio

from sidecar.bench.north_load import latency_figures


def prompts(spec: dict[str, Any]) -> list[list[int]]:
    """One prompt of ``prompt_tokens`` ids (1000-1999) per stream, from the run's seed."""
    rng = random.Random(spec["seed"])
    return [[rng.randrange(1000, 2000) for _ in range(spec["prompt_tokens"])] for _ in range(spec["streams"])]


def north_request(spec: dict[str, Any], i: int, ids: list[int]) -> dict[str, Any]:
    """The proto3-JSON request of stream ``i`` (the direct client sends the same fields)."""
    return {
        "requestId": f"{spec['nonce']}-{i}",
        "model": spec["model"],
        "tokenIds": {"ids": ids},
        "sampling": {"temperature": 0.0},
        "stopping": {"maxTokens": spec["tokens"], "ignoreEos": True},
        "kv": {"bypassPrefixCache": True},
    }


def _figures(
    spec: dict[str, Any],
    sent: list[int],
    recv: list[list[int]],
    tokens: int,
    seconds: float,
    cpu_s: dict[str, float],
) -> dict[str, Any]:
    out = latency_figures(sent, recv, [[] for _ in recv])
    out.pop("oneway_ms", None)
    out.update(streams=spec["streams"], tokens=tokens, seconds=seconds, cpu_s=cpu_s)
    out["tokens_per_s"] = tokens / seconds if seconds > 0 else float("nan")
    return out


async def through_sidecar(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    from sidecar.client.sidecar_client import open_sidecar

    ids = prompts(spec)
    n = spec["streams"]
    sent = [0] * n
    recv: list[list[int]] = [[] for _ in range(n)]
    counts = [0] * n
    async with open_sidecar(spec["url"]) as client:

        async def one(i: int) -> None:
            sent[i] = time.time_ns()
            async with client.generate(north_request(spec, i, ids[i])) as stream:
                async for event in stream:
                    token = event.response.token
                    if token is not None:
                        recv[i].append(time.time_ns())
                        counts[i] += len(token.tokens)
            stream.check()

        cpu0, t0 = cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        t1, cpu1 = time.perf_counter(), cpu()
    return _figures(spec, sent, recv, sum(counts), t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0})


async def direct(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    import trio_asyncio

    from sidecar.openengine import pb
    from sidecar.openengine.client import open_engine_client

    ids = prompts(spec)
    n = spec["streams"]
    sent = [0] * n
    recv: list[list[int]] = [[] for _ in range(n)]
    counts = [0] * n
    async with trio_asyncio.open_loop(), open_engine_client(spec["engine"]) as client:

        async def one(i: int) -> None:
            req = pb.GenerateRequest(
                request_id=f"{spec['nonce']}-{i}",
                model=spec["model"],
                token_ids=pb.TokenIds(ids=ids[i]),
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=spec["tokens"], ignore_eos=True),
                kv=pb.KvOptions(bypass_prefix_cache=True),
            )
            sent[i] = time.time_ns()
            async with client.generate(req) as stream:
                async for event in stream:
                    if event.token is not None:
                        recv[i].append(time.time_ns())
                        counts[i] += len(event.token.tokens)

        cpu0, t0 = cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        t1, cpu1 = time.perf_counter(), cpu()
    return _figures(spec, sent, recv, sum(counts), t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0})

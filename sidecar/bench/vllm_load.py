"""Worker modes of the ``vllm`` scenario: the same streams through the sidecar and directly (``EngineClient``).

Both run ``streams`` concurrent greedy requests of ``tokens`` tokens each on seeded random
token-id prompts that bypass vLLM's prefix cache (so the two modes do the same work), and
record, per stream, when the request was sent and when each token event arrived. Results:
TTFT and inter-token gaps (ms), tokens, wall time and the CPU seconds of every sampled process.
Each reports ``armed`` once connected and starts its streams on the orchestrator's ``go``, so
the two halves of a round start together.
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


async def warm(one_token: Callable[[int], Any], n: int = 4) -> None:
    """``n`` one-token requests at once, unrecorded (connections open, paths warm)."""
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one_token, i)


def _figures(
    spec: dict[str, Any],
    sent: list[int],
    recv: list[list[int]],
    tokens: int,
    seconds: float,
    cpu_s: dict[str, float],
) -> dict[str, Any]:
    out = latency_figures(sent, recv, [[""] * len(times) for times in recv])  # no engine stamps
    out.pop("oneway_ms", None)
    out.update(streams=spec["streams"], tokens=tokens, seconds=seconds, cpu_s=cpu_s)
    out["tokens_per_s"] = tokens / seconds if seconds > 0 else float("nan")
    return out


async def through_sidecar(
    spec: dict[str, Any], cpu: Callable[[], dict[str, float]], armed: Callable[[dict[str, Any]], Any]
) -> dict[str, Any]:
    from sidecar.client.sidecar_client import open_sidecar

    ids = prompts(spec)
    n = spec["streams"]
    sent = [0] * n
    recv: list[list[int]] = [[] for _ in range(n)]
    counts = [0] * n
    async with open_sidecar(spec["url"]) as client:

        async def one_token(i: int) -> None:
            req = {**north_request(spec, i, ids[i]), "requestId": f"{spec['nonce']}-warm{i}"}
            req["stopping"] = {"maxTokens": 1, "ignoreEos": True}
            async with client.generate(req) as stream:
                async for _ in stream:
                    pass
            stream.check()

        async def one(i: int) -> None:
            sent[i] = time.time_ns()
            async with client.generate(north_request(spec, i, ids[i])) as stream:
                async for event in stream:
                    token = event.response.token
                    if token is not None:
                        recv[i].append(time.time_ns())
                        counts[i] += len(token.tokens)
            stream.check()

        await warm(one_token)  # a first request opens every connection on this path
        await armed({})  # connected; the orchestrator starts both halves at once
        cpu0, t0 = cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        t1, cpu1 = time.perf_counter(), cpu()
    return _figures(spec, sent, recv, sum(counts), t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0})


async def direct(
    spec: dict[str, Any], cpu: Callable[[], dict[str, float]], armed: Callable[[dict[str, Any]], Any]
) -> dict[str, Any]:
    from sidecar.openengine import pb
    from sidecar.openengine.client import open_engine_client

    ids = prompts(spec)
    n = spec["streams"]
    sent = [0] * n
    recv: list[list[int]] = [[] for _ in range(n)]
    counts = [0] * n

    def request(i: int, label: str, max_tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=f"{spec['nonce']}-{label}{i}",
            model=spec["model"],
            token_ids=pb.TokenIds(ids=ids[i]),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
            kv=pb.KvOptions(bypass_prefix_cache=True),
        )

    async with open_engine_client(spec["engine"]) as client:

        async def one_token(i: int) -> None:
            async with client.generate(request(i, "warm", 1)) as stream:
                async for _ in stream:
                    pass

        async def one(i: int) -> None:
            req = request(i, "", spec["tokens"])
            sent[i] = time.time_ns()
            async with client.generate(req) as stream:
                async for event in stream:
                    if event.token is not None:
                        recv[i].append(time.time_ns())
                        counts[i] += len(event.token.tokens)

        await warm(one_token)  # a first request opens every connection on this path
        await armed({})  # connected; the orchestrator starts both halves at once
        cpu0, t0 = cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        t1, cpu1 = time.perf_counter(), cpu()
    return _figures(spec, sent, recv, sum(counts), t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0})

"""Worker modes of the ``openai`` scenario: streamed completions through an OpenAI front
(the sidecar's, or ``vllm serve``'s), and the same streams read directly with ``EngineClient``.

Each run is a closed loop at a concurrency: ``streams`` clients, each sending ``requests``
streams of ``tokens`` tokens (EOS ignored) one after the other, starting at seeded random
offsets within ``ramp_s``; per stream the send time and the arrival of every token. The front's client is lean (httpx,
SSE split by hand, one JSON decode per chunk), so it measures the front, not the client
library. Results: TTFT and inter-token gap percentiles (ms), tokens, wall time, tokens/s and the
CPU seconds of every sampled process. One warm-up wave of one-token requests comes first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from sidecar.bench.north_load import latency_figures


def _figures(
    spec: dict[str, Any], sent: list[int], recv: list[list[int]], seconds: float, cpu_s: dict[str, float]
) -> dict[str, Any]:
    out = latency_figures(sent, recv, [[""] * len(times) for times in recv])  # no engine stamps
    out.pop("oneway_ms", None)
    tokens = sum(len(times) for times in recv)
    out.update(streams=spec["streams"], tokens=tokens, seconds=seconds, cpu_s=cpu_s)
    out["tokens_per_s"] = tokens / seconds if seconds > 0 else float("nan")
    out["short_streams"] = sum(1 for times in recv if len(times) < spec["tokens"])
    return out


#: One stream: (index, tokens, send times, arrival times); a negative index is a warm-up.
Stream = Callable[[int, int, list[int], list[list[int]]], Awaitable[None]]


async def _closed_loop(
    spec: dict[str, Any], cpu: Callable[[], dict[str, float]], one: Stream
) -> dict[str, Any]:
    """``streams`` clients, each sending ``requests`` streams one after the other, the clients
    starting at seeded random offsets within ``ramp_s`` (so requests do not arrive in lockstep)."""
    n, per = spec["streams"], spec.get("requests", 1)
    sent = [0] * (n * per)
    recv: list[list[int]] = [[] for _ in range(n * per)]
    async with trio.open_nursery() as nursery:  # warm-up: every connection open, paths hot
        for i in range(n):
            none: list[list[int]] = [[]]
            nursery.start_soon(one, -1 - i, 1, [0], none)
    rng = random.Random(spec.get("seed", 5))
    offsets = [rng.uniform(0, spec.get("ramp_s", 0.0)) if n > 1 else 0.0 for _ in range(n)]

    async def client(k: int, start: float) -> None:
        await trio.sleep_until(start)
        for j in range(per):
            await one(k * per + j, spec["tokens"], sent, recv)

    cpu0, t0 = cpu(), time.perf_counter()
    now = trio.current_time()
    async with trio.open_nursery() as nursery:
        for k, offset in enumerate(offsets):
            nursery.start_soon(client, k, now + offset)
    t1, cpu1 = time.perf_counter(), cpu()
    return _figures(spec, sent, recv, t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0})


_chunk = msgspec.json.Decoder()


async def through_front(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Streamed ``/v1/completions`` at ``spec["url"]`` (an OpenAI base URL)."""
    import httpx

    n = spec["streams"]
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=spec["url"], limits=limits, timeout=300) as http:

        async def one(i: int, tokens: int, sent: list[int], recv: list[list[int]]) -> None:
            body = {
                "model": spec["model"],
                "prompt": spec.get("prompt", "Hello"),
                "max_tokens": tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
            }
            slot = recv[i] if i >= 0 else []
            if i >= 0:
                sent[i] = time.time_ns()
            async with http.stream("POST", "/completions", json=body) as response:
                response.raise_for_status()
                buffer = b""
                async for data in response.aiter_bytes():
                    now = time.time_ns()
                    buffer += data
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        payload = event.removeprefix(b"data: ")
                        if payload == b"[DONE]" or not payload:
                            continue
                        choices = _chunk.decode(payload).get("choices") or []
                        if choices and choices[0].get("text"):
                            slot.append(now)

        return await _closed_loop(spec, cpu, one)


async def engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """The same streams with ``EngineClient`` on the engine (``spec["engine"]``)."""
    from sidecar.openengine import pb
    from sidecar.openengine.client import open_engine_client

    async with open_engine_client(spec["engine"]) as client:

        async def one(i: int, tokens: int, sent: list[int], recv: list[list[int]]) -> None:
            req = pb.GenerateRequest(
                request_id=f"{spec['nonce']}-{i}",
                model=spec["model"],
                prompt=spec.get("prompt", "Hello"),
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=tokens, ignore_eos=True),
            )
            slot = recv[i] if i >= 0 else []
            if i >= 0:
                sent[i] = time.time_ns()
            async with client.generate(req) as stream:
                async for ev in stream:
                    if ev.token is not None and ev.token.text:
                        slot.append(time.time_ns())

        return await _closed_loop(spec, cpu, one)

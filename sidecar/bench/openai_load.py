"""Worker modes of the ``openai`` scenario: streamed completions through an OpenAI front
(the sidecar's, or ``vllm serve``'s), and the same streams read directly with ``EngineClient``.

Each run is a closed loop at a concurrency: ``streams`` clients, each sending ``requests``
streams of ``tokens`` tokens (EOS ignored) one after the other, starting at seeded random
offsets within ``ramp_s``; per stream the send time and the arrival of every token. The
front's client is lean (keep-alive HTTP/1.1 written by hand on a trio stream, one JSON decode
per SSE event), so it measures the front, not a client library. Results: TTFT and inter-token
gap percentiles (ms), tokens, wall time, tokens/s and the CPU seconds of every sampled process.
One warm-up wave of one-token requests comes first.
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
    spec: dict[str, Any],
    sent: list[int],
    recv: list[list[int]],
    counts: list[int],
    seconds: float,
    cpu_s: dict[str, float],
) -> dict[str, Any]:
    out = latency_figures(sent, recv, [[""] * len(times) for times in recv])  # no engine stamps
    out.pop("oneway_ms", None)
    tokens = sum(counts)
    out.update(streams=spec["streams"], tokens=tokens, seconds=seconds, cpu_s=cpu_s)
    out["tokens_per_s"] = tokens / seconds if seconds > 0 else float("nan")
    out["short_streams"] = sum(1 for n in counts if n < spec["tokens"])
    return out


#: One stream: (index, tokens, send times, arrival times of text, tokens received); a negative
#: index is a warm-up. A text event may carry several tokens (an engine behind on its client).
Stream = Callable[[int, int, list[int], list[list[int]], list[int]], Awaitable[None]]


async def _closed_loop(
    spec: dict[str, Any], cpu: Callable[[], dict[str, float]], one: Stream
) -> dict[str, Any]:
    """``streams`` clients, each sending ``requests`` streams one after the other, the clients
    starting at seeded random offsets within ``ramp_s`` (so requests do not arrive in lockstep)."""
    n, per = spec["streams"], spec.get("requests", 1)
    sent = [0] * (n * per)
    recv: list[list[int]] = [[] for _ in range(n * per)]
    counts = [0] * (n * per)
    async with trio.open_nursery() as nursery:  # warm-up: every connection open, paths hot
        for i in range(n):
            none: list[list[int]] = [[]]
            nursery.start_soon(one, -1 - i, 1, [0], none, [0])
    rng = random.Random(spec.get("seed", 5))
    offsets = [rng.uniform(0, spec.get("ramp_s", 0.0)) if n > 1 else 0.0 for _ in range(n)]

    async def client(k: int, start: float) -> None:
        await trio.sleep_until(start)
        for j in range(per):
            await one(k * per + j, spec["tokens"], sent, recv, counts)

    cpu0, t0 = cpu(), time.perf_counter()
    now = trio.current_time()
    async with trio.open_nursery() as nursery:
        for k, offset in enumerate(offsets):
            nursery.start_soon(client, k, now + offset)
    t1, cpu1 = time.perf_counter(), cpu()
    return _figures(spec, sent, recv, counts, t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0})


_chunk = msgspec.json.Decoder()


class _Http11:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads a chunked SSE answer: the
    least a client can do, so the benchmark measures the front rather than a client library."""

    def __init__(self, stream: trio.abc.Stream, host: str, path: str) -> None:
        self.stream = stream
        self.head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        self.buffer = b""

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("the front closed the connection")
        self.buffer += data

    async def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            await self._more()
        line, self.buffer = self.buffer[:end], self.buffer[end + 2 :]
        return line

    async def post_sse(self, body: bytes, on_event: Callable[[bytes], None]) -> None:
        """POST ``body``; ``on_event`` gets each SSE event's data as its chunk arrives."""
        await self.stream.send_all(f"{self.head}content-length: {len(body)}\r\n\r\n".encode() + body)
        status = await self._line()
        if b" 200" not in status:
            raise ConnectionError(f"the front answered {status!r}")
        while await self._line():  # headers (the answer is chunked: the front streams it)
            pass
        pending = b""
        while True:
            size = int(await self._line(), 16)
            if size == 0:
                await self._line()
                return
            while len(self.buffer) < size + 2:
                await self._more()
            pending += self.buffer[:size]
            self.buffer = self.buffer[size + 2 :]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                on_event(event.removeprefix(b"data: "))


async def through_front(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Streamed ``/v1/completions`` at ``spec["url"]`` (an OpenAI base URL, ``http://``), one
    keep-alive connection per client."""
    from urllib.parse import urlsplit

    url = urlsplit(spec["url"])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    idle: list[_Http11] = []

    async def one(i: int, tokens: int, sent: list[int], recv: list[list[int]], counts: list[int]) -> None:
        body = msgspec.json.encode(
            {
                "model": spec["model"],
                "prompt": spec.get("prompt", "Hello"),
                "max_tokens": tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
        )
        slot = recv[i] if i >= 0 else []

        def on_event(data: bytes) -> None:
            if data != b"[DONE]":
                chunk = _chunk.decode(data)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    slot.append(time.time_ns())
                elif not choices and chunk.get("usage") and i >= 0:
                    counts[i] = chunk["usage"]["completion_tokens"]

        conn = (
            idle.pop()
            if idle
            else _Http11(await trio.open_tcp_stream(host, port), host, url.path + "/completions")
        )
        if i >= 0:
            sent[i] = time.time_ns()
        await conn.post_sse(body, on_event)
        idle.append(conn)

    try:
        return await _closed_loop(spec, cpu, one)
    finally:
        for conn in idle:
            await conn.stream.aclose()


async def engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """The same streams with ``EngineClient`` on the engine (``spec["engine"]``)."""
    from sidecar.openengine import pb
    from sidecar.openengine.client import open_engine_client

    async with open_engine_client(spec["engine"]) as client:

        async def one(i: int, tokens: int, sent: list[int], recv: list[list[int]], counts: list[int]) -> None:
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
                        if i >= 0:
                            counts[i] += len(ev.token.tokens) or 1

        return await _closed_loop(spec, cpu, one)

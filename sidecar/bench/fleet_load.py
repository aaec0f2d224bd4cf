"""The fleet-path load generator: OpenAI streaming completions through Dynamo's frontend.

Runs inside a worker process (``sidecar.bench.worker``, mode ``fleet``). Each request is a
streamed ``/v1/completions`` call on its **own** TCP connection: Dynamo's frontend does not
set ``TCP_NODELAY``, so on a kept-alive connection a small SSE chunk waits for the client's
delayed ACK (Nagle: ~40 ms) and TTFT would measure that instead of the worker. HTTP/1.1 is
spoken with h11 over a trio socket (little client CPU; the client is measured apart anyway).

TTFT = first SSE chunk carrying a choice, from just before the connection is opened; output
tokens = the final chunk's ``usage.completion_tokens`` (``stream_options.include_usage``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import h11
import msgspec
import trio

from sidecar.bench import stats


class FleetError(Exception):
    """A request through the frontend failed (status, malformed stream, closed early)."""


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[Any] = msgspec.field(default_factory=list)
    usage: _Usage | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


async def _exchange(
    url: str, method: str, path: str, body: bytes | None
) -> tuple[trio.SocketStream, h11.Connection]:
    """Open a connection and send one request (``Connection: close``)."""
    host, port = _host_port(url)
    sock = await trio.open_tcp_stream(host, port)
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", f"{host}:{port}"), ("connection", "close")]
    if body is not None:
        headers += [("content-type", "application/json"), ("content-length", str(len(body)))]
    out = conn.send(h11.Request(method=method, target=path, headers=headers))
    if body is not None:
        out += conn.send(h11.Data(data=body))
    out += conn.send(h11.EndOfMessage())
    await sock.send_all(out)
    return sock, conn


async def _events(sock: trio.SocketStream, conn: h11.Connection) -> Any:
    """h11 events of the response until its end (an async generator)."""
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(await sock.receive_some(65536))
            continue
        yield ev
        if isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
            return


async def get_json(url: str, path: str) -> tuple[int, Any]:
    """(status, parsed JSON body) of ``GET path`` (readiness checks)."""
    sock, conn = await _exchange(url, "GET", path, None)
    status, body = 0, b""
    async with sock:
        async for ev in _events(sock, conn):
            if isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                body += bytes(ev.data)
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


async def stream_completion(url: str, body: bytes) -> tuple[float, int]:
    """One streamed completion on a fresh connection: (TTFT s, output tokens)."""
    t0 = time.perf_counter()
    sock, conn = await _exchange(url, "POST", "/v1/completions", body)
    ttft = -1.0
    tokens = 0
    buf = b""
    status = 0
    async with sock:
        async for ev in _events(sock, conn):
            if isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                if status != 200:
                    buf += bytes(ev.data)
                    continue
                buf += bytes(ev.data)
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = _decode_chunk(line[6:])
                    if ttft < 0 and chunk.choices:
                        ttft = time.perf_counter() - t0
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
    if status != 200:
        raise FleetError(f"HTTP {status}: {buf[:300]!r}")
    if ttft < 0:
        raise FleetError("the stream carried no choice")
    return ttft, tokens


def completion_body(model: str, tokens: int, i: int, prompt_words: int = 20) -> bytes:
    """The request body: a ~60-token prompt made unique by ``i``, ``tokens`` output tokens."""
    prompt = f"{i} " + " ".join(["bako tu rive"] * prompt_words)
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def run_load(
    url: str,
    model: str,
    requests: int,
    concurrency: int,
    tokens: int,
    first: int = 0,
    rate: float | None = None,
) -> dict[str, Any]:
    """``requests`` completions; wall time, TTFTs, tokens, errors. Closed loop (``rate`` None):
    ``concurrency`` users, each sending its next request when the last ended. Open loop:
    request ``i`` starts at ``i / rate`` seconds, whatever is in flight (at most
    ``concurrency`` x 8 at once, a bound for a worker that stops answering)."""
    ttft: list[float] = []
    out_tokens = 0
    errors: list[str] = []
    next_i = iter(range(first, first + requests))

    async def one(i: int) -> None:
        nonlocal out_tokens
        try:
            t, n = await stream_completion(url, completion_body(model, tokens, i))
        except (FleetError, OSError, h11.ProtocolError) as err:
            errors.append(f"{type(err).__name__}: {err}"[:200])
            return
        ttft.append(t)
        out_tokens += n

    async def user() -> None:
        for i in next_i:
            await one(i)

    async def paced(nursery: trio.Nursery, rate: float) -> None:
        limit = trio.Semaphore(concurrency * 8)

        async def bounded(i: int) -> None:
            async with limit:
                await one(i)

        for k, i in enumerate(next_i):
            await trio.sleep_until(t0 + k / rate)  # the schedule of an open loop, not a wait for state
            nursery.start_soon(bounded, i)

    t0 = trio.current_time()
    w0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        if rate is None:
            for _ in range(concurrency):
                nursery.start_soon(user)
        else:
            nursery.start_soon(paced, nursery, rate)
    wall = time.perf_counter() - w0
    return {
        "requests": requests,
        "completed": len(ttft),
        "errors": len(errors),
        "error_samples": errors[:5],
        "seconds": wall,
        "out_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall if wall else 0.0,
        "requests_per_s": len(ttft) / wall if wall else 0.0,
        "ttft_ms": stats.summary(ttft, 1000),
        "rate": rate,
    }


async def fleet(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Worker mode ``fleet``: a warm-up, then the measured load with CPU sampled around it."""
    url, model = spec["url"], spec["model"]
    with trio.fail_after(spec.get("timeout_s", 300)):
        warm = await run_load(url, model, spec.get("warmup", 8), min(4, spec["concurrency"]), 8, first=10**6)
        if warm["errors"]:
            raise FleetError(f"warm-up through {model}: {warm['error_samples']}")
        cpu0 = cpu()
        res = await run_load(
            url, model, spec["requests"], spec["concurrency"], spec["tokens"], rate=spec.get("rate")
        )
        cpu1 = cpu()
    res["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
    return res

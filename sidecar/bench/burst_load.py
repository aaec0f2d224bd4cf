"""Burst clients: N streams released at the same instant, time to each one's first token.

Runs inside a worker process (modes ``burst-*``). Each worker opens its connections, warms
up, then releases ``bursts`` bursts of ``streams`` streams one after another (each once the
previous one has fully ended). TTFT of a stream = its first token's arrival minus the burst's
release instant (the client's own serialization of N requests is part of it, as for a real
client). Clients:

- ``burst-json``: a plain JSON WebSocket client — the ``websockets`` library (asyncio), one
  text frame per ``generate``, ``json.loads`` per message, no coalescing;
- ``burst-lean``: the benchmark's lean msgpack client (:mod:`sidecar.bench.north_load`),
  coalesced ``events`` frames on or off (``spec["coalesce"]``); a connection's requests
  leave in one write;
- ``burst-grpcio``: grpcio's asyncio API on the engine directly (the reference);
- ``burst-engineclient``: the sidecar's own upstream client on the engine directly.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import trio

from sidecar.bench.north_load import NorthConn, StreamState, Tracker, _Conns, north_request, warm_up


def _result(ttfts: list[float], ended: int, cpu0: dict[str, float], cpu1: dict[str, float]) -> dict[str, Any]:
    return {
        "ttft_ms": [t * 1000 for t in ttfts],
        "ended": ended,
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
    }


# --- through the sidecar: the lean msgpack client ------------------------------------------------


async def burst_lean(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    n, bursts, nconn = spec["streams"], spec["bursts"], spec["connections"]
    await warm_up(spec)
    tracker = Tracker()
    conns = _Conns(spec, tracker, record=False)
    request = north_request(spec, spec["tokens"])
    ttfts: list[float] = []
    ended = 0
    async with trio.open_nursery() as nursery:
        opened: list[NorthConn] = await conns.open(nursery, nconn)
        cpu0 = cpu()
        for b in range(bursts):
            states = [StreamState(b * n + i) for i in range(n)]
            frames: list[list[bytes | str]] = [[] for _ in opened]
            for st in states:
                conn = opened[st.id % nconn]
                conn.streams[st.id] = st
                frames[st.id % nconn].append(
                    conn.encode({"type": "generate", "stream": st.id, "request": request})
                )
            target = tracker.ended + n
            release = time.time_ns()
            for conn, batch in zip(opened, frames, strict=True):
                await conn.ws.send_many(batch)
            await tracker.wait_for(lambda target=target: tracker.ended >= target)  # type: ignore[misc]
            ended += sum(1 for st in states if st.outcome == "completed")
            ttfts.extend((st.first_ns - release) / 1e9 for st in states if st.first_ns)
        cpu1 = cpu()
        await conns.close_all()
    return _result(ttfts, ended, cpu0, cpu1)


# --- through the sidecar: a plain JSON client (websockets) -------------------------------------------


def burst_json(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    n, bursts, nconn = spec["streams"], spec["bursts"], spec["connections"]
    request = north_request(spec, spec["tokens"])

    async def main() -> dict[str, Any]:
        conns = [await connect(spec["url"], max_size=None) for _ in range(nconn)]
        first: dict[int, int] = {}
        pending: set[int] = set()
        done = asyncio.Event()
        completed = 0

        async def reader(ws: Any) -> None:
            nonlocal completed
            async for text in ws:
                msg = json.loads(text)
                kind, sid = msg.get("type"), msg.get("stream")
                if kind == "event":
                    if sid not in first and (msg.get("response") or {}).get("token") is not None:
                        first[sid] = time.time_ns()
                elif kind == "end":
                    pending.discard(sid)
                    completed += msg.get("outcome") == "completed"
                    if not pending:
                        done.set()

        readers = [asyncio.ensure_future(reader(ws)) for ws in conns]

        async def one_burst(base: int) -> int:
            done.clear()
            pending.update(range(base, base + n))
            release = time.time_ns()

            async def send(c: int) -> None:
                ws = conns[c]
                for sid in range(base + c, base + n, nconn):
                    await ws.send(json.dumps({"type": "generate", "stream": sid, "request": request}))

            await asyncio.gather(*(send(c) for c in range(nconn)))
            async with asyncio.timeout(120):
                await done.wait()
            return release

        await one_burst(10**6)  # warm-up
        ttfts: list[float] = []
        cpu0 = cpu()
        ok0 = completed
        for b in range(bursts):
            release = await one_burst(b * n)
            ttfts.extend((first[sid] - release) / 1e9 for sid in range(b * n, b * n + n) if sid in first)
        cpu1 = cpu()
        ended = completed - ok0
        for ws in conns:
            await ws.close()
        for r in readers:
            r.cancel()
        return _result(ttfts, ended, cpu0, cpu1)

    return asyncio.run(main())


# --- direct: grpcio + upb ---------------------------------------------------------------------------


def burst_grpcio(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    from sidecar.bench.direct_load import GrpcioClient

    n, bursts, nonce, m = spec["streams"], spec["bursts"], spec["nonce"], spec["tokens"]

    async def main() -> dict[str, Any]:
        client = GrpcioClient(spec)
        async with client.channel:

            async def one(rid: str) -> tuple[int, bool]:
                first = 0
                finished = False
                async for resp in client.stub.Generate(client.request(rid, m)):
                    if not first and resp.HasField("token"):
                        first = time.time_ns()
                    finished = finished or resp.HasField("finished")
                return first, finished

            async def one_burst(tag: str) -> tuple[int, list[tuple[int, bool]]]:
                release = time.time_ns()
                res = await asyncio.gather(*(one(f"{nonce}-{tag}-{i}") for i in range(n)))
                return release, list(res)

            await one_burst("w")
            ttfts: list[float] = []
            ended = 0
            cpu0 = cpu()
            for b in range(bursts):
                release, res = await one_burst(str(b))
                ttfts.extend((f - release) / 1e9 for f, _ in res if f)
                ended += sum(1 for _, ok in res if ok)
            cpu1 = cpu()
        return _result(ttfts, ended, cpu0, cpu1)

    return asyncio.run(main())


# --- direct: EngineClient -----------------------------------------------------------------------------


async def burst_engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    from sidecar.bench.direct_load import _request, _with_client

    n, bursts, nonce, m = spec["streams"], spec["bursts"], spec["nonce"], spec["tokens"]

    async def body(client: Any) -> dict[str, Any]:
        ttfts: list[float] = []
        ended = 0
        cpu0 = cpu()
        for b in range(bursts):
            first = [0] * n
            done = [False] * n

            async def one(i: int, first: list[int] = first, done: list[bool] = done, b: int = b) -> None:
                async with client.generate(_request(spec, f"{nonce}-{b}-{i}", m)) as stream:
                    async for ev in stream:
                        if not first[i] and ev.token is not None:
                            first[i] = time.time_ns()
                        if ev.finished is not None:
                            done[i] = True

            release = time.time_ns()
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            ttfts.extend((f - release) / 1e9 for f in first if f)
            ended += sum(done)
        cpu1 = cpu()
        return _result(ttfts, ended, cpu0, cpu1)

    result: dict[str, Any] = await _with_client(spec, body)
    return result

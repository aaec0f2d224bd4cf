"""The anchors: clients that read the same engine directly (run inside a worker process).

- ``EngineClient`` (trio + trio-asyncio + grpclib + betterproto2): the sidecar's own
  upstream half, so "sidecar minus this" is what the north side costs;
- grpcio's asyncio API with the official protobuf runtime (upb), bindings generated at run
  time from ``schema/`` (:mod:`sidecar.bench.pb2`): the standard Python gRPC stack, the
  reference for CPU per token.

Both read every event and count token events, nothing more (the grpcio client checks the
oneof; the EngineClient's stream already validates each event against the stream rules).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from typing import Any

import trio

from sidecar.bench import stats
from sidecar.bench.north_load import latency_figures


def _request(spec: dict[str, Any], request_id: str, max_tokens: int, **mock: Any) -> Any:
    from sidecar.openengine import pb

    req = pb.GenerateRequest(
        request_id=request_id,
        model=spec["model"],
        prompt=spec.get("prompt", "Hello"),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )
    if mock:
        req.extra = pb.Struct.from_dict({"mock": mock})
    return req


# --- EngineClient -------------------------------------------------------------------------------------


async def _with_client(spec: dict[str, Any], body: Callable[[Any], Any]) -> Any:
    from sidecar.openengine.client import open_engine_client

    async with open_engine_client(spec["engine"]) as client:
        # warm up: open the channels, fill the engine's pre-encoded token cache
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(_drain_stream, client, _request(spec, f"{spec['nonce']}-w{i}", 20))
        return await body(client)


async def _drain_stream(client: Any, req: Any, on_token: Callable[[Any], None] | None = None) -> int:
    n = 0
    async with client.generate(req) as stream:
        async for ev in stream:
            if ev.token is not None:
                n += 1
                if on_token is not None:
                    on_token(ev)
    return n


async def relay_engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    n, m, nonce = spec["streams"], spec["tokens"], spec["nonce"]

    async def body(client: Any) -> dict[str, Any]:
        counts: list[int] = []

        async def one(i: int) -> None:
            counts.append(await _drain_stream(client, _request(spec, f"{nonce}-{i}", m)))

        cpu0, t0 = cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        t1, cpu1 = time.perf_counter(), cpu()
        tokens = sum(counts)
        return {
            "streams": n,
            "tokens_per_stream": m,
            "tokens": tokens,
            "seconds": t1 - t0,
            "tokens_per_s": tokens / (t1 - t0),
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        }

    result: dict[str, Any] = await _with_client(spec, body)
    return result


async def short_engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    users, seconds, nonce = spec["concurrency"], spec["seconds"], spec["nonce"]

    async def body(client: Any) -> dict[str, Any]:
        ids = itertools.count()
        latencies: list[float] = []
        cpu0, t0 = cpu(), time.perf_counter()
        deadline = t0 + seconds

        async def user() -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                await _drain_stream(client, _request(spec, f"{nonce}-{next(ids)}", 1))
                latencies.append(time.perf_counter() - t)

        async with trio.open_nursery() as nursery:
            for _ in range(users):
                nursery.start_soon(user)
        t1, cpu1 = time.perf_counter(), cpu()
        return {
            "concurrency": users,
            "requests": len(latencies),
            "completed": len(latencies),
            "seconds": t1 - t0,
            "requests_per_s": len(latencies) / (t1 - t0),
            "latency_ms": stats.summary(latencies, 1000),
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        }

    result: dict[str, Any] = await _with_client(spec, body)
    return result


async def latency_engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    n, m, nonce = spec["streams"], spec["tokens"], spec["nonce"]
    rng = random.Random(spec.get("seed", 1))
    offsets = sorted(rng.uniform(0, spec["ramp_s"]) for _ in range(n))

    async def body(client: Any) -> dict[str, Any]:
        sent = [0] * n
        recv: list[list[int]] = [[] for _ in range(n)]
        marks: list[list[str]] = [[] for _ in range(n)]

        async def one(i: int, at: float) -> None:
            await trio.sleep_until(at)
            req = _request(spec, f"{nonce}-{i}", m, token_delay_ms=spec["token_delay_ms"], stamp=True)

            def on_token(ev: Any) -> None:
                recv[i].append(time.time_ns())
                marks[i].append(ev.token.text)

            sent[i] = time.time_ns()
            await _drain_stream(client, req, on_token)

        cpu0, t0 = cpu(), trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, off in enumerate(offsets):
                nursery.start_soon(one, i, t0 + off)
        cpu1, t1 = cpu(), trio.current_time()
        out = latency_figures(sent, recv, marks)
        out.update(
            streams=n,
            tokens=sum(len(r) for r in recv),
            seconds=t1 - t0,
            cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0},
        )
        return out

    result: dict[str, Any] = await _with_client(spec, body)
    return result


async def cancel_engineclient(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Direct anchor of the cancellation storm: the same two phases; a cancel is leaving the
    ``generate`` block (HTTP/2 reset), then an Abort as the sidecar sends (kind ``reset``)."""
    from sidecar.openengine import pb
    from sidecar.openengine.engine_errors import EngineClientError

    n, nonce = spec["streams"], spec["nonce"]
    rng = random.Random(spec.get("seed", 2))

    async def body(client: Any) -> dict[str, Any]:
        records: list[dict[str, Any]] = []
        started = 0
        all_started = trio.Event()
        storm_at: list[float] = []
        storm = trio.Event()

        async def one(i: int, start: float, after: float) -> None:
            nonlocal started
            await trio.sleep_until(t0 + start)
            req = _request(spec, f"{nonce}-{i}", spec["tokens"], token_delay_ms=spec["token_delay_ms"])
            async with client.generate(req) as stream:
                first = True
                with trio.CancelScope() as scope:
                    async for _ in stream:
                        if first:
                            first = False
                            started += 1
                            if started == n:
                                all_started.set()
                            await storm.wait()
                            scope.deadline = storm_at[0] + after
            if not scope.cancelled_caught:
                return  # ended by itself
            # the cancel happened at the scope's deadline; leaving the block (the reset) is part of it
            late = trio.current_time() - scope.deadline
            records.append(
                {
                    "request_id": f"{nonce}-{i}",
                    "kind": "reset",
                    "cancel_us": int(time.time_ns() / 1000 - late * 1e6),
                }
            )
            # then Abort, as the sidecar does (docs/LIFECYCLE.md): without it the engine keeps the request
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await client.abort(pb.AbortRequest(request_id=f"{nonce}-{i}"))
                except EngineClientError:
                    pass  # NOT_FOUND: it had finished

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i, rng.uniform(0, spec["ramp_s"]), rng.uniform(0, spec["window_s"]))
            with trio.move_on_after(60):
                await all_started.wait()
            opened_s = trio.current_time() - t0
            cpu0 = cpu()
            storm_at.append(trio.current_time())
            storm.set()
        return {
            "streams": n,
            "open_s": opened_s,
            "records": records,
            "cpu_s": {k: v - cpu0[k] for k, v in cpu().items()},
        }

    result: dict[str, Any] = await _with_client(spec, body)
    return result


# --- grpcio + official protobuf -----------------------------------------------------------------------


class GrpcioClient:
    """grpcio's asyncio API on the engine with the run-time bindings (see the module doc)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import grpc

        from sidecar.bench.pb2 import import_pb2

        self.spec = spec
        self.gen, self.svc = import_pb2(spec["pb2_dir"])
        target = spec["engine"]
        if target.startswith("unix://"):
            target = "unix:" + target[len("unix://") :]
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = self.svc.InferenceStub(self.channel)

    def request(self, rid: str, max_tokens: int) -> Any:
        gen = self.gen
        return gen.GenerateRequest(
            request_id=rid,
            model=self.spec["model"],
            prompt=self.spec.get("prompt", "Hello"),
            stopping=gen.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        )

    async def tokens(self, rid: str, max_tokens: int) -> int:
        """Read one stream to its end; its token events."""
        count = 0
        async for resp in self.stub.Generate(self.request(rid, max_tokens)):
            if resp.HasField("token"):
                count += 1
        return count

    async def warm_up(self) -> None:
        await asyncio.gather(*(self.tokens(f"{self.spec['nonce']}-w{i}", 20) for i in range(8)))


def relay_grpcio(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    n, m, nonce = spec["streams"], spec["tokens"], spec["nonce"]

    async def main() -> dict[str, Any]:
        client = GrpcioClient(spec)
        async with client.channel:
            one = client.tokens
            await client.warm_up()
            cpu0, t0 = cpu(), time.perf_counter()
            counts = await asyncio.gather(*(one(f"{nonce}-{i}", m) for i in range(n)))
            t1, cpu1 = time.perf_counter(), cpu()
        tokens = sum(counts)
        return {
            "streams": n,
            "tokens_per_stream": m,
            "tokens": tokens,
            "seconds": t1 - t0,
            "tokens_per_s": tokens / (t1 - t0),
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        }

    return asyncio.run(main())


def short_grpcio(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """``concurrency`` users sending 1-token requests back to back for ``seconds`` (grpcio)."""
    users, seconds, nonce = spec["concurrency"], spec["seconds"], spec["nonce"]

    async def main() -> dict[str, Any]:
        client = GrpcioClient(spec)
        async with client.channel:
            await client.warm_up()
            ids = itertools.count()
            latencies: list[float] = []
            cpu0, t0 = cpu(), time.perf_counter()
            deadline = t0 + seconds

            async def user() -> None:
                while time.perf_counter() < deadline:
                    t = time.perf_counter()
                    await client.tokens(f"{nonce}-{next(ids)}", 1)
                    latencies.append(time.perf_counter() - t)

            await asyncio.gather(*(user() for _ in range(users)))
            t1, cpu1 = time.perf_counter(), cpu()
        return {
            "concurrency": users,
            "requests": len(latencies),
            "completed": len(latencies),
            "seconds": t1 - t0,
            "requests_per_s": len(latencies) / (t1 - t0),
            "latency_ms": stats.summary(latencies, 1000),
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        }

    return asyncio.run(main())

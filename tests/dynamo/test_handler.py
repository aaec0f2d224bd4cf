"""The Dynamo handler bridge on the real stream lifecycle (in-process mock engine, no Dynamo).

The handler is driven the way Dynamo's runtime drives it: an asyncio async generator on the
trio-asyncio loop, pulled chunk by chunk; the request context is a stand-in whose
``async_killed_or_stopped()`` future the test resolves. Cancellation is judged from the
engine's side (its ground-truth counters).
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar.core.lifecycle import OUTCOME_COMPLETED, Outcome, StreamHandle
from sidecar.core.sidecar import Sidecar, SidecarConfig
from sidecar.dynamo.handler import StreamBridge
from sidecar.mock import tokenizer as tok
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.tracing import TracingConfig
from sidecar.tracing.otel import Tracer, build_tracer
from tests.dynamo.test_aio_batch import pass_counter
from tests.dynamo.test_mapping import dynamo_request
from tests.mock_engines import InProcessEngine, mock_engine_in_process
from tests.polling import eventually


class FakeContext:
    """Dynamo's request context: id, trace headers, and the stop/kill signal."""

    def __init__(self, rid: str, trace: dict[str, str] | None = None) -> None:
        self.rid = rid
        self.trace = trace
        self.future: asyncio.Future[bool] | None = None

    def id(self) -> str:
        return self.rid

    def trace_headers(self) -> dict[str, str] | None:
        return self.trace

    def async_killed_or_stopped(self) -> asyncio.Future[bool]:
        self.future = asyncio.get_running_loop().create_future()
        return self.future

    def stop(self) -> None:
        assert self.future is not None
        self.future.set_result(True)


@asynccontextmanager
async def bridge(
    aio_loop: Any, buffer: int = 64, tracer: Tracer | None = None, **engine: Any
) -> AsyncIterator[tuple[StreamBridge, InProcessEngine]]:
    async with (
        mock_engine_in_process(**engine) as eng,
        open_engine_client(eng.address) as client,
        trio.open_nursery() as nursery,
    ):
        sidecar = Sidecar(client, SidecarConfig(), tracer=tracer)
        await sidecar.startup()
        await nursery.start(sidecar.supervisor.run_service)
        b = StreamBridge(sidecar, aio_loop, buffer=buffer)
        await nursery.start(b.run)
        yield b, eng
        nursery.cancel_scope.cancel()


async def collect(b: StreamBridge, request: dict[str, Any], ctx: FakeContext, *, stop_after: int = 0) -> Any:
    """Pull the handler's chunks on asyncio; ``stop_after`` chunks: stop the context, keep reading."""

    async def consume() -> list[dict[str, Any]]:
        out = []
        async for chunk in b.handler(request, ctx):
            out.append(chunk)
            if stop_after and len(out) == stop_after:
                ctx.stop()
        return out

    return await trio_asyncio.aio_as_trio(consume)()


def counters(eng: InProcessEngine) -> dict[str, Any]:
    return eng.attributes


async def wait_idle(eng: InProcessEngine, bridge: StreamBridge | None = None) -> dict[str, Any]:
    """The engine's counters once it holds nothing (and ``bridge`` has no stream left: its
    stream task ends a moment after the engine took the Abort, when the answer is back)."""

    def idle() -> dict[str, Any] | None:
        c = counters(eng)
        return None if c["streams_open"] or c["requests_in_flight"] or (bridge and bridge.active) else c

    result: dict[str, Any] = await eventually(idle, 5)
    return result


async def test_completion_relays_the_engine_tokens(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with bridge(aio_loop) as (b, eng):
            req = dynamo_request(stop_conditions={"max_tokens": 10, "ignore_eos": True})
            chunks = await collect(b, req, FakeContext("r1"))
            ids = [t for c in chunks for t in c["token_ids"]]
            assert len(ids) == 10 and all(t >= tok.WORD_BASE or t in (264, 265) for t in ids)
            last = chunks[-1]
            assert last["finish_reason"] == "length"
            assert last["completion_usage"]["completion_tokens"] == 10
            c = await wait_idle(eng)
            assert c["requests_completed"] == 1 and c["aborts_received"] == 0


async def test_context_stop_closes_upstream_and_aborts(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with bridge(aio_loop, token_delay_ms=20.0) as (b, eng):
            req = dynamo_request(stop_conditions={"max_tokens": 1000, "ignore_eos": True})
            chunks = await collect(b, req, FakeContext("stop-me"), stop_after=3)
            assert 3 <= len(chunks) < 20 and "finish_reason" not in chunks[-1]
            c = await wait_idle(eng)
            assert c["aborts_received_by_id"] == {"stop-me": 1}
            assert c["requests_leaked"] == 0 and c["requests_completed"] == 0


async def test_closed_generator_cancels_the_stream(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with bridge(aio_loop, token_delay_ms=20.0) as (b, eng):
            req = dynamo_request(stop_conditions={"max_tokens": 1000, "ignore_eos": True})

            async def take_two() -> None:
                gen = b.handler(req, FakeContext("closed"))
                await gen.__anext__()
                await gen.__anext__()
                await gen.aclose()  # what Dynamo does when it drops the response stream

            await trio_asyncio.aio_as_trio(take_two)()
            c = await wait_idle(eng, b)
            assert c["aborts_received_by_id"] == {"closed": 1} and c["requests_leaked"] == 0
            assert b.active == 0


@pytest.mark.parametrize("how", ["another-thread-loop", "garbage-collected-in-another-thread"])
async def test_a_generator_finalised_outside_trio_still_cancels_its_stream(
    aio_loop: Any, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo's runtime may close the handler's generator from its own thread or event loop, and
    garbage collection may finalise it anywhere — here while the stream waits for the handler to
    take a chunk (its channel full): the stream is still cancelled, in trio's own thread, and the
    engine gets its Abort. (Cancelled from another thread, a stream's scope with a deadline
    raised "must be called from async context" half-way, its task never woke, and the engine went
    on generating.)"""
    cancelled_in: list[threading.Thread] = []
    cancel = StreamHandle.cancel

    def recording(self: StreamHandle, reason: Outcome) -> None:
        cancelled_in.append(threading.current_thread())
        cancel(self, reason)

    monkeypatch.setattr(StreamHandle, "cancel", recording)
    with trio.fail_after(20):
        async with bridge(aio_loop, buffer=2, token_delay_ms=20.0) as (b, eng):
            req = dynamo_request(stop_conditions={"max_tokens": 1000, "ignore_eos": True})
            held: list[Any] = []

            async def take_two() -> None:
                gen = b.handler(req, FakeContext(how))
                await gen.__anext__()
                await gen.__anext__()
                held.append(gen)

            await trio_asyncio.aio_as_trio(take_two)()
            job = held[0].ag_frame.f_locals["job"]  # the generator's own request
            await eventually(lambda: job.send.statistics().tasks_waiting_send == 1)
            errors: list[BaseException] = []

            def finalise_elsewhere() -> None:
                try:
                    if how == "another-thread-loop":
                        asyncio.run(held[0].aclose())  # another thread, another event loop
                    else:
                        held.clear()  # the last reference: finalised in this thread
                        gc.collect()
                except BaseException as err:
                    errors.append(err)

            await trio.to_thread.run_sync(finalise_elsewhere)
            held.clear()
            c = await wait_idle(eng, b)
            assert errors == []
            assert cancelled_in == [threading.main_thread()]
            assert c["aborts_received_by_id"] == {how: 1} and c["requests_leaked"] == 0
            assert b.active == 0


async def test_a_dynamo_request_is_traced_under_its_context(aio_loop: Any) -> None:
    """Dynamo mode: the request context's ``traceparent`` is the parent of the stream's span,
    which carries the routed DP rank; a stop shows as a cancel and an Abort span under it."""
    exporter = InMemorySpanExporter()
    tracer = build_tracer(TracingConfig(None), exporter=exporter)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with trio.fail_after(20):
        async with bridge(aio_loop, tracer=tracer, token_delay_ms=20.0) as (b, eng):
            req = dynamo_request(
                stop_conditions={"max_tokens": 1000, "ignore_eos": True}, routing={"dp_rank": 0}
            )
            await collect(b, req, FakeContext("traced", {"traceparent": parent}), stop_after=3)
            await wait_idle(eng, b)
    tracer.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    generate, abort = spans["generate"], spans["Abort"]
    assert generate.parent is not None and generate.context is not None
    assert (generate.context.trace_id, generate.parent.span_id) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736,
        0x00F067AA0BA902B7,
    )
    assert dict(generate.attributes or {})["openengine.dp_rank"] == 0
    assert dict(generate.attributes or {})["openengine.outcome"] == "cancelled"
    assert [e.name for e in generate.events][:3] == ["admitted", "first_token", "cancel"]
    assert abort.parent is not None and abort.parent.span_id == generate.context.span_id


async def test_rejection_raises_before_the_engine(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with bridge(aio_loop) as (b, eng):
            with pytest.raises(Exception, match="not served by this worker") as err:
                await collect(b, dynamo_request(model="nope"), FakeContext("r2"))
            assert "InvalidArgument" in type(err.value).__name__ or "InvalidArgument" in str(err.value)
            assert counters(eng)["requests_accepted"] == 0


async def test_concurrent_streams(aio_loop: Any) -> None:
    with trio.fail_after(30):
        async with bridge(aio_loop, fast=True) as (b, eng):
            results: dict[int, int] = {}

            async def one(i: int) -> None:
                req = dynamo_request(stop_conditions={"max_tokens": 50, "ignore_eos": True})
                chunks = await collect(b, req, FakeContext(f"c{i}"))
                results[i] = sum(len(c["token_ids"]) for c in chunks)

            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(one, i)
            assert results == dict.fromkeys(range(32), 50)
            c = await wait_idle(eng)
            assert c["requests_completed"] == 32 and c["aborts_received"] == 0


async def test_first_chunk_is_not_held_behind_other_callbacks(aio_loop: Any) -> None:
    """The engine's first event reaches Dynamo's side within a few scheduler passes while 64
    other asyncio callbacks are always queued (what Dynamo's runtime threads keep posting for
    the other streams of a loaded worker). Counted in trio passes, not seconds. Before: the
    loop ran one callback per pass and the handler waited through a ``trio_as_future`` task,
    so the chunk waited behind every queued callback (~64 passes)."""
    with trio.fail_after(20):
        async with bridge(aio_loop) as (b, _eng), pass_counter() as passes:
            at: dict[str, int] = {}

            async def run_stream(handle: Any, emit: Any) -> Outcome:
                at["event"] = passes()
                await emit(
                    pb.GenerateResponse(
                        request_id="first", token=pb.TokenOutput(tokens=[pb.TokenInfo(token_id=7)])
                    )
                )
                return OUTCOME_COMPLETED

            b.sidecar.run_stream = run_stream
            stop = False

            def other_stream() -> None:
                if not stop:
                    aio_loop.call_soon(other_stream)

            for _ in range(64):
                aio_loop.call_soon(other_stream)

            async def consume() -> list[dict[str, Any]]:
                out = []
                async for chunk in b.handler(dynamo_request(), FakeContext("first")):
                    at.setdefault("chunk", passes())
                    out.append(chunk)
                return out

            try:
                chunks = await trio_asyncio.aio_as_trio(consume)()
            finally:
                stop = True
            assert chunks == [{"token_ids": [7], "index": 0}]
            assert at["chunk"] - at["event"] <= 3, at


async def test_a_stopped_bridge_refuses_at_once(aio_loop: Any) -> None:
    """A request that reaches a bridge whose service has stopped is refused with Dynamo's
    EngineShutdown, never served as an empty stream."""
    with trio.fail_after(20):
        async with bridge(aio_loop) as (b, eng):
            stopped = StreamBridge(b.sidecar, aio_loop)
            async with trio.open_nursery() as nursery:
                await nursery.start(stopped.run)
                nursery.cancel_scope.cancel()
            with pytest.raises(Exception, match="this worker is not serving") as err:
                await collect(stopped, dynamo_request(), FakeContext("late"))
            assert "EngineShutdown" in type(err.value).__name__ or "EngineShutdown" in str(err.value)
            assert counters(eng)["requests_accepted"] == 0

"""Fast mode: pre-encoded responses identical to the normal ones, and its streaming rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from sidecar.mock import events as ev
from sidecar.mock import generator as gen
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.mock_engines import run_mock_engine

from .helpers import collect, engine, request


def test_pre_encoded_bytes_equal_normal_encoding() -> None:
    fast = ev.FastTokens("req-1")
    for step in (
        gen.Step(300, " ba", None, None),
        gen.Step(301, "", None, None),
        gen.Step(2, "", None, None),
    ):
        for index in (0, 3):
            assert fast.event(index, step).data == bytes(ev.token_event("req-1", index, step))
            assert fast.event(index, step).data == bytes(ev.token_event("req-1", index, step))  # cached


async def test_fast_and_normal_streams_are_identical(aio_loop: Any) -> None:
    req = request("same", max_tokens=None, sampling=pb.SamplingParams(num_sequences=2))
    async with engine(fast=True, token_delay_ms=50) as (_, fast), engine() as (_, normal):
        a = await collect(fast, req)
        b = await collect(normal, req)
    assert [bytes(x) for x in a] == [bytes(x) for x in b]


async def test_fast_engine_rate(aio_loop: Any, tmp_path: Path) -> None:
    """Streams 16 x 1000 tokens to one trio EngineClient; prints the rate (engine in its own process)."""
    streams, tokens = 16, 1000
    with trio.fail_after(60):
        async with (
            run_mock_engine(tmp_path, fast=True, kv_events="none") as eng,
            open_engine_client(eng.address) as client,
        ):
            counts: list[int] = []

            async def one(i: int) -> None:
                req = request(f"b{i}", stopping=pb.StoppingOptions(max_tokens=tokens, ignore_eos=True))
                async with client.generate(req) as stream:
                    n = 0
                    async for _ in stream:
                        n += 1
                counts.append(n)

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i)
            elapsed = trio.current_time() - start
    assert counts == [tokens + 1] * streams
    print(f"fast mock engine -> trio EngineClient: {sum(counts) / elapsed:.0f} msgs/s over {streams} streams")

"""Shared helpers of the mock-engine tests (trio side; need the ``aio_loop`` fixture)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import betterproto2
import trio

from sidecar.mock.faults import parse_faults
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, MetadataLike, open_engine_client
from tests.mock_engines import InProcessEngine, mock_engine_in_process
from tests.polling import eventually


@asynccontextmanager
async def engine(
    faults: tuple[str, ...] = (), **fields: Any
) -> AsyncIterator[tuple[InProcessEngine, EngineClient]]:
    """An in-process engine (ZMQ/gRPC KV events off unless asked) and a client to it."""
    fields.setdefault("kv_events", "none")
    if faults:
        fields["faults"] = parse_faults(faults, role=fields.get("role", "aggregated"))
    async with mock_engine_in_process(**fields) as eng, open_engine_client(eng.address) as client:
        yield eng, client


def request(
    rid: str = "r1", prompt: str = "hello world", max_tokens: int | None = 8, **kw: Any
) -> pb.GenerateRequest:
    stopping = kw.pop("stopping", None)
    if stopping is None and max_tokens is not None:
        stopping = pb.StoppingOptions(max_tokens=max_tokens)
    return pb.GenerateRequest(request_id=rid, prompt=prompt, stopping=stopping, **kw)


async def collect(
    client: EngineClient, req: pb.GenerateRequest, metadata: MetadataLike | None = None, timeout: float = 10.0
) -> list[pb.GenerateResponse]:
    """Every event of a Generate stream (typed client errors propagate)."""
    with trio.fail_after(timeout):
        async with client.generate(req, metadata=metadata) as stream:
            return [ev async for ev in stream]


def kind(ev: pb.GenerateResponse) -> str:
    name, _ = betterproto2.which_one_of(ev, "event")
    return name or ""


def token_ids(events: list[pb.GenerateResponse], index: int = 0) -> list[int]:
    return [
        t.token_id
        for e in events
        if e.token is not None and e.token.output_index == index
        for t in e.token.tokens
    ]


def text(events: list[pb.GenerateResponse], index: int = 0) -> str:
    return "".join(e.token.text for e in events if e.token is not None and e.token.output_index == index)


def finishes(events: list[pb.GenerateResponse]) -> dict[int, pb.GenerationFinished]:
    return {e.finished.output_index or 0: e.finished for e in events if e.finished is not None}


def final_usage(events: list[pb.GenerateResponse]) -> pb.Usage:
    assert all(e.usage is None for e in events[:-1]), "usage before the final event"
    usage = events[-1].usage
    assert usage is not None
    return usage


async def counters(client: EngineClient) -> dict[str, Any]:
    with trio.fail_after(5):
        load = await client.get_load()
    assert load.attributes is not None
    return load.attributes.to_dict()


async def wait_for(
    client: EngineClient, check: Callable[[dict[str, Any]], bool], timeout: float = 5.0
) -> dict[str, Any]:
    """Poll the engine's counters until ``check`` holds (bounded); returns them."""

    async def held() -> dict[str, Any] | None:
        attrs = await counters(client)
        return attrs if check(attrs) else None

    result: dict[str, Any] = await eventually(held, timeout)
    return result


async def load_is(client: EngineClient, check: Callable[[pb.LoadInfo], bool]) -> bool:
    return check(await client.get_load())


async def health_is(client: EngineClient, state: pb.HealthState) -> bool:
    return (await client.health()).state == state

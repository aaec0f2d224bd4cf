"""A small purpose-built faulty engine (serving kit: ``sidecar.openengine.server``).

An aggregated engine with just enough discovery for the suite, whose Generate follows a
script: ``script(request)`` returns the events to send, in order, and optionally a gRPC
status name to end the call with after them. It runs in the test's trio-asyncio loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio_asyncio

from sidecar.openengine import pb
from sidecar.openengine.revision import SCHEMA_RELEASE
from sidecar.openengine.server import RpcStatusError, open_server

MODEL = "fake-model"
Script = Callable[[pb.GenerateRequest], tuple[list[pb.GenerateResponse], str | None]]


def token(request: pb.GenerateRequest, index: int = 0, token_id: int = 7) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request.request_id,
        token=pb.TokenOutput(
            output_index=index, tokens=[pb.TokenInfo(token_id=token_id, token="x")], text="x"
        ),
    )


def usage(completion: int = 1) -> pb.Usage:
    return pb.Usage(prompt_tokens=3, completion_tokens=completion, total_tokens=3 + completion)


def error(request: pb.GenerateRequest, completion: int = 1) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request.request_id,
        error=pb.EngineError(code=pb.ErrorCode.INTERNAL, message="scripted failure", retryable=True),
        usage=usage(completion),
    )


class _Control(pb.ControlBase):
    async def get_server_info(self, message: pb.GetServerInfoRequest) -> pb.ServerInfo:
        return pb.ServerInfo(
            engine_name="faulty",
            engine_version="0",
            engine_role=pb.EngineRole.AGGREGATED,
            instance_id="faulty-1",
            supported_models=[MODEL],
            schema_revision=3,
            minimum_client_revision=1,
            schema_release=SCHEMA_RELEASE,
        )

    async def get_model_info(self, message: pb.GetModelInfoRequest) -> pb.ModelInfo:
        if message.model not in ("", MODEL):
            raise RpcStatusError("NOT_FOUND", f"no model {message.model!r}")
        return pb.ModelInfo(model_id=MODEL, served_model_name=MODEL)

    async def get_load(self, message: pb.GetLoadRequest) -> pb.LoadInfo:
        return pb.LoadInfo(instance_id="faulty-1", running_requests=0, queued_requests=0)

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        return pb.HealthResponse(state=pb.HealthState.READY)

    async def abort(self, message: pb.AbortRequest) -> pb.AbortResponse:
        raise RpcStatusError("NOT_FOUND", "nothing runs here for long")


class _Inference(pb.InferenceBase):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def generate(  # type: ignore[override]
        self, message: pb.GenerateRequest, send: Callable[[Any], Awaitable[None]]
    ) -> None:
        events, status = self.script(message)
        for event in events:
            await send(event)
        if status is not None:
            raise RpcStatusError(status, "scripted status")


@asynccontextmanager
async def faulty_engine(script: Script) -> AsyncIterator[str]:
    """Serve the faulty engine on 127.0.0.1 for the block; yields its address."""
    started = trio.Event()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        holder["stop"] = stop
        async with open_server([_Control(), _Inference(script)], "127.0.0.1:0") as running:
            holder["address"] = str(running.address)
            started.set()
            await stop.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio_asyncio.aio_as_trio(serve))
        with trio.fail_after(10):
            await started.wait()
        try:
            yield holder["address"]
        finally:
            holder["stop"].set()

"""A small purpose-built faulty engine: the suite's scriptable gRPC fake
(``tests.openengine.fake_grpc_engine``) dressed as an aggregated engine.

Just enough discovery for the conformance suite; Generate follows a script:
``script(request)`` returns the events to send, in order, and optionally a gRPC status name to
end the call with after them; what an engine may leave out answers ``UNIMPLEMENTED``. It runs
in the test's trio-asyncio loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, RunningServer, Status, status

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


def _unimplemented(request: Any) -> Any:
    raise status(Status.UNIMPLEMENTED, "not served by the faulty engine")


def _no_model(request: pb.GetModelInfoRequest) -> pb.ModelInfo:
    if request.model not in ("", MODEL):
        raise status(Status.NOT_FOUND, f"no model {request.model!r}")
    return pb.ModelInfo(model_id=MODEL, served_model_name=MODEL)


def _abort(request: pb.AbortRequest) -> pb.AbortResponse:
    raise status(Status.NOT_FOUND, "nothing runs here for long")


@asynccontextmanager
async def faulty_engine(script: Script) -> AsyncIterator[str]:
    """Serve the faulty engine on 127.0.0.1 for the block; yields its address."""
    engine = FakeGrpcEngine()
    engine.unary.update(
        GetServerInfo=lambda r: pb.ServerInfo(
            engine_name="faulty",
            engine_version="0",
            engine_role=pb.EngineRole.AGGREGATED,
            instance_id="faulty-1",
            supported_models=[MODEL],
            schema_revision=3,
            minimum_client_revision=1,
            schema_release=SCHEMA_RELEASE,
        ),
        GetModelInfo=_no_model,
        GetLoad=lambda r: pb.LoadInfo(instance_id="faulty-1", running_requests=0, queued_requests=0),
        Abort=_abort,
        LoadLora=_unimplemented,
        UnloadLora=_unimplemented,
        ListLoras=_unimplemented,
        GetKvEventSources=_unimplemented,
    )

    def generate(request: pb.GenerateRequest, metadata: dict[str, str]) -> list[Any]:
        events, end = script(request)
        return [*events, *([status(Status[end], "scripted status")] if end is not None else [])]

    engine.streams["Generate"] = generate
    engine.streams["Drain"] = engine.streams["SubscribeKvEvents"] = lambda r, md: [_unimplemented(r)]
    server = RunningServer(engine)
    with trio.fail_after(10):
        address = await server.start()
    try:
        yield address
    finally:
        with trio.move_on_after(10):
            await server.stop()

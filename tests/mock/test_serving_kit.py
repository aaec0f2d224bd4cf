"""sidecar.openengine.serving.grpc_server: the serving kit the simulated engines are built on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio

from sidecar.addresses import ListenAddress, parse_listen
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineStatusError
from sidecar.openengine.serving.grpc_server import (
    PreEncoded,
    RpcStatusError,
    open_server,
    request_context,
    request_metadata,
)


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:0") == ListenAddress(host="127.0.0.1", port=0)
    assert parse_listen(":50051") == ListenAddress(host="127.0.0.1", port=50051)
    assert parse_listen("[::1]:5") == ListenAddress(host="::1", port=5)
    assert parse_listen("unix:///tmp/x.sock") == ListenAddress(path="/tmp/x.sock")
    assert str(ListenAddress(host="::1", port=5)) == "[::1]:5"
    for bad in ("unix://rel.sock", "unix:/x", "host", "h:99999", "h:p", "::1:5"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_status_error_needs_a_non_ok_status() -> None:
    assert RpcStatusError("NOT_FOUND", "x").status == "NOT_FOUND"
    for bad in ("OK", "NOPE"):
        with pytest.raises(ValueError):
            RpcStatusError(bad)


class Control(pb.ControlBase):
    def __init__(self) -> None:
        self.drain_closed = asyncio.Event()

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        md = request_metadata()
        ctx = request_context()
        assert ctx is not None and ctx.method.endswith("/Health")
        return pb.HealthResponse(
            checks=[pb.HealthCheck(name=k, message=str(v)) for k, v in md if k.startswith("x-")]
        )

    async def get_model_info(self, message: pb.GetModelInfoRequest) -> pb.ModelInfo:
        raise RpcStatusError("NOT_FOUND", f"no model {message.model}")

    async def drain(self, message: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]:
        try:
            yield pb.DrainResponse(state=pb.DrainState.STARTED)
            if message.stop_accepting_new_requests:
                raise RpcStatusError("FAILED_PRECONDITION", "after one event")
            await asyncio.Event().wait()
        finally:
            self.drain_closed.set()


class Inference(pb.InferenceBase):
    async def generate(self, message: pb.GenerateRequest, send: Any) -> None:  # type: ignore[override]
        body = bytes(
            pb.GenerateResponse(finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.STOP))
        )
        await send(PreEncoded(bytes(pb.GenerateResponse(request_id=message.request_id)) + body))


@pytest.mark.parametrize("where", ["tcp", "unix"])
async def test_kit_end_to_end(aio_loop: Any, tmp_path: Path, where: str) -> None:
    control = Control()
    listen = "127.0.0.1:0" if where == "tcp" else f"unix://{tmp_path}/k.sock"
    stop = trio.Event()
    address: list[str] = []
    started = trio.Event()

    async def serve() -> None:
        async with open_server([control, Inference()], listen) as running:
            assert running.address.port != 0 or running.address.path
            address.append(str(running.address))
            started.set()
            await trio_asyncio.trio_as_aio(stop.wait)()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio_asyncio.aio_as_trio(serve))
            await started.wait()
            async with open_engine_client(address[0]) as client:
                h = await client.health(metadata=[("x-a", "1"), ("x-a", "2")])
                assert [(c.name, c.message) for c in h.checks] == [("x-a", "1"), ("x-a", "2")]
                with pytest.raises(EngineStatusError) as info:
                    await client.get_model_info("m")
                assert (info.value.status, info.value.message) == ("NOT_FOUND", "no model m")
                async with client.generate(pb.GenerateRequest(request_id="q", prompt="x")) as stream:
                    [event] = [e async for e in stream]
                assert event.request_id == "q" and event.finished is not None
                with pytest.raises(EngineStatusError) as info:
                    async with client.drain(pb.DrainRequest(stop_accepting_new_requests=True)) as d:
                        [r async for r in d]
                assert info.value.status == "FAILED_PRECONDITION"
                control.drain_closed.clear()
                async with client.drain(pb.DrainRequest()) as d:
                    assert (await d.__anext__()).state == pb.DrainState.STARTED
                # leaving the block resets the stream: the generator is closed at once
                await trio_asyncio.aio_as_trio(control.drain_closed.wait)()
            stop.set()
    if where == "unix":
        assert not (tmp_path / "k.sock").exists()

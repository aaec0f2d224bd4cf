"""The OpenEngine ``Inference`` and ``Control`` services every adapter serves.

Served by the project's grpclib kit (``sidecar.openengine.serving.grpc_server``); refusals are
:class:`~sidecar.openengine.serving.grpc_server.RpcStatusError` (a non-OK status, no event). An adapter gives
its engine (an :class:`~sidecar.engines.common.registry.AdapterEngine` with discovery, Health and
GetLoad: :class:`ServedEngine`) and its stream driver (``run(engine, active, send)``). LoRA calls
answer ``FAILED_PRECONDITION`` (no adapter enables LoRA); ``SubscribeKvEvents`` answers
``UNIMPLEMENTED`` (the engines publish KV events over ZMQ themselves: ``GetKvEventSources``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from sidecar.engines.common.registry import Active
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError, request_metadata

_NO_LORA = "LoRA is not enabled on this engine"
#: GetLoad metadata asking for ``attributes.aborts_by_request`` (tests: exactly one Abort per request).
REPORT_ABORTS = ("adapter-report", "aborts")

Send = Callable[[Any], Awaitable[None]]


class Discovered(Protocol):
    """What an adapter advertises (built once its engine runs)."""

    @property
    def server(self) -> pb.ServerInfo: ...

    @property
    def model(self) -> pb.ModelInfo: ...

    @property
    def kv_sources(self) -> pb.GetKvEventSourcesResponse: ...

    @property
    def names(self) -> Sequence[str]: ...


class ServedEngine(Protocol):
    """What the services need from an adapter's engine."""

    @property
    def discovery(self) -> Discovered: ...

    def admit(self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]]) -> Active: ...

    def load(self, include_per_rank: bool, *, report_aborts: bool = False) -> pb.LoadInfo: ...

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse: ...

    async def abort(self, message: pb.AbortRequest) -> pb.AbortResponse: ...

    def drain(self, request: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]: ...


class InferenceService(pb.InferenceBase):
    """``Inference.Generate``: admission, then the adapter's stream driver."""

    def __init__(self, engine: Any, run: Callable[[Any, Active, Send], Awaitable[None]]) -> None:
        self.engine = engine
        self.run = run

    async def generate(  # type: ignore[override]
        self, message: pb.GenerateRequest, send: Send
    ) -> None:
        active = self.engine.admit(message, request_metadata())
        await self.run(self.engine, active, send)


class ControlService(pb.ControlBase):
    """``Control``: discovery, health, load, Abort, Drain and KV event sources."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine = engine

    async def get_server_info(self, message: pb.GetServerInfoRequest) -> pb.ServerInfo:
        return self.engine.discovery.server

    async def get_model_info(self, message: pb.GetModelInfoRequest) -> pb.ModelInfo:
        if message.model and message.model not in self.engine.discovery.names:
            raise RpcStatusError("NOT_FOUND", f"model {message.model!r} is not served here")
        return self.engine.discovery.model

    async def get_load(self, message: pb.GetLoadRequest) -> pb.LoadInfo:
        return self.engine.load(message.include_per_rank, report_aborts=REPORT_ABORTS in request_metadata())

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        return await self.engine.health(message)

    async def abort(self, message: pb.AbortRequest) -> pb.AbortResponse:
        return await self.engine.abort(message)

    async def drain(self, message: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]:
        async for response in self.engine.drain(message):
            yield response

    async def load_lora(self, message: pb.LoadLoraRequest) -> pb.LoadLoraResponse:
        raise RpcStatusError("FAILED_PRECONDITION", _NO_LORA)

    async def unload_lora(self, message: pb.UnloadLoraRequest) -> pb.UnloadLoraResponse:
        raise RpcStatusError("FAILED_PRECONDITION", _NO_LORA)

    async def list_loras(self, message: pb.ListLorasRequest) -> pb.ListLorasResponse:
        raise RpcStatusError("FAILED_PRECONDITION", _NO_LORA)

    async def get_kv_event_sources(
        self, message: pb.GetKvEventSourcesRequest
    ) -> pb.GetKvEventSourcesResponse:
        unknown = [r for r in message.data_parallel_ranks if r != 0]
        if unknown:
            raise RpcStatusError(
                "INVALID_ARGUMENT", f"unknown data-parallel rank(s) {unknown}: this engine has rank 0"
            )
        return self.engine.discovery.kv_sources

    async def subscribe_kv_events(
        self, message: pb.SubscribeKvEventsRequest
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        raise RpcStatusError("UNIMPLEMENTED", "this engine publishes KV events over ZMQ (GetKvEventSources)")
        yield  # pragma: no cover - makes this an async generator

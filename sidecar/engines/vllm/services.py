"""The OpenEngine ``Inference`` and ``Control`` services of the vLLM adapter.

Served by the project's grpclib kit (``sidecar.openengine.serving.grpc_server``); refusals are
:class:`~sidecar.openengine.serving.grpc_server.RpcStatusError` (a non-OK status, no event). LoRA calls
answer ``FAILED_PRECONDITION`` (LoRA is not enabled on this adapter); ``SubscribeKvEvents``
answers ``UNIMPLEMENTED`` (the KV events are vLLM's own ZMQ publisher, ``GetKvEventSources``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sidecar.engines.vllm.engine import VllmEngine
from sidecar.engines.vllm.stream import run_request
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError, request_metadata

_NO_LORA = "LoRA is not enabled on this engine"
#: GetLoad metadata asking for ``attributes.aborts_by_request`` (tests: exactly one Abort per request).
REPORT_ABORTS = ("vllm-adapter-report", "aborts")


class InferenceService(pb.InferenceBase):
    """``Inference.Generate``: admission, then :func:`run_request`."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    async def generate(  # type: ignore[override]
        self, message: pb.GenerateRequest, send: Callable[[Any], Awaitable[None]]
    ) -> None:
        active = self.engine.admit(message, request_metadata())
        await run_request(self.engine, active, send)


class ControlService(pb.ControlBase):
    """``Control``: discovery, health, load, Abort, Drain and KV event sources."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    async def get_server_info(self, message: pb.GetServerInfoRequest) -> pb.ServerInfo:
        return self.engine.discovery.server

    async def get_model_info(self, message: pb.GetModelInfoRequest) -> pb.ModelInfo:
        if message.model and message.model not in self.engine.discovery.limits.names:
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

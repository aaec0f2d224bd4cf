"""The simulated engine's gRPC services (``Inference`` and ``Control``) over :class:`MockEngine`.

Refusals become non-OK statuses through :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError`;
this module never imports grpclib.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import betterproto2

from sidecar.mock import drain as drain_mod
from sidecar.mock import events as ev
from sidecar.mock.engine import MockEngine
from sidecar.mock.kvevents import UnknownDpRank
from sidecar.mock.lora import LoraError
from sidecar.mock.runner import run_request
from sidecar.mock.validation import RequestRefused, RoleMismatch
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError, request_kv_session_bytes, request_metadata

log = logging.getLogger(__name__)
R = TypeVar("R")

#: GetLoad metadata asking for ``attributes.cancel_seen_us``: {request id: µs since the epoch when
#: the engine first saw its client leave or an Abort naming it} (benchmarks: cancel -> engine).
REPORT_CANCEL_TIMES = ("mock-report", "cancel-times")
#: How long a Health call waits under the ``slow-health`` fault.
SLOW_HEALTH_DELAY = 2.0


def _status(rej: RequestRefused | LoraError) -> RpcStatusError:
    return RpcStatusError(rej.status, rej.message)


class SimulatedInference(pb.InferenceBase):
    """``Inference.Generate``: validation and admission, then :func:`run_request`."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine

    async def generate(  # type: ignore[override]
        self, message: pb.GenerateRequest, send: Callable[[Any], Awaitable[None]]
    ) -> None:
        engine = self.engine
        faults = engine.config.faults
        engine.counters.streams_open += 1
        try:
            if faults.has("late-invalid") and not betterproto2.which_one_of(message, "input")[0]:
                await _late_failure(
                    send, message, pb.ErrorCode.INVALID_ARGUMENT, "no input (fault late-invalid)"
                )
                return
            reset = await _arrive_late(faults.late_generate) if faults.late_generate else None
            try:
                req = engine.accept(message, request_metadata(), request_kv_session_bytes())
            except RoleMismatch as rej:
                if not faults.has("late-role-mismatch"):
                    raise _status(rej) from None
                await _late_failure(send, message, pb.ErrorCode.ROLE_MISMATCH, rej.message)
                return
            except RequestRefused as rej:
                raise _status(rej) from None
            if reset is not None:  # the client reset the stream before the request "arrived"
                engine.client_gone(req)
                raise reset
            await run_request(engine, req, send)
        finally:
            engine.counters.streams_open -= 1


async def _arrive_late(seconds: float) -> asyncio.CancelledError | None:
    """Fault ``late-generate``: wait ``seconds`` before the request counts as arrived; a client
    reset meanwhile (grpclib cancels the handler) does not cut the wait short (the request's
    packets were on the wire before the reset's): it is returned, to be raised once the
    request is registered."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    reset: asyncio.CancelledError | None = None
    while (left := until - loop.time()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError as err:
            reset = reset or err
    return reset


async def _late_failure(
    send: Callable[[Any], Awaitable[None]], message: pb.GenerateRequest, code: pb.ErrorCode, text: str
) -> None:
    """Faults ``late-invalid`` / ``late-role-mismatch``: accept, then fail with one EngineError."""
    error = pb.EngineError(code=code, message=text, retryable=False)
    usage = pb.Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
    await send(pb.GenerateResponse(request_id=message.request_id, error=error, usage=usage))


class SimulatedControl(pb.ControlBase):
    """``Control``: discovery, health, load, Abort, Drain, LoRA and KV-event sources.

    Fault ``oversized-answer``: the named call's answers are padded (:meth:`_answer`)."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine

    def _answer(self, rpc: str, reply: R) -> R:
        """``reply``, or its padded bytes under ``oversized-answer=RPC`` (sent as they are)."""
        size = self.engine.config.faults.oversized(rpc)
        return reply if size is None else cast(R, ev.padded(reply, size))

    async def get_server_info(self, message: pb.GetServerInfoRequest) -> pb.ServerInfo:
        await self.engine.hangs.control()
        return self._answer("GetServerInfo", self.engine.server_info())

    async def get_model_info(self, message: pb.GetModelInfoRequest) -> pb.ModelInfo:
        await self.engine.hangs.control()
        try:
            return self._answer("GetModelInfo", self.engine.model_info(message.model))
        except RequestRefused as rej:
            raise _status(rej) from None

    async def get_load(self, message: pb.GetLoadRequest) -> pb.LoadInfo:
        await self.engine.hangs.control()
        report = REPORT_CANCEL_TIMES in request_metadata()
        load = self.engine.load(message.include_per_rank, report_cancel_times=report)
        return self._answer("GetLoad", load)

    async def health(self, message: pb.HealthRequest) -> pb.HealthResponse:
        await self.engine.hangs.control()
        if self.engine.slow_health_left > 0:  # fault slow-health
            self.engine.slow_health_left -= 1
            await asyncio.sleep(SLOW_HEALTH_DELAY)
        return self._answer("Health", self.engine.health(message))

    async def abort(self, message: pb.AbortRequest) -> pb.AbortResponse:
        await self.engine.hangs.control()
        try:
            return self._answer("Abort", self.engine.abort(message))
        except RequestRefused as rej:
            raise _status(rej) from None

    async def drain(self, message: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]:
        await self.engine.hangs.control()
        first = True
        try:
            async for response in drain_mod.drain(self.engine, message):
                yield self._answer("Drain", response) if first else response
                first = False
        except RequestRefused as rej:
            raise _status(rej) from None

    async def load_lora(self, message: pb.LoadLoraRequest) -> pb.LoadLoraResponse:
        await self.engine.hangs.control()
        try:
            adapter, already = self.engine.loras.load(message.adapter)
        except LoraError as err:
            raise _status(err) from None
        reply = pb.LoadLoraResponse(adapter=adapter.to_pb(), already_loaded=already)
        return self._answer("LoadLora", reply)

    async def unload_lora(self, message: pb.UnloadLoraRequest) -> pb.UnloadLoraResponse:
        await self.engine.hangs.control()
        try:
            adapter = self.engine.loras.unload(message.lora_name)
        except LoraError as err:
            raise _status(err) from None
        return self._answer("UnloadLora", pb.UnloadLoraResponse(adapter=adapter.to_pb()))

    async def list_loras(self, message: pb.ListLorasRequest) -> pb.ListLorasResponse:
        await self.engine.hangs.control()
        if not self.engine.loras.enabled:
            raise RpcStatusError("FAILED_PRECONDITION", "LoRA is disabled on this engine")
        reply = pb.ListLorasResponse(adapters=[a.to_pb() for a in self.engine.loras.adapters()])
        return self._answer("ListLoras", reply)

    async def get_kv_event_sources(
        self, message: pb.GetKvEventSourcesRequest
    ) -> pb.GetKvEventSourcesResponse:
        await self.engine.hangs.control()
        events = self.engine.kv_events
        if events is None:
            return pb.GetKvEventSourcesResponse()
        try:
            reply: pb.GetKvEventSourcesResponse = events.sources(list(message.data_parallel_ranks))
        except UnknownDpRank as err:
            raise RpcStatusError("INVALID_ARGUMENT", str(err)) from None
        faults = self.engine.config.faults
        if faults.has("kv-missing-rank") and reply.sources:
            reply.sources = reply.sources[:-1]
        if faults.has("kv-wildcard-source"):
            for source in reply.sources:
                if source.endpoint_addr is not None:
                    source.endpoint_addr.host = "0.0.0.0"
        return self._answer("GetKvEventSources", reply)

    async def subscribe_kv_events(
        self, message: pb.SubscribeKvEventsRequest
    ) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        await self.engine.hangs.control()
        events = self.engine.kv_events
        if events is None or not hasattr(events, "subscribe"):
            raise RpcStatusError(
                "UNIMPLEMENTED", "this engine publishes KV events over ZMQ (GetKvEventSources)"
            )
        try:
            sub = events.subscribe(message)
        except UnknownDpRank as err:
            raise RpcStatusError("INVALID_ARGUMENT", str(err)) from None
        async with sub:
            async for response in sub:
                yield response

"""A scriptable grpclib OpenEngine server for EngineClient tests (runs on the test's trio-asyncio loop).

A separate fake from the suite's in-memory ``tests.fake_engine.FakeEngine`` because what it
serves is the layer under test: HTTP/2 framing, deadlines, resets, keepalive PINGs and the
channel pool of the real engine client need a real gRPC server on a real socket.

Each Generate call runs ``script(request, metadata)``: a list of responses (or callables that
raise / wait) the handler sends in order. The server records what it saw: requests, metadata,
deadlines, and when a stream was cancelled by the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpclib.const
import grpclib.server
import trio_asyncio
from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from sidecar.openengine import pb
from sidecar.openengine.serving._grpclib_internals import server_port


class _Codec(ProtoCodec):
    """betterproto2 messages; ``bytes`` sent as already-serialized messages."""

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return message_type.parse(data)


@dataclass
class Seen:
    route: str
    request: Any
    metadata: dict[str, str]
    deadline: float | None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class Gate:
    """An item of a script: the handler waits here until the test opens it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()


class FakeGrpcEngine:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.unary: dict[str, Callable[[Any], Any]] = {
            "GetServerInfo": lambda r: pb.ServerInfo(engine_name="fake", schema_revision=3),
            "GetModelInfo": lambda r: pb.ModelInfo(model_id=r.model, served_model_name=r.model),
            "GetLoad": lambda r: pb.LoadInfo(instance_id="i", running_requests=0),
            "Health": lambda r: pb.HealthResponse(state=pb.HealthState.READY),
            "Abort": lambda r: pb.AbortResponse(status=pb.AbortStatus.ABORTED),
            "LoadLora": lambda r: pb.LoadLoraResponse(adapter=r.adapter),
            "UnloadLora": lambda r: pb.UnloadLoraResponse(adapter=pb.LoraAdapter(lora_name=r.lora_name)),
            "ListLoras": lambda r: pb.ListLorasResponse(adapters=[pb.LoraAdapter(lora_id=1, lora_name="a")]),
            "GetKvEventSources": lambda r: pb.GetKvEventSourcesResponse(),
        }
        self.streams: dict[str, Callable[[Any, dict[str, str]], list[Any]]] = {}

    def _record(self, route: str, stream: grpclib.server.Stream, request: Any) -> Seen:
        md = {k: v for k, v in (stream.metadata or {}).items() if isinstance(v, str)}
        deadline = stream.deadline.time_remaining() if stream.deadline is not None else None
        s = Seen(route, request, md, deadline)
        self.seen.append(s)
        return s

    def _unary_handler(self, name: str, req_type: Any) -> Any:
        async def handle(stream: grpclib.server.Stream) -> None:
            request = await stream.recv_message()
            self._record(name, stream, request)
            result = self.unary[name](request)
            if isinstance(result, Gate):
                await result.event.wait()
                result = self.unary[name](request)
            await stream.send_message(result)

        return handle

    def _stream_handler(self, name: str) -> Any:
        async def handle(stream: grpclib.server.Stream) -> None:
            request = await stream.recv_message()
            seen = self._record(name, stream, request)
            try:
                for item in self.streams[name](request, seen.metadata):
                    if isinstance(item, Gate):
                        await item.event.wait()
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        await stream.send_message(item)
            except asyncio.CancelledError:
                seen.cancelled.set()
                raise
            finally:
                seen.finished.set()

        return handle

    def __mapping__(self) -> dict[str, Handler]:
        control = {
            "GetServerInfo": (pb.GetServerInfoRequest, pb.ServerInfo),
            "GetModelInfo": (pb.GetModelInfoRequest, pb.ModelInfo),
            "GetLoad": (pb.GetLoadRequest, pb.LoadInfo),
            "Health": (pb.HealthRequest, pb.HealthResponse),
            "Abort": (pb.AbortRequest, pb.AbortResponse),
            "LoadLora": (pb.LoadLoraRequest, pb.LoadLoraResponse),
            "UnloadLora": (pb.UnloadLoraRequest, pb.UnloadLoraResponse),
            "ListLoras": (pb.ListLorasRequest, pb.ListLorasResponse),
            "GetKvEventSources": (pb.GetKvEventSourcesRequest, pb.GetKvEventSourcesResponse),
        }
        mapping = {
            f"/openengine.v1.Control/{name}": Handler(
                self._unary_handler(name, req), Cardinality.UNARY_UNARY, req, reply
            )
            for name, (req, reply) in control.items()
        }
        for route, name, req, reply in [
            ("/openengine.v1.Inference/Generate", "Generate", pb.GenerateRequest, pb.GenerateResponse),
            ("/openengine.v1.Control/Drain", "Drain", pb.DrainRequest, pb.DrainResponse),
            (
                "/openengine.v1.Control/SubscribeKvEvents",
                "SubscribeKvEvents",
                pb.SubscribeKvEventsRequest,
                pb.SubscribeKvEventsResponse,
            ),
        ]:
            mapping[route] = Handler(self._stream_handler(name), Cardinality.UNARY_STREAM, req, reply)
        return mapping


def status(code: Status, message: str = "") -> GRPCError:
    return GRPCError(code, message)


class RunningServer:
    """A started grpclib server around a FakeGrpcEngine (TCP on 127.0.0.1:0 or a Unix socket)."""

    def __init__(self, engine: FakeGrpcEngine) -> None:
        self.engine = engine
        self.server = grpclib.server.Server([engine], codec=_Codec())
        self.address = ""
        self.transports: list[Any] = []
        #: How each connection ended: None (the client closed it), or the error (a reset).
        self.lost: list[BaseException | None] = []
        factory = self.server._protocol_factory

        def record_transport() -> Any:
            protocol = factory()
            made, lost = protocol.connection_made, protocol.connection_lost

            def connection_made(transport: Any) -> None:
                self.transports.append(transport)
                made(transport)

            def connection_lost(exc: BaseException | None) -> None:
                self.lost.append(exc)
                lost(exc)

            protocol.connection_made = connection_made  # type: ignore[method-assign]
            protocol.connection_lost = connection_lost  # type: ignore[method-assign]
            return protocol

        self.server._protocol_factory = record_transport  # type: ignore[method-assign]

    async def start(self, *, path: str | None = None, port: int = 0) -> str:
        async def start() -> None:
            if path is not None:
                await self.server.start(path=path)
            else:
                await self.server.start("127.0.0.1", port)

        await trio_asyncio.aio_as_trio(start)()
        if path is not None:
            self.address = f"unix://{path}"
        else:
            self.address = f"127.0.0.1:{server_port(self.server)}"
        return self.address

    async def stop(self) -> None:
        async def stop() -> None:
            # Like a process exit: stop listening and drop every open connection.
            self.server.close()
            for transport in self.transports:
                transport.abort()
            await self.server.wait_closed()

        await trio_asyncio.aio_as_trio(stop)()


def tokens(request_id: str, n: int, *, index: int = 0) -> list[Any]:
    """n token events then a finish carrying usage (a well-formed single-output stream)."""
    out: list[Any] = [
        pb.GenerateResponse(request_id=request_id, token=pb.TokenOutput(output_index=index, text=f"t{i}"))
        for i in range(n)
    ]
    out.append(
        pb.GenerateResponse(
            request_id=request_id,
            finished=pb.GenerationFinished(output_index=index, reason=pb.FinishReason.LENGTH),
            usage=pb.Usage(prompt_tokens=1, completion_tokens=n, total_tokens=n + 1),
        )
    )
    return out


__all__ = ["FakeGrpcEngine", "Gate", "RunningServer", "Status", "grpclib", "status", "tokens"]


def generate_pool(client: Any) -> Any:
    """The Generate pool of ``client`` (``loads()``: ``(streams, cap)`` each)."""
    return client._generate

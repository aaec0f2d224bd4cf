"""The engine client: every RPC of OpenEngine's ``Inference`` and ``Control`` services, trio-native.

Resources: two pools of HTTP/2 connections (:mod:`sidecar.openengine.transport.pool`) whose tasks
run in a nursery the client owns (:func:`open_engine_client`): one for Generate streams (at
least ``generate_channels`` connections, at most ``max_streams_per_channel`` streams each and
never more than the engine's ``SETTINGS_MAX_CONCURRENT_STREAMS``, grown and shrunk with the
load), one for everything else — unary control calls, Drain, KV-event subscriptions — so control
traffic never queues behind token streams. With a :class:`Keepalive` every connection is checked
with HTTP/2 PINGs while the engine owes it an answer. Connections open lazily and reconnect
lazily: after the engine restarts, the next call opens a new connection (callers add backoff).

Cancellation: leaving a stream's block early (break, cancel, exception), or cancelling a unary
call, resets its HTTP/2 stream at once (RST_STREAM queued synchronously and sent by the
connection's writer task, whatever the caller's scope), so the engine sees the cancellation.

Sizes: every message received is bounded by its kind's limit from its gRPC length prefix,
before it is kept, and a large one is decoded in a worker thread
(:mod:`sidecar.openengine.message_limits`).

Errors: only the typed errors of :mod:`sidecar.openengine.engine_errors` escape. Deadlines follow
trio's effective deadline (sent to the engine as ``grpc-timeout``); when it passes, the caller's
cancel scope fires as usual.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from typing import Generic, Protocol, TypeVar

import betterproto2
import trio

from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine.address import EngineAddress, parse_engine_address
from sidecar.openengine.engine_errors import (
    STATUS_TO_CODE,
    EngineClientError,
    EngineConfigError,
    EngineMessageTooLarge,
    EngineProtocolError,
    EngineStatusError,
    EngineUnavailable,
)
from sidecar.openengine.message_limits import EngineLimits, run_sized
from sidecar.openengine.schema.decode import HandedOver, decode_generate_response
from sidecar.openengine.schema.encode import encode_generate_request
from sidecar.openengine.stream_rules import DrainRules, GenerateRules, KvEventRules
from sidecar.openengine.transport.connection import GrpcCall, Keepalive
from sidecar.openengine.transport.grpc_framing import CallError, Headers, RequestHead
from sidecar.openengine.transport.pool import ConnectionOptions, ConnectionPool

__all__ = [
    "CallLike",
    "EngineClient",
    "EngineStream",
    "Keepalive",
    "MessageDecoder",
    "MetadataLike",
    "open_engine_client",
]

MetadataLike = Mapping[str, str] | Collection[tuple[str, str]]
T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)
M = TypeVar("M", bound=betterproto2.Message)

_INFERENCE = "/openengine.v1.Inference/"
_CONTROL = "/openengine.v1.Control/"

#: HTTP/2 flow control per engine connection: a small window per stream, so a stream whose
#: client stopped reading holds back only its own engine output (~64 KiB), and a large one
#: per connection, so it never blocks the other streams sharing it.
STREAM_WINDOW = 64 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
#: Most connections of the control pool (Aborts are bounded by their callers well below one
#: connection's streams; a second connection opens only past the engine's stream limit).
CONTROL_CONNECTIONS = 16

#: gRPC status names by number (the gRPC spec's codes).
_STATUS_NAMES = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]


def _as_is(data: bytes) -> bytes:
    return data


class Rules(Protocol[T_contra]):
    """An I/O-free checker of one stream's rules (:mod:`sidecar.openengine.stream_rules`)."""

    terminal: bool

    def observe(self, resp: T_contra, /) -> object: ...

    def check_end(self) -> None: ...


class _NoRules:
    """Accepts everything and never marks the stream terminal (``checked=False``)."""

    __slots__ = ("terminal",)

    def __init__(self) -> None:
        self.terminal = False

    def observe(self, resp: object, /) -> None:
        return None

    def check_end(self) -> None:
        return None


def _metadata(metadata: MetadataLike | None) -> list[tuple[str, str]] | None:
    if not metadata:
        return None
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    return [(str(k), str(v)) for k, v in items]


def _timeout() -> float | None:
    deadline = trio.current_effective_deadline()
    if math.isinf(deadline):
        return None
    return max(deadline - trio.current_time(), 0.001)


async def _typed(err: CallError, what: str) -> EngineClientError:
    """A failed call as one of our typed errors. A ``DEADLINE_EXCEEDED`` while the caller has a
    deadline waits for that deadline first, so the caller's own scope fires (as if trio had
    timed out first: the engine's clock may run a little ahead of ours)."""
    if err.too_large is not None:
        return EngineMessageTooLarge(*err.too_large)
    if err.status is not None:
        if 0 <= err.status < len(_STATUS_NAMES):
            name, number, message = _STATUS_NAMES[err.status], err.status, err.message
        else:
            name, number, message = "UNKNOWN", 2, f"Invalid grpc-status: {err.status!r}"
        if name == "DEADLINE_EXCEEDED" and not math.isinf(deadline := trio.current_effective_deadline()):
            await trio.sleep_until(deadline)
            return EngineUnavailable(f"{what}: deadline exceeded before the engine answered")
        return EngineStatusError(name, number, message, STATUS_TO_CODE.get(name))
    if err.lost:
        return EngineUnavailable(f"{what}: engine unreachable or connection lost ({err.message})")
    return EngineProtocolError(f"{what}: {err.message}")


class CallLike(Protocol):
    """What an :class:`EngineStream` reads: a call's messages as bytes, ``None`` at a good end;
    a failure as :class:`~sidecar.openengine.transport.grpc_framing.CallError` (mapped to a typed error) or
    a typed error itself. :class:`~sidecar.openengine.transport.connection.Call` is the one in production."""

    @property
    def ready(self) -> bool: ...

    async def receive(self) -> bytes | None: ...

    def cancel(self) -> None: ...


class MessageDecoder(Generic[T]):
    """How one route's messages are decoded: up to ``inline_max`` bytes here, larger ones in a
    worker thread (``limiter`` bounds those; trio's default one when None)."""

    __slots__ = ("_limiter", "decode", "inline_max")

    def __init__(
        self,
        decode: Callable[[bytes], T],
        inline_max: int = EngineLimits.decode_inline_bytes,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.decode = decode
        self.inline_max = inline_max
        self._limiter = limiter

    async def __call__(self, data: bytes) -> T:
        if len(data) <= self.inline_max:
            return self.decode(data)
        return await run_sized(self.decode, data, inline_max=0, limiter=self._limiter)


class EngineStream(Generic[T]):
    """A server stream: ``async for msg in stream``.

    Validates each message with the stream's rules; a terminal ``EngineError`` raises
    :class:`~sidecar.openengine.engine_errors.EngineTerminalError`, a rule violation
    :class:`~sidecar.openengine.engine_errors.EngineProtocolError`, a lost connection
    :class:`~sidecar.openengine.engine_errors.EngineUnavailable`, a non-OK status
    :class:`~sidecar.openengine.engine_errors.EngineStatusError` (after the messages before it).
    ``terminal_seen`` tells whether the request reached its terminal event (the sidecar sends no
    Abort then). ``kv_session_bytes``: the engine's ``KvSessionRef`` exactly as it came over the
    wire, from the moment a Generate stream yields its ``PrefillReady`` (re-serialising the
    parsed message could reorder fields or drop a newer revision's; a handoff is relayed byte
    for byte).
    """

    __slots__ = (
        "_call",
        "_decoder",
        "_done",
        "_failure",
        "_rules",
        "_what",
        "kv_session_bytes",
        "messages",
        "request_id",
    )

    def __init__(
        self,
        call: CallLike | None,
        failure: EngineClientError | None,
        decoder: MessageDecoder[T | HandedOver],
        rules: Rules[T],
        request_id: str = "",
        what: str = "",
    ) -> None:
        """``call``: what the messages come from; None with ``failure``, the error the first
        step raises (the call could not start). ``what``: the RPC's name, for messages."""
        self._call = call
        self._failure = failure  # the call could not start: raised at the first step
        self._decoder = decoder
        self._rules = rules
        self._what = what
        self._done = False
        self.request_id = request_id
        self.messages = 0
        self.kv_session_bytes: bytes | None = None

    @property
    def terminal_seen(self) -> bool:
        return self._rules.terminal

    @property
    def ready(self) -> bool:
        """The next step (a message or the end) needs no wait for the engine: it arrived
        already (a relay arms its inactivity deadline only before a wait)."""
        return self._done or self._call is None or self._call.ready

    def __aiter__(self) -> EngineStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        call = self._call
        if call is None:
            await trio.lowlevel.checkpoint()
            self._done = True
            raise self._failure or EngineUnavailable(f"{self._what}: the call did not start")
        try:
            data = await call.receive()
        except CallError as err:
            self._done = True
            raise await _typed(err, self._what) from None
        except EngineClientError:
            self._done = True
            raise
        if data is None:
            self._done = True
            self._rules.check_end()
            raise StopAsyncIteration
        decoder = self._decoder
        try:  # (the check inline: one coroutine less per token)
            msg = decoder.decode(data) if len(data) <= decoder.inline_max else await decoder(data)
        except Exception as err:  # betterproto2 raises assorted errors on malformed protobuf
            call.cancel()
            self._done = True
            raise EngineProtocolError(
                f"{self._what}: engine sent something undecodable ({type(err).__name__}: {err})"
            ) from None
        if type(msg) is HandedOver:
            self.kv_session_bytes = msg.raw
            item: T = msg.message  # type: ignore[assignment]  # only Generate's decoder hands over
        else:
            item = msg  # type: ignore[assignment]
        self.messages += 1
        try:
            self._rules.observe(item)
        except EngineClientError:
            self._done = True
            raise
        return item


class _OpenStream(Generic[T]):
    """``async with``: a server stream on a connection of ``pool``, as an :class:`EngineStream`.
    Entering never fails for the engine's sake (a call that cannot start fails at the first
    step). Leaving resets the stream unless it ended and gives its place in the pool back.

    A class rather than an ``asynccontextmanager``: one per request, and trio registers every
    async generator it runs."""

    __slots__ = (
        "_body",
        "_call",
        "_decoder",
        "_headers",
        "_max",
        "_pool",
        "_release",
        "_request_id",
        "_rules",
        "_what",
    )

    def __init__(
        self,
        pool: ConnectionPool | None,
        headers: Headers | EngineClientError,
        body: bytes,
        max_message: int,
        decoder: MessageDecoder[T | HandedOver],
        rules: Rules[T],
        request_id: str,
        what: str,
    ) -> None:
        self._pool = pool
        self._headers = headers
        self._body = body
        self._max = max_message
        self._decoder = decoder
        self._rules = rules
        self._request_id = request_id
        self._what = what
        self._call: GrpcCall | None = None
        self._release: Callable[[], None] | None = None

    async def __aenter__(self) -> EngineStream[T]:
        failure: EngineClientError | None = None
        try:
            if isinstance(self._headers, EngineClientError):
                failure = self._headers
            elif self._pool is None:
                failure = EngineUnavailable("engine client is closed or was not opened by open_engine_client")
            else:
                conn, self._release = await self._pool.acquire()
                self._call = conn.start_call(self._headers, self._body, max_message=self._max)
        except CallError as err:
            failure = await _typed(err, self._what)
        except BaseException:
            self._leave()
            raise
        return EngineStream(self._call, failure, self._decoder, self._rules, self._request_id, self._what)

    async def __aexit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._release is not None:
            self._release()
            self._release = None


class EngineClient:
    """Trio-native calls to one engine. Create with :func:`open_engine_client`."""

    def __init__(
        self,
        address: EngineAddress,
        *,
        generate_channels: int = 4,
        max_streams_per_channel: int = 128,
        max_generate_channels: int = 256,
        idle_channel_close: float = 5.0,
        keepalive: Keepalive | None = None,
        limits: EngineLimits | None = None,
    ) -> None:
        self.address = address
        self._keepalive = keepalive
        self.limits = limits or EngineLimits()
        self._decode_limiter = trio.CapacityLimiter(self.limits.decode_threads)
        self._min_generate = generate_channels
        self._max_streams = max_streams_per_channel
        self._max_generate = max_generate_channels
        self._idle_close = idle_channel_close
        self._generate: ConnectionPool | None = None  # both pools from ``_start``
        self._control: ConnectionPool | None = None
        self._generate_decoder: MessageDecoder[pb.GenerateResponse | HandedOver] = MessageDecoder(
            decode_generate_response, self.limits.decode_inline_bytes, self._decode_limiter
        )
        authority = "localhost" if address.path is not None else f"{address.host}:{address.port}"
        self._heads: dict[str, RequestHead] = {}
        self._authority = authority
        self._closed = False

    def _start(self, nursery: trio.Nursery) -> None:
        """Give the client the nursery its connections run in (:func:`open_engine_client`)."""
        options = ConnectionOptions(STREAM_WINDOW, CONNECTION_WINDOW, self._keepalive)
        name = str(self.address)
        self._generate = ConnectionPool(
            self._connect,
            nursery,
            min_connections=self._min_generate,
            max_streams_per_connection=self._max_streams,
            max_connections=self._max_generate,
            idle_close=self._idle_close,
            options=options,
            name=name,
        )
        self._control = ConnectionPool(
            self._connect,
            nursery,
            min_connections=1,
            max_streams_per_connection=self._max_streams,
            max_connections=CONTROL_CONNECTIONS,
            idle_close=self._idle_close,
            options=options,
            name=name + " (control)",
        )

    async def _connect(self) -> trio.abc.Stream:
        a = self.address
        if a.path is not None:
            return await trio.open_unix_socket(a.path)
        assert a.host is not None and a.port is not None
        return await trio.open_tcp_stream(a.host, a.port)

    @property
    def generate_channel_count(self) -> int:
        """HTTP/2 connections in the Generate pool (for metrics)."""
        return self._generate.channel_count if self._generate is not None else 0

    @property
    def generate_stream_count(self) -> int:
        """Generate streams holding a place in the pool (for metrics)."""
        return self._generate.stream_count if self._generate is not None else 0

    def probe_liveness(self) -> None:
        """One HTTP/2 PING now on every open connection (with a keepalive): a connection whose
        PING goes unanswered within the keepalive timeout is closed, failing its calls. Used
        when the engine stops answering ``Health`` (:mod:`sidecar.openengine.transport.connection`)."""
        for pool in (self._generate, self._control):
            if pool is not None:
                for conn in pool.connections():
                    conn.ping()

    async def aclose(self) -> None:
        """Close every connection (idempotent). In-flight calls fail with EngineUnavailable."""
        self._close()
        await trio.lowlevel.checkpoint()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            for pool in (self._generate, self._control):
                if pool is not None:
                    pool.close()

    def _headers(self, route: str, metadata: MetadataLike | None) -> Headers | EngineClientError:
        head = self._heads.get(route)
        if head is None:
            head = self._heads[route] = RequestHead(self._authority, route)
        try:
            return head.headers(_timeout(), _metadata(metadata))
        except ValueError as err:
            return EngineConfigError(f"{route.rsplit('/', 1)[-1]}: {err}")

    # -- unary calls ----------------------------------------------------------------------

    async def _unary(
        self,
        route: str,
        request: betterproto2.Message | bytes,
        decode: Callable[[bytes], T],
        metadata: MetadataLike | None,
    ) -> T:
        what = route.rsplit("/", 1)[-1]
        headers = self._headers(route, metadata)
        if isinstance(headers, EngineClientError):
            raise headers
        if self._control is None:
            raise EngineUnavailable("engine client is closed or was not opened by open_engine_client")
        body = request if isinstance(request, bytes) else bytes(request)
        call: GrpcCall | None = None
        release: Callable[[], None] | None = None
        try:
            conn, release = await self._control.acquire()
            call = conn.start_call(headers, body, max_message=self.limits.max_answer_bytes)
            data = await call.receive()
            if data is None:
                raise EngineProtocolError(f"{what}: engine closed the call without a reply")
            if await call.receive() is not None:
                raise EngineProtocolError(f"{what}: engine sent more than one reply")
        except CallError as err:
            raise await _typed(err, what) from None
        finally:
            if call is not None:
                call.cancel()
            if release is not None:
                release()
        try:
            return await MessageDecoder(decode, self.limits.decode_inline_bytes, self._decode_limiter)(data)
        except Exception as err:  # betterproto2 raises assorted errors on malformed protobuf
            raise EngineProtocolError(
                f"{what}: engine sent something undecodable ({type(err).__name__}: {err})"
            ) from None

    async def get_server_info(self, *, metadata: MetadataLike | None = None) -> pb.ServerInfo:
        return await self._unary(
            _CONTROL + "GetServerInfo", pb.GetServerInfoRequest(), pb.ServerInfo.parse, metadata
        )

    async def get_model_info(self, model: str = "", *, metadata: MetadataLike | None = None) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest(model=model)
        return await self._unary(_CONTROL + "GetModelInfo", request, pb.ModelInfo.parse, metadata)

    async def get_load(
        self, include_per_rank: bool = True, *, metadata: MetadataLike | None = None
    ) -> pb.LoadInfo:
        request = pb.GetLoadRequest(include_per_rank=include_per_rank)
        return await self._unary(_CONTROL + "GetLoad", request, pb.LoadInfo.parse, metadata)

    async def get_load_bytes(
        self, include_per_rank: bool = True, *, metadata: MetadataLike | None = None
    ) -> bytes:
        """GetLoad, the answer as the engine's serialized ``LoadInfo``: nothing is parsed while
        it is received (a poller can parse what it needs, and large ``attributes`` off the
        event loop: ``sidecar.core.load.split_load_info``)."""
        request = pb.GetLoadRequest(include_per_rank=include_per_rank)
        return await self._unary(_CONTROL + "GetLoad", request, _as_is, metadata)

    async def health(
        self, request: pb.HealthRequest | None = None, *, metadata: MetadataLike | None = None
    ) -> pb.HealthResponse:
        request = request or pb.HealthRequest()
        return await self._unary(_CONTROL + "Health", request, pb.HealthResponse.parse, metadata)

    async def abort(
        self, request: pb.AbortRequest | bytes, *, metadata: MetadataLike | None = None
    ) -> pb.AbortResponse:
        """Abort; ``request`` may be an already-serialized ``AbortRequest`` (sent unchanged,
        e.g. to carry a ``KvSessionRef`` byte for byte)."""
        return await self._unary(_CONTROL + "Abort", request, pb.AbortResponse.parse, metadata)

    async def load_lora(
        self, request: pb.LoadLoraRequest, *, metadata: MetadataLike | None = None
    ) -> pb.LoadLoraResponse:
        return await self._unary(_CONTROL + "LoadLora", request, pb.LoadLoraResponse.parse, metadata)

    async def unload_lora(
        self, request: pb.UnloadLoraRequest, *, metadata: MetadataLike | None = None
    ) -> pb.UnloadLoraResponse:
        return await self._unary(_CONTROL + "UnloadLora", request, pb.UnloadLoraResponse.parse, metadata)

    async def list_loras(self, *, metadata: MetadataLike | None = None) -> pb.ListLorasResponse:
        request = pb.ListLorasRequest()
        return await self._unary(_CONTROL + "ListLoras", request, pb.ListLorasResponse.parse, metadata)

    async def get_kv_event_sources(
        self, request: pb.GetKvEventSourcesRequest | None = None, *, metadata: MetadataLike | None = None
    ) -> pb.GetKvEventSourcesResponse:
        request = request or pb.GetKvEventSourcesRequest()
        return await self._unary(
            _CONTROL + "GetKvEventSources", request, pb.GetKvEventSourcesResponse.parse, metadata
        )

    # -- server streams -------------------------------------------------------------------

    def _stream(
        self,
        pool: ConnectionPool | None,
        route: str,
        body: bytes,
        max_message: int,
        decoder: MessageDecoder[T | HandedOver],
        rules: Rules[T],
        metadata: MetadataLike | None,
        request_id: str = "",
    ) -> _OpenStream[T]:
        headers = self._headers(route, metadata)
        what = route.rsplit("/", 1)[-1]
        return _OpenStream(pool, headers, body, max_message, decoder, rules, request_id, what)

    def generate(
        self, request: pb.GenerateRequest, *, metadata: MetadataLike | None = None, checked: bool = True
    ) -> _OpenStream[pb.GenerateResponse]:
        """Open a Generate stream: ``async with client.generate(request) as stream: async for
        event in stream`` (see :class:`EngineStream`). Leaving the block resets the stream.

        ``checked=False`` (here and on the other streams): no stream rules — every message as
        the engine sent it, an ``EngineError`` event yielded like any other (what a conformance
        suite needs, to judge it afterwards); status and transport errors still raise."""
        rules: Rules[pb.GenerateResponse] = GenerateRules.for_request(request) if checked else _NoRules()
        body = encode_generate_request(request) or bytes(request)
        return self._stream(
            self._generate,
            _INFERENCE + "Generate",
            body,
            self.limits.max_event_bytes,
            self._generate_decoder,
            rules,
            metadata,
            request.request_id,
        )

    def _parser(self, message_type: type[M]) -> MessageDecoder[M | HandedOver]:
        return MessageDecoder(message_type.parse, self.limits.decode_inline_bytes, self._decode_limiter)

    def drain(
        self, request: pb.DrainRequest, *, metadata: MetadataLike | None = None, checked: bool = True
    ) -> _OpenStream[pb.DrainResponse]:
        """Open a Drain stream (an :class:`EngineStream` of ``pb.DrainResponse``)."""
        rules: Rules[pb.DrainResponse] = DrainRules() if checked else _NoRules()
        return self._stream(
            self._control,
            _CONTROL + "Drain",
            bytes(request),
            self.limits.max_answer_bytes,
            self._parser(pb.DrainResponse),
            rules,
            metadata,
        )

    def subscribe_kv_events(
        self,
        request: pb.SubscribeKvEventsRequest,
        *,
        metadata: MetadataLike | None = None,
        max_message_bytes: int | None = None,
        checked: bool = True,
    ) -> _OpenStream[pb.SubscribeKvEventsResponse]:
        """Open a KV-event subscription (an :class:`EngineStream` of
        ``pb.SubscribeKvEventsResponse``).

        A message larger than ``max_message_bytes`` (default: the client's
        ``limits.max_kv_batch_bytes``) fails the stream with
        :class:`~sidecar.openengine.engine_errors.EngineMessageTooLarge` before it is read.
        """
        rules: Rules[pb.SubscribeKvEventsResponse] = KvEventRules() if checked else _NoRules()
        bound = self.limits.max_kv_batch_bytes if max_message_bytes is None else max_message_bytes
        return self._stream(
            self._control,
            _CONTROL + "SubscribeKvEvents",
            bytes(request),
            bound,
            self._parser(pb.SubscribeKvEventsResponse),
            rules,
            metadata,
        )


@asynccontextmanager
async def open_engine_client(
    address: str | EngineAddress,
    *,
    generate_channels: int = 4,
    max_streams_per_channel: int = 128,
    max_generate_channels: int = 256,
    idle_channel_close: float = 5.0,
    keepalive: Keepalive | None = None,
    limits: EngineLimits | None = None,
) -> AsyncIterator[EngineClient]:
    """An :class:`EngineClient` for ``address`` (``host:port``, ``http://host:port``, ``unix:///path``).

    No connection is made until the first call. Raises
    :class:`~sidecar.openengine.engine_errors.EngineConfigError` for an address it cannot parse. The
    client's connections run in a background nursery owned by this context; leaving it closes
    every connection (in-flight calls fail with ``EngineUnavailable``). ``generate_channels`` is
    the Generate pool's minimum size; ``max_streams_per_channel`` caps the streams per connection
    (below the engine's own advertised cap); ``max_generate_channels`` bounds the pool; extra
    connections are closed ``idle_channel_close`` seconds after their last stream ended;
    ``keepalive`` checks every connection's liveness with HTTP/2 PINGs; ``limits`` bounds every
    message received (:class:`~sidecar.openengine.message_limits.EngineLimits`).
    """
    addr = address if isinstance(address, EngineAddress) else parse_engine_address(address)
    client = EngineClient(
        addr,
        generate_channels=generate_channels,
        max_streams_per_channel=max_streams_per_channel,
        max_generate_channels=max_generate_channels,
        idle_channel_close=idle_channel_close,
        keepalive=keepalive,
        limits=limits,
    )
    async with open_background_nursery() as nursery:
        client._start(nursery)
        try:
            yield client
        finally:
            client._close()
            nursery.cancel_scope.cancel()

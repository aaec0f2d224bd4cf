"""The trio-facing OpenEngine client: every RPC of ``Inference`` and ``Control``.

Resources: grpclib channels (HTTP/2 connections; with a ``keepalive``, each checked with
HTTP/2 PINGs while the engine owes it an answer) — one for control calls, one for KV-event
subscriptions, and a pool for Generate streams (at least ``generate_channels``, at most
``max_streams_per_channel`` streams each and never more than the engine's
``SETTINGS_MAX_CONCURRENT_STREAMS``; grown and shrunk with the load, see
:mod:`sidecar.openengine.channel_pool`) — so control traffic never queues behind token
streams. Channels reconnect lazily: after the engine restarts, the next call opens a new
connection (callers add backoff).

Cancellation: each call's whole grpclib lifecycle (open, send, receive, close) runs in ONE
asyncio coroutine that trio awaits once (docs/design/stack-notes.md: wrapping ``open()`` itself leaks the
stream). Cancelling the trio caller cancels that coroutine, whose ``async with`` resets the
HTTP/2 stream, so the engine sees the cancellation at once.

Sizes: every message received is bounded by its kind's limit before it is read, and a large
one is decoded in a worker thread (:mod:`sidecar.openengine.message_limits`).

Errors: only the typed errors of :mod:`sidecar.openengine.errors` escape. Deadlines follow
trio's effective deadline (sent to the engine as ``grpc-timeout``); when it passes, the
caller's cancel scope fires as usual.

Must run inside ``trio_asyncio.open_loop()``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import betterproto2
import grpclib.exceptions
import h2.exceptions
import trio
import trio_asyncio
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality

from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine._grpclib_internals import recv_bounded
from sidecar.openengine.address import EngineAddress, parse_engine_address
from sidecar.openengine.channel_pool import GeneratePool, Keepalive, SettingsAwareChannel, probe_liveness
from sidecar.openengine.codec import Codec, HandedOver, Serialized
from sidecar.openengine.errors import (
    STATUS_TO_CODE,
    EngineClientError,
    EngineConfigError,
    EngineProtocolError,
    EngineStatusError,
    EngineUnavailable,
)
from sidecar.openengine.fastencode import encode_generate_request
from sidecar.openengine.message_limits import EngineLimits, run_sized
from sidecar.openengine.stream_rules import DrainRules, GenerateRules, KvEventRules
from sidecar.openengine.trio_generate import OpenCall, RequestHead
from sidecar.openengine.trio_pool import ConnectionPool

__all__ = ["TRANSPORTS", "EngineClient", "EngineStream", "Keepalive", "open_engine_client"]

#: Generate transports (``run --engine-transport``): grpclib on the trio-asyncio loop, or the
#: trio-native HTTP/2 connection (:mod:`sidecar.openengine.trio_h2` over
#: :mod:`sidecar.openengine.h2_client`).
TRANSPORTS = ("grpclib", "trio")
#: The transport of a client opened without one (tests may set it for a whole run).
DEFAULT_TRANSPORT = "trio"

MetadataLike = Mapping[str, str] | Collection[tuple[str, str]]
T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)
Picked = tuple[Channel, Callable[[], None]]

_INFERENCE = "/openengine.v1.Inference/"
_CONTROL = "/openengine.v1.Control/"


class _Rules(Protocol[T_contra]):
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


#: HTTP/2 flow control per engine connection: a small window per stream, so a stream whose
#: client stopped reading holds back only its own engine output (~64 KiB), and a large one
#: per connection, so it never blocks the other streams sharing the channel.
_CHANNEL_CONFIG = Configuration(
    http2_stream_window_size=64 * 1024, http2_connection_window_size=16 * 1024 * 1024
)


class _DeadlineHit(Exception):
    """grpclib's own timeout fired; the trio caller's deadline is due."""


def _translate(exc: BaseException, what: str) -> BaseException:
    """Map a grpclib/h2/OS exception to one of our typed errors (or pass through)."""
    if isinstance(exc, EngineClientError | _DeadlineHit):
        return exc
    if isinstance(exc, grpclib.exceptions.GRPCError):
        name = exc.status.name
        return EngineStatusError(name, exc.status.value, exc.message or "", STATUS_TO_CODE.get(name))
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return _DeadlineHit()
    if isinstance(
        exc,
        grpclib.exceptions.StreamTerminatedError
        | grpclib.exceptions.ProtocolError
        | h2.exceptions.H2Error
        | ConnectionError
        | OSError
        | EOFError,
    ):
        return EngineUnavailable(
            f"{what}: engine unreachable or connection lost ({type(exc).__name__}: {exc})"
        )
    return EngineProtocolError(f"{what}: engine sent something undecodable ({type(exc).__name__}: {exc})")


async def _raise_translated(exc: BaseException) -> None:
    if isinstance(exc, _DeadlineHit):
        # Let the caller's cancel scope fire, exactly as if trio had timed out first.
        await trio.sleep_until(trio.current_effective_deadline())
        raise EngineUnavailable("deadline exceeded before the engine answered")
    raise exc


class EngineStream(Generic[T]):
    """A trio-native server stream: ``async for msg in stream``.

    Validates each message with the stream's rules; a terminal ``EngineError`` raises
    :class:`EngineTerminalError`, a rule violation :class:`EngineProtocolError`, a lost
    connection :class:`EngineUnavailable`. ``terminal_seen`` tells whether the request
    reached its terminal event (the sidecar sends no Abort then). ``kv_session_bytes``: the
    engine's ``KvSessionRef`` exactly as it came over the wire, from the moment a Generate
    stream yields its ``PrefillReady`` (re-serialising the parsed message could reorder fields or
    drop a newer revision's; a handoff is relayed byte for byte).
    """

    def __init__(
        self, receive: trio.MemoryReceiveChannel[Any], rules: _Rules[T], request_id: str = ""
    ) -> None:
        # ``receive`` carries T, or a PrefillReady event wrapped with its raw session bytes
        self._receive = receive
        self._rules = rules
        self._failure: BaseException | None = None
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
        if self._done:
            return True
        source = self._receive
        if type(source) is trio.MemoryReceiveChannel:  # the grpclib pump's channel
            return source.statistics().current_buffer_used > 0
        return bool(source.ready)  # trio_generate.CallSource

    def __aiter__(self) -> EngineStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self._receive.receive()
        except trio.EndOfChannel:
            self._done = True
            if self._failure is not None:
                await _raise_translated(self._failure)
            self._rules.check_end()
            raise StopAsyncIteration from None
        if type(msg) is HandedOver:
            self.kv_session_bytes = msg.raw
            msg = msg.message
        item: T = msg  # the channel carries T (a HandedOver only around a GenerateResponse)
        self.messages += 1
        try:
            self._rules.observe(item)
        except EngineClientError:
            self._done = True
            raise
        return item


class _TrioGenerate(OpenCall):
    """``async with``: the :class:`EngineStream` of a Generate call on the trio-native transport
    (a class, not an ``asynccontextmanager``: see :class:`OpenCall`)."""

    __slots__ = ("_request_id", "_rules")

    def __init__(self, rules: _Rules[pb.GenerateResponse], request_id: str, *call: Any) -> None:
        """``call``: the arguments of :class:`OpenCall`."""
        super().__init__(*call)
        self._rules = rules
        self._request_id = request_id

    async def __aenter__(self) -> EngineStream[pb.GenerateResponse]:  # type: ignore[override]
        source = await super().__aenter__()
        stream: EngineStream[pb.GenerateResponse] = EngineStream(source, self._rules, self._request_id)  # type: ignore[arg-type]
        source.stream = stream
        return stream


class EngineClient:
    """Trio-native calls to one engine. Create with :func:`open_engine_client`."""

    def __init__(
        self,
        address: EngineAddress,
        *,
        generate_channels: int = 4,
        stream_buffer: int = 64,
        max_streams_per_channel: int = 128,
        max_generate_channels: int = 256,
        idle_channel_close: float = 5.0,
        keepalive: Keepalive | None = None,
        limits: EngineLimits | None = None,
        transport: str | None = None,
    ) -> None:
        self.address = address
        self.transport = transport or DEFAULT_TRANSPORT
        if self.transport not in TRANSPORTS:
            raise EngineConfigError(
                f"engine transport {self.transport!r}: expected one of {', '.join(TRANSPORTS)}"
            )
        self._keepalive = keepalive
        self.limits = limits or EngineLimits()
        self._decode_limiter = trio.CapacityLimiter(self.limits.decode_threads)
        self._stream_buffer = stream_buffer
        self._control: Channel | None = None
        self._kv: Channel | None = None
        self._generate = GeneratePool(
            self._new_channel,
            min_channels=generate_channels,
            max_streams_per_channel=max_streams_per_channel,
            max_channels=max_generate_channels,
            idle_close=idle_channel_close,
        )
        self._pool_options: dict[str, Any] = {
            "min_connections": generate_channels,
            "max_streams_per_connection": max_streams_per_channel,
            "max_connections": max_generate_channels,
            "idle_close": idle_channel_close,
            "connection_options": {
                "keepalive": keepalive,
                "max_message": self.limits.max_event_bytes,
                "stream_window": _CHANNEL_CONFIG.http2_stream_window_size,
                "conn_window": _CHANNEL_CONFIG.http2_connection_window_size,
            },
        }
        self._trio_pool: ConnectionPool | None = None  # --engine-transport trio (``_start``)
        self._generate_decode = partial(Codec().decode, message_type=pb.GenerateResponse)
        self._generate_decode_large = partial(
            run_sized, self._generate_decode, inline_max=0, limiter=self._decode_limiter
        )
        authority = "localhost" if address.path is not None else f"{address.host}:{address.port}"
        self._generate_head = RequestHead(authority, _INFERENCE + "Generate")
        self._closed = False

    def _start(self, nursery: trio.Nursery) -> None:
        """Give the client the nursery its trio-native Generate connections run in."""
        if self.transport == "trio":
            self._trio_pool = ConnectionPool(
                self._connect, nursery, name=str(self.address), **self._pool_options
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
        if self._trio_pool is not None:
            return self._trio_pool.channel_count
        return self._generate.channel_count

    @property
    def generate_stream_count(self) -> int:
        """Generate streams holding a place in the pool (for metrics)."""
        if self._trio_pool is not None:
            return self._trio_pool.stream_count
        return self._generate.stream_count

    # -- channels (asyncio side only) -------------------------------------------------

    def _new_channel(self) -> Channel:
        if self._closed:
            raise EngineUnavailable("engine client is closed")
        a = self.address
        kw: dict[str, Any] = {
            "codec": Codec(),
            "status_details_codec": None,
            "config": _CHANNEL_CONFIG,
            "keepalive": self._keepalive,
        }
        if a.path is not None:
            return SettingsAwareChannel(path=a.path, **kw)
        return SettingsAwareChannel(a.host, a.port, **kw)

    def _control_channel(self) -> Channel:
        if self._control is None:
            self._control = self._new_channel()
        return self._control

    def _kv_channel(self) -> Channel:
        if self._kv is None:
            self._kv = self._new_channel()
        return self._kv

    async def probe_liveness(self) -> None:
        """One HTTP/2 PING now on every open connection (with a keepalive): a connection whose
        PING goes unanswered within the keepalive timeout is aborted, failing its streams.
        Used when the engine stops answering ``Health`` (channel_pool module doc)."""
        if self._trio_pool is not None:
            for conn in self._trio_pool.connections():
                conn.ping()
        channels = [c for c in (self._control, self._kv, *self._generate.channels()) if c is not None]

        async def probe() -> None:
            for channel in channels:
                probe_liveness(channel)

        await trio_asyncio.aio_as_trio(probe)()

    async def aclose(self) -> None:
        """Close every connection (idempotent). In-flight calls fail with EngineUnavailable."""
        if self._closed:
            return
        self._closed = True
        if self._trio_pool is not None:
            self._trio_pool.close()
        channels = [c for c in (self._control, self._kv, *self._generate.close()) if c is not None]
        self._control = self._kv = None

        async def close_all() -> None:
            for ch in channels:
                ch.close()

        with trio.CancelScope(shield=True):
            await trio_asyncio.aio_as_trio(close_all)()

    # -- unary calls ----------------------------------------------------------------------

    async def _unary(self, route: str, request: Any, reply_type: type[T], metadata: MetadataLike | None) -> T:
        timeout = _timeout()
        md = _metadata(metadata)
        limits, decode_large = self.limits, self._decode_large

        async def call() -> T:
            channel = self._control_channel()
            async with channel.request(
                route, Cardinality.UNARY_UNARY, type(request), reply_type, timeout=timeout, metadata=md
            ) as stream:
                await stream.send_message(request, end=True)
                reply: T | None = await recv_bounded(
                    stream, limits.max_answer_bytes, decode_large, limits.decode_inline_bytes
                )
            if reply is None:
                raise EngineProtocolError(f"{route}: engine closed the call without a reply")
            return reply

        try:
            answer: T = await trio_asyncio.aio_as_trio(call)()
            return answer
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            await _raise_translated(_translate(exc, route.rsplit("/", 1)[-1]))
            raise AssertionError("unreachable") from None

    async def get_server_info(self, *, metadata: MetadataLike | None = None) -> pb.ServerInfo:
        return await self._unary(
            _CONTROL + "GetServerInfo", pb.GetServerInfoRequest(), pb.ServerInfo, metadata
        )

    async def get_model_info(self, model: str = "", *, metadata: MetadataLike | None = None) -> pb.ModelInfo:
        return await self._unary(
            _CONTROL + "GetModelInfo", pb.GetModelInfoRequest(model=model), pb.ModelInfo, metadata
        )

    async def get_load(
        self, include_per_rank: bool = True, *, metadata: MetadataLike | None = None
    ) -> pb.LoadInfo:
        request = pb.GetLoadRequest(include_per_rank=include_per_rank)
        return await self._unary(_CONTROL + "GetLoad", request, pb.LoadInfo, metadata)

    async def get_load_bytes(
        self, include_per_rank: bool = True, *, metadata: MetadataLike | None = None
    ) -> bytes:
        """GetLoad, the answer as the engine's serialized ``LoadInfo``: nothing is parsed while
        it is received (a poller can parse what it needs, and large ``attributes`` off the
        event loop: ``sidecar.core.load.split_load_info``)."""
        request = pb.GetLoadRequest(include_per_rank=include_per_rank)
        reply = await self._unary(_CONTROL + "GetLoad", request, Serialized, metadata)
        return reply.data

    async def health(
        self, request: pb.HealthRequest | None = None, *, metadata: MetadataLike | None = None
    ) -> pb.HealthResponse:
        request = request or pb.HealthRequest()
        return await self._unary(_CONTROL + "Health", request, pb.HealthResponse, metadata)

    async def abort(
        self, request: pb.AbortRequest | bytes, *, metadata: MetadataLike | None = None
    ) -> pb.AbortResponse:
        """Abort; ``request`` may be an already-serialized ``AbortRequest`` (sent unchanged,
        e.g. to carry a ``KvSessionRef`` byte for byte)."""
        return await self._unary(_CONTROL + "Abort", request, pb.AbortResponse, metadata)

    async def load_lora(
        self, request: pb.LoadLoraRequest, *, metadata: MetadataLike | None = None
    ) -> pb.LoadLoraResponse:
        return await self._unary(_CONTROL + "LoadLora", request, pb.LoadLoraResponse, metadata)

    async def unload_lora(
        self, request: pb.UnloadLoraRequest, *, metadata: MetadataLike | None = None
    ) -> pb.UnloadLoraResponse:
        return await self._unary(_CONTROL + "UnloadLora", request, pb.UnloadLoraResponse, metadata)

    async def list_loras(self, *, metadata: MetadataLike | None = None) -> pb.ListLorasResponse:
        return await self._unary(
            _CONTROL + "ListLoras", pb.ListLorasRequest(), pb.ListLorasResponse, metadata
        )

    async def get_kv_event_sources(
        self, request: pb.GetKvEventSourcesRequest | None = None, *, metadata: MetadataLike | None = None
    ) -> pb.GetKvEventSourcesResponse:
        request = request or pb.GetKvEventSourcesRequest()
        return await self._unary(
            _CONTROL + "GetKvEventSources", request, pb.GetKvEventSourcesResponse, metadata
        )

    async def _decode_large(self, decode: Callable[[bytes, Any], Any], data: bytes, message_type: Any) -> Any:
        """(asyncio side) Decode a large message in a worker thread (``message_limits``)."""
        run = partial(run_sized, inline_max=0, limiter=self._decode_limiter)
        return await trio_asyncio.trio_as_aio(run)(lambda raw: decode(raw, message_type), data)

    def _bound(self, route: str) -> int:
        """The size limit of one message of ``route``."""
        if route == _INFERENCE + "Generate":
            return self.limits.max_event_bytes
        if route == _CONTROL + "SubscribeKvEvents":
            return self.limits.max_kv_batch_bytes
        return self.limits.max_answer_bytes

    # -- server streams -------------------------------------------------------------------

    @asynccontextmanager
    async def _server_stream(
        self,
        route: str,
        request: betterproto2.Message,
        reply_type: type[T],
        rules: _Rules[T],
        metadata: MetadataLike | None,
        pick: Callable[[], Picked | Awaitable[Picked]],
        request_id: str = "",
        max_message_bytes: int | None = None,
    ) -> AsyncIterator[EngineStream[T]]:
        send, receive = trio.open_memory_channel[Any](self._stream_buffer)
        stream: EngineStream[T] = EngineStream(receive, rules, request_id)
        timeout = _timeout()
        md = _metadata(metadata)
        what = route.rsplit("/", 1)[-1]
        bound = self._bound(route) if max_message_bytes is None else max_message_bytes
        decode_large, inline_max = self._decode_large, self.limits.decode_inline_bytes

        async def pump() -> None:
            # asyncio side: the whole call lives here (docs/design/stack-notes.md). Messages go to trio with
            # send_nowait (no loop hop); only a full channel awaits trio (back-pressure).
            release: Callable[[], None] | None = None
            try:
                picked = pick()
                channel, release = picked if isinstance(picked, tuple) else await picked
                async with channel.request(
                    route, Cardinality.UNARY_STREAM, type(request), reply_type, timeout=timeout, metadata=md
                ) as st:
                    await st.send_message(request, end=True)
                    # T, or a HandedOver PrefillReady (see Codec)
                    while (msg := await recv_bounded(st, bound, decode_large, inline_max)) is not None:
                        try:
                            send.send_nowait(msg)
                        except trio.WouldBlock:
                            await trio_asyncio.trio_as_aio(send.send)(msg)
            except trio.BrokenResourceError:
                pass  # the consumer left; our cancellation follows
            except Exception as exc:
                stream._failure = _translate(exc, what)
            finally:
                if release is not None:
                    release()
                send.close()

        async with open_background_nursery() as nursery:
            nursery.start_soon(trio_asyncio.aio_as_trio(pump))
            try:
                yield stream
            finally:
                nursery.cancel_scope.cancel()
                receive.close()

    async def _pick_generate(self) -> Picked:
        return await self._generate.acquire()

    def _trio_generate(
        self, request: pb.GenerateRequest, rules: _Rules[pb.GenerateResponse], metadata: MetadataLike | None
    ) -> _TrioGenerate:
        """A Generate stream on the trio-native transport (:mod:`sidecar.openengine.trio_generate`)."""
        return _TrioGenerate(
            rules,
            request.request_id,
            self._trio_pool,
            self._generate_head.headers(_timeout(), _metadata(metadata)),
            encode_generate_request(request) or bytes(request),
            self._generate_decode,
            self._generate_decode_large,
            self.limits.decode_inline_bytes,
        )

    def generate(
        self, request: pb.GenerateRequest, *, metadata: MetadataLike | None = None, checked: bool = True
    ) -> AbstractAsyncContextManager[EngineStream[pb.GenerateResponse]]:
        """Open a Generate stream: ``async with client.generate(request) as stream: async for
        event in stream`` (see :class:`EngineStream`). Leaving the block resets the stream.

        ``checked=False`` (here and on the other streams; ``sidecar.openengine.raw``): no
        stream rules — every message as the engine sent it, an ``EngineError`` event yielded
        like any other; status and transport errors still raise."""
        rules: _Rules[pb.GenerateResponse] = GenerateRules.for_request(request) if checked else _NoRules()
        if self.transport == "trio":
            return self._trio_generate(request, rules, metadata)
        return self._server_stream(
            _INFERENCE + "Generate",
            request,
            pb.GenerateResponse,
            rules,
            metadata,
            self._pick_generate,
            request.request_id,
        )

    def drain(
        self, request: pb.DrainRequest, *, metadata: MetadataLike | None = None, checked: bool = True
    ) -> AbstractAsyncContextManager[EngineStream[pb.DrainResponse]]:
        """Open a Drain stream (an :class:`EngineStream` of ``pb.DrainResponse``)."""
        return self._server_stream(
            _CONTROL + "Drain",
            request,
            pb.DrainResponse,
            DrainRules() if checked else _NoRules(),
            metadata,
            lambda: (self._control_channel(), lambda: None),
        )

    def subscribe_kv_events(
        self,
        request: pb.SubscribeKvEventsRequest,
        *,
        metadata: MetadataLike | None = None,
        max_message_bytes: int | None = None,
        checked: bool = True,
    ) -> AbstractAsyncContextManager[EngineStream[pb.SubscribeKvEventsResponse]]:
        """Open a KV-event subscription (an :class:`EngineStream` of
        ``pb.SubscribeKvEventsResponse``) on its own channel.

        A message larger than ``max_message_bytes`` (default: the client's
        ``limits.max_kv_batch_bytes``) fails the stream with
        :class:`~sidecar.openengine.errors.EngineMessageTooLarge` before it is read.
        """
        return self._server_stream(
            _CONTROL + "SubscribeKvEvents",
            request,
            pb.SubscribeKvEventsResponse,
            KvEventRules() if checked else _NoRules(),
            metadata,
            lambda: (self._kv_channel(), lambda: None),
            max_message_bytes=max_message_bytes,
        )


@asynccontextmanager
async def open_engine_client(
    address: str | EngineAddress,
    *,
    generate_channels: int = 4,
    stream_buffer: int = 64,
    max_streams_per_channel: int = 128,
    max_generate_channels: int = 256,
    idle_channel_close: float = 5.0,
    keepalive: Keepalive | None = None,
    limits: EngineLimits | None = None,
    transport: str | None = None,
) -> AsyncIterator[EngineClient]:
    """An :class:`EngineClient` for ``address`` (``host:port``, ``http://host:port``, ``unix:///path``).

    No connection is made until the first call. Raises :class:`EngineConfigError` for an
    address it cannot parse. Closes every connection on exit. ``generate_channels`` is the
    Generate pool's minimum size; ``max_streams_per_channel`` caps the streams per connection
    (below the engine's own advertised cap); ``max_generate_channels`` bounds the pool;
    extra channels are closed ``idle_channel_close`` seconds after their last stream ended;
    ``keepalive`` checks every connection's liveness with HTTP/2 PINGs (channel_pool module doc).
    ``limits`` bounds every message received (:class:`EngineLimits`). ``transport``: how
    Generate streams travel (:data:`TRANSPORTS`; default :data:`DEFAULT_TRANSPORT`); control
    calls, Drain and KV-event streams always use grpclib.
    """
    addr = address if isinstance(address, EngineAddress) else parse_engine_address(address)
    client = EngineClient(
        addr,
        generate_channels=generate_channels,
        stream_buffer=stream_buffer,
        max_streams_per_channel=max_streams_per_channel,
        max_generate_channels=max_generate_channels,
        idle_channel_close=idle_channel_close,
        keepalive=keepalive,
        limits=limits,
        transport=transport,
    )
    try:
        async with open_background_nursery() as nursery:
            client._start(nursery)
            try:
                yield client
            finally:
                await client.aclose()
                nursery.cancel_scope.cancel()
    finally:
        await client.aclose()

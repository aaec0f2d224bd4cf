"""A small serving kit for OpenEngine servers (the simulated engines, conformance fakes).

Runs a grpclib :class:`~grpclib.server.Server` for given ``pb.ControlBase`` /
``pb.InferenceBase`` implementations, so code outside ``sidecar/openengine/`` never
imports grpclib:

- :func:`serve` / :func:`open_server` bind ``host:port`` (port 0 = ephemeral) or
  ``unix:///path`` and report the bound address;
- :func:`request_metadata` gives a handler the current request's gRPC metadata,
  :func:`request_peer` its peer (a contextvar set by wrapping each handler) and
  :func:`request_kv_session_bytes` its request's ``KvSessionRef`` as received;
- :class:`RpcStatusError` raised by a handler ends the call with that non-OK status
  (before the first message it is a trailers-only response: no events);
- :class:`PreEncoded` lets a handler yield already serialized message bytes (the fast
  benchmark path skips the codec).

Server-streaming methods may be written two ways:

- an async generator ``async def drain(self, request)`` yielding messages (the generated
  base's form); the kit always closes it (``aclose``) when the call ends, so its
  ``finally`` runs at once when the client goes away;
- a coroutine ``async def generate(self, request, send)`` that awaits
  ``send(message)`` itself. A client that resets the stream (or a deadline, or server
  shutdown) surfaces as ``asyncio.CancelledError`` inside ``send`` or whatever the
  handler awaits, so the handler sees exactly where its client left.

Everything here is asyncio (the engines are asyncio programs, like real ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import inspect
import logging
import os
import re
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from sidecar.addresses import ListenAddress, parse_listen
from sidecar.openengine import pb
from sidecar.openengine.schema.encode import encode_generate_response
from sidecar.openengine.schema.protobuf_wire import WireError, nested_field_bytes
from sidecar.openengine.serving._grpclib_internals import server_port

log = logging.getLogger(__name__)

#: gRPC status names a handler may use (grpclib ``Status`` member names).
STATUS_NAMES = frozenset(s.name for s in grpclib.const.Status)


class RpcStatusError(Exception):
    """Raised by a handler to end its call with a non-OK gRPC status.

    ``status`` is a gRPC status name (``"INVALID_ARGUMENT"``, ``"NOT_FOUND"``, ...).
    Raised before the first response message, the client sees only the status
    (the OpenEngine "before acceptance" transport).
    """

    def __init__(self, status: str, message: str = "") -> None:
        if status not in STATUS_NAMES or status == "OK":
            raise ValueError(f"not a non-OK gRPC status name: {status!r}")
        super().__init__(f"{status}: {message}" if message else status)
        self.status = status
        self.message = message


class PreEncoded:
    """A message already serialized by the handler; sent as is (no codec work).

    The bytes must be a valid encoding of the RPC's response type.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __bytes__(self) -> bytes:
        return self.data


class _Codec(ProtoCodec):
    """The proto codec, plus :class:`PreEncoded` pass-through and the hand-written encoder of the
    common ``GenerateResponse`` events (:func:`encode_generate_response`, else betterproto2)."""

    def encode(self, message: Any, message_type: Any) -> bytes:
        if type(message) is PreEncoded:
            return message.data
        if type(message) is pb.GenerateResponse:
            data = encode_generate_response(message)
            if data is not None:
                return data
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        message = message_type.parse(data)
        if message_type is pb.GenerateRequest and message.kv is not None and message.kv.session is not None:
            # The exact KvSessionRef bytes a client sent (kv = 8, session = 1), so an engine
            # (the simulated ones, conformance fakes) can report what it received byte for byte.
            with contextlib.suppress(WireError):
                _kv_session_bytes.set(nested_field_bytes(data, 8, 1))
        return message


@dataclass(frozen=True)
class RequestContext:
    """What a handler can see about its call beyond the request message."""

    method: str
    metadata: tuple[tuple[str, str | bytes], ...]
    peer_host: str | None


_current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "openengine_request_context", default=None
)


def request_context() -> RequestContext | None:
    """The current call's context, or None outside a handler."""
    return _current.get()


#: Set by the codec while it decodes a Generate request (in the handler's task).
_kv_session_bytes: contextvars.ContextVar[bytes | None] = contextvars.ContextVar(
    "openengine_request_kv_session", default=None
)


def request_kv_session_bytes() -> bytes | None:
    """The current Generate call's ``kv.session`` exactly as the client sent it (a
    ``KvSessionRef``'s bytes; None without one or outside a handler). For engines that report
    what they received byte for byte (the simulated ones, conformance fakes)."""
    return _kv_session_bytes.get()


def request_metadata() -> tuple[tuple[str, str | bytes], ...]:
    """The current call's gRPC metadata as (key, value) pairs in arrival order.

    Repeated keys appear repeatedly (OpenEngine forbids repeating its own keys, so
    handlers need to see them). Keys are lowercase; ``-bin`` values are bytes.
    """
    ctx = _current.get()
    return ctx.metadata if ctx is not None else ()


def request_peer() -> str | None:
    """The current call's peer host (None for unix sockets / outside a handler)."""
    ctx = _current.get()
    return ctx.peer_host if ctx is not None else None


def _wrap(method: str, func: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    async def handler(stream: grpclib.server.Stream) -> None:  # type: ignore[type-arg]
        metadata = tuple((str(k), v) for k, v in stream.metadata.items()) if stream.metadata else ()
        peer_host = None
        with contextlib.suppress(Exception):
            addr = stream.peer.addr()
            if isinstance(addr, tuple):
                peer_host = str(addr[0])
        token = _current.set(RequestContext(method, metadata, peer_host))
        try:
            await func(stream)
        except RpcStatusError as err:
            raise GRPCError(grpclib.const.Status[err.status], err.message or None) from None
        finally:
            _current.reset(token)

    return handler


def _snake(rpc: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", rpc).lower()


def _server_stream(service: Any, rpc: str) -> Callable[[Any], Awaitable[None]]:
    method = getattr(service, _snake(rpc))

    async def handler(stream: grpclib.server.Stream) -> None:  # type: ignore[type-arg]
        request = await stream.recv_message()
        if inspect.iscoroutinefunction(method):
            await method(request, stream.send_message)
            return
        agen = method(request)
        try:
            async for message in agen:
                await stream.send_message(message)
        finally:
            await agen.aclose()

    return handler


class _Wrapped:
    """Adapts a generated service base so each handler sets the request context."""

    def __init__(self, service: Any) -> None:
        self._service = service

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        mapping: dict[str, grpclib.const.Handler] = self._service.__mapping__()
        out = {}
        for name, h in mapping.items():
            func = h.func
            if h.cardinality == grpclib.const.Cardinality.UNARY_STREAM:
                func = _server_stream(self._service, name.rsplit("/", 1)[-1])
            out[name] = grpclib.const.Handler(_wrap(name, func), h.cardinality, h.request_type, h.reply_type)
        return out


class RunningServer:
    """A started server: ``address`` is the bound one (the real port when 0 was asked)."""

    def __init__(self, server: grpclib.server.Server, address: ListenAddress) -> None:
        self._server = server
        self.address = address

    def close(self) -> None:
        """Stop accepting and cancel in-flight handlers (they see CancelledError)."""
        with contextlib.suppress(RuntimeError):
            self._server.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()


def claim_unix_path(path: str) -> None:
    """Make ``path`` free for a Unix socket listener: a stale socket (nothing accepts on it)
    is removed; a socket another live process serves, or a file that is no socket, raises
    ``OSError`` (``EADDRINUSE`` / ``EEXIST``) and is left alone."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: its server is gone
        return
    except OSError:
        pass  # e.g. a full backlog or a timeout: somebody is there
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another live process serves {path}")


@contextlib.asynccontextmanager
async def open_server(services: Iterable[Any], listen: str | ListenAddress) -> AsyncIterator[RunningServer]:
    """Serve ``services`` (generated ``*Base`` instances) on ``listen`` for the block's duration.

    On exit the server stops accepting, cancels running handlers and waits for them
    (a unix socket file is removed). Raises OSError when the address cannot be bound.
    """
    address = parse_listen(listen) if isinstance(listen, str) else listen
    server = grpclib.server.Server([_Wrapped(s) for s in services], codec=_Codec())
    inode = None
    if address.path is not None:
        claim_unix_path(address.path)
        await server.start(path=address.path)
        inode = os.stat(address.path).st_ino
        bound = address
    else:
        await server.start(address.host, address.port)
        port = server_port(server)
        bound = ListenAddress(host=address.host, port=port if port is not None else address.port or 0)
    running = RunningServer(server, bound)
    try:
        yield running
    finally:
        running.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await asyncio.shield(running.wait_closed())
        if address.path is not None:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(address.path).st_ino == inode:  # still ours
                    os.unlink(address.path)


async def serve(
    services: Iterable[Any],
    listen: str | ListenAddress,
    *,
    stop: asyncio.Event,
    on_started: Callable[[ListenAddress], None] | None = None,
) -> None:
    """Serve until ``stop`` is set, then shut down as :func:`open_server` does.

    ``on_started`` is called with the bound address once the socket listens.
    """
    async with open_server(services, listen) as running:
        if on_started is not None:
            on_started(running.address)
        await stop.wait()

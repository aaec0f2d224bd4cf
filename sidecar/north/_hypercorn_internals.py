"""Every use of hypercorn beyond its documented ``serve``, in one module.

Hypercorn offers no switch for HTTP/2 cleartext, no per-connection error boundary and no
connection limit, so the sidecar's HTTP listener (``sidecar.north.http_server``) runs hypercorn's
trio worker (``worker_serve``, with pre-bound ``Sockets`` so that a restarted listener keeps its
socket) with its own per-connection server and protocol wrapper installed in hypercorn's trio
modules (:func:`install`, idempotent; only the sidecar's listener runs hypercorn in this
process):

- :class:`CountedServer` (hypercorn's ``TCPServer``): each connection counted in the listener's
  :class:`~sidecar.north.http_connections.HttpConnections` from the accept, busy while a request
  runs (hypercorn's ``Updated`` events);
- :class:`GuardedProtocol` (hypercorn's ``ProtocolWrapper``): HTTP/1.1 only
  (:class:`Http11Only` overrides ``H11Protocol._check_protocol``, hypercorn's two ways into
  HTTP/2), and an exception of one connection's protocol code closes that connection only.

``tests/north/test_hypercorn_internals.py`` fails loudly when a hypercorn release moves or
renames what this relies on (:data:`MODULE_NAMES`, :func:`missing_internals`);
``tests/north/test_http_server.py`` pins the behaviour. The dependency is pinned to 0.18.
"""

from __future__ import annotations

import inspect
import logging
import socket
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import cast

import h11
import h11._writers
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import trio
from hypercorn.config import Config, Sockets
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.run import worker_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import (
    AppWrapper,
    ASGIFramework,
    ConnectionState,
    H11SendableEvent,
    TaskGroup,
    WorkerContext,
)
from hypercorn.utils import wrap_app
from starlette.types import ASGIApp

from sidecar.core.metrics import HTTP_FAILURES
from sidecar.north.http_connections import HttpConnections
from sidecar.north.peers import peer_of
from sidecar.nursery import first_leaf
from sidecar.quoting import clip
from sidecar.socket_io import write_now

log = logging.getLogger(__name__)

__all__ = [
    "CountedServer",
    "GuardedProtocol",
    "Http11Only",
    "HypercornConfig",
    "asgi_app",
    "describe_failure",
    "duplicate_sockets",
    "install",
    "missing_internals",
    "run_worker",
]

#: Module globals of hypercorn's trio worker that :func:`install` replaces (module, name).
MODULE_NAMES = (("hypercorn.trio.tcp_server", "ProtocolWrapper"), ("hypercorn.trio.run", "TCPServer"))
#: Methods of hypercorn classes overridden here (class, name); ``_check_protocol`` is private.
OVERRIDDEN = (
    (TCPServer, "run"),
    (TCPServer, "protocol_send"),
    (H11Protocol, "_check_protocol"),
    (H11Protocol, "_send_h11_event"),
    (H11Protocol, "stream_send"),
)
#: Attributes of a ``ProtocolWrapper`` that :class:`GuardedProtocol` passes to its protocol
#: (set from the constructor parameters of the same names).
WRAPPER_STATE = ("app", "config", "context", "task_group", "state", "ssl", "client", "server", "send")
#: ``H11Protocol``'s parameters, in the order :class:`GuardedProtocol` passes them.
H11_PARAMETERS = (
    "app",
    "config",
    "context",
    "task_group",
    "connection_state",
    "ssl",
    "client",
    "server",
    "send",
)


def missing_internals() -> list[str]:
    """What this module relies on that the installed hypercorn lacks (empty with the pin)."""
    missing = [f"{mod}.{name}" for mod, name in MODULE_NAMES if not hasattr(_module(mod), name)]
    missing += [f"{cls.__name__}.{name}" for cls, name in OVERRIDDEN if not hasattr(cls, name)]
    wrapper_params = inspect.signature(ProtocolWrapper.__init__).parameters
    missing += [f"ProtocolWrapper({name}=)" for name in WRAPPER_STATE if name not in wrapper_params]
    if tuple(inspect.signature(H11Protocol.__init__).parameters)[1:] != H11_PARAMETERS:
        missing.append(f"H11Protocol{H11_PARAMETERS} (positional)")
    if not hasattr(h11._writers, "ChunkedWriter") or "_writer" not in vars(h11.Connection(h11.SERVER)):
        missing.append("h11.Connection._writer (a ChunkedWriter while a chunked body is sent)")
    if "sockets" not in inspect.signature(worker_serve).parameters:
        missing.append("worker_serve(sockets=)")
    return missing


def _module(name: str) -> ModuleType:
    return {"hypercorn.trio.tcp_server": hypercorn.trio.tcp_server, "hypercorn.trio.run": hypercorn.trio.run}[
        name
    ]


def describe_failure(exc: BaseException) -> str:
    """``Type: message`` of the first leaf of a (possibly nested) exception group."""
    exc = first_leaf(exc)
    return f"{type(exc).__name__}: {clip(str(exc), 200)}"


class HypercornConfig(Config):
    """hypercorn's config, plus the listener's connection table and write timeout (read by
    :class:`CountedServer`)."""

    connections: HttpConnections | None = None
    #: A write the client has taken nothing of for this long closes the connection (None: never).
    write_timeout: float | None = None


class CountedServer(TCPServer):
    """One accepted connection, counted in the listener's :class:`HttpConnections` from the
    accept (before a TLS handshake) to the close; its requests mark it busy, their ends idle.
    With the config's ``write_timeout``, a write still waiting for the client after it closes
    the connection (the app sees ``http.disconnect``): hypercorn's own writes wait forever.
    Then a write with none under way goes to the kernel at once (:func:`sidecar.socket_io.write_now`); what the
    kernel does not take goes through the stream, in order, under the send lock."""

    async def run(self) -> None:
        table: HttpConnections | None = getattr(self.config, "connections", None)
        if table is None:
            await super().run()
            return
        self.peer = peer_of(self.stream)
        if not await table.admit(self):
            await trio.aclose_forcefully(self.stream)
            return
        try:
            await super().run()
        except trio.ClosedResourceError:
            pass  # closed to make room (HttpConnections.admit); hypercorn expects none mid-handshake
        finally:
            table.release(self)

    async def protocol_send(self, event: Event) -> None:
        table: HttpConnections | None = getattr(self.config, "connections", None)
        if table is not None and isinstance(event, Updated):
            table.busy(self, not event.idle)
        timeout: float | None = getattr(self.config, "write_timeout", None)
        if timeout is None or not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        data: bytes | memoryview = event.data
        if not self.send_lock.locked():  # no write under way: try to write it all at once
            sent = write_now(self.stream, event.data)
            if sent == len(event.data):
                return
            data = memoryview(event.data)[sent:]
            self.send_lock.acquire_nowait()  # nothing ran since the check: it is free
        else:
            await self.send_lock.acquire()
        try:
            # as hypercorn's: never cut by the caller's cancellation (a partial write would
            # garble the connection), but bounded by its own deadline
            with trio.CancelScope(shield=True, deadline=trio.current_time() + timeout) as scope:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.protocol.handle(Closed())
                    return
        finally:
            self.send_lock.release()
        if scope.cancelled_caught:
            peer = getattr(self, "peer", None)
            log.warning(
                "client %s took nothing for %.0fs: connection closed", peer.address if peer else "?", timeout
            )
            await trio.aclose_forcefully(self.stream)
            await self.protocol.handle(Closed())


class Http11Only(H11Protocol):
    """HTTP/1.1 without its two ways into HTTP/2; a response's head leaves with its first body
    bytes (one write, not two: hypercorn writes the head as soon as the app starts the response);
    a chunk of a chunked body is framed here (h11's own framing, without its per-event state
    machine: a body chunk changes no state, and h11 keeps every other event)."""

    _held = b""

    def _chunked_body(self) -> bool:
        """Whether the response is in its body, sent with chunked transfer coding."""
        c = self.connection
        return (
            c.our_state is h11.SEND_BODY and type(getattr(c, "_writer", None)) is h11._writers.ChunkedWriter
        )

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if isinstance(event, h11.Response):
            self._held += data
            return
        held, self._held = self._held, b""
        await self.send(RawData(data=held + data))

    async def stream_send(self, event: StreamEvent) -> None:
        if type(event) is Body and self._chunked_body():
            if event.data:  # (an empty chunk would end the body: h11 sends none either)
                held, self._held = self._held, b""
                await self.send(RawData(data=b"%b%x\r\n%b\r\n" % (held, len(event.data), event.data)))
            return
        if isinstance(event, StreamClosed) and self._held:  # a head with no body after it
            held, self._held = self._held, b""
            await self.send(RawData(data=held))
        await super().stream_send(event)

    async def _check_protocol(self, event: h11.Request) -> None:
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            raise H2ProtocolAssumedError(b"")  # refused by GuardedProtocol
        # ``Upgrade: h2c`` is not acted on: the request is served over HTTP/1.1


class GuardedProtocol(ProtocolWrapper):
    """One connection's protocol: HTTP/1.1 only; an exception closes this connection only."""

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        task_group: TaskGroup,
        state: ConnectionState,
        ssl: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        send: Callable[[Event], Awaitable[None]],
        alpn_protocol: str | None = None,
    ) -> None:
        super().__init__(app, config, context, task_group, state, ssl, client, server, send, alpn_protocol)
        self.protocol = Http11Only(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
        )

    async def handle(self, event: Event) -> None:
        try:
            await self.protocol.handle(event)
        except H2ProtocolAssumedError:
            log.debug("HTTP/2 prior-knowledge connection from %s refused", self.client)
            await self.send(Closed())
        except Exception as exc:
            HTTP_FAILURES.labels("connection").inc()
            log.warning(
                "HTTP connection from %s failed (%s); closed",
                self.client,
                describe_failure(exc),
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            if not isinstance(event, Closed):
                await self.send(Closed())


def install() -> None:
    """Make hypercorn's trio worker use :class:`CountedServer` and :class:`GuardedProtocol`."""
    hypercorn.trio.tcp_server.ProtocolWrapper = GuardedProtocol  # type: ignore[misc]
    hypercorn.trio.run.TCPServer = CountedServer  # type: ignore[misc]


def asgi_app(app: ASGIApp, config: Config) -> AppWrapper:
    """``app`` wrapped as hypercorn's worker expects it. (The cast: Starlette and hypercorn type
    the same ASGI messages differently, as mutable mappings and as TypedDicts.)"""
    return wrap_app(cast(ASGIFramework, app), config.wsgi_max_body_size, "asgi")


def duplicate_sockets(sockets: Sockets) -> Sockets:
    """Duplicates of ``sockets`` for one run of the worker (hypercorn closes what it served on)."""
    return Sockets([s.dup() for s in sockets.secure_sockets], [s.dup() for s in sockets.insecure_sockets], [])


def listening_sockets(sockets: Sockets) -> list[socket.socket]:
    """Every socket of ``sockets`` (TLS ones first)."""
    return [*sockets.secure_sockets, *sockets.insecure_sockets]


async def run_worker(
    asgi: AppWrapper,
    config: Config,
    sockets: Sockets,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker on pre-bound ``sockets`` (``started`` with its bound addresses);
    returns once it shut down."""
    await worker_serve(asgi, config, sockets=sockets, task_status=task_status)

"""trio-websocket, adapted for the sidecar's listener: one place for everything that relies on
its internals.

trio-websocket 0.12 (pinned ``>=0.12.2,<0.13``) answers faults that wsproto finds in what a
client sent — invalid UTF-8 in a text frame (1007), framing errors such as a reserved opcode,
RSV bits, an unmasked or fragmented control frame (1002) — by dropping the TCP connection
without a close frame: wsproto reports them as a ``CloseConnection`` event while its state is
still OPEN, and ``_handle_close_connection_event`` only answers close frames the peer sent.
A message over ``max_message_size`` does get its 1009 close frame, but the TCP connection is
left to the peer. :class:`SidecarWebSocket` fails such connections the RFC 6455 way instead
(:meth:`SidecarWebSocket.fail`): close frame with the code, then a lingering TCP close (our
side half-closed, what the client still sends read and discarded for at most
:data:`LINGER` seconds) so that unread client bytes do not turn the close into a reset that
could destroy the close frame before the client reads it.

:func:`serve` replaces ``serve_websocket`` (same listeners, TLS, handshake timeout) so that
every connection is a :class:`SidecarWebSocket`, and guarantees that nothing a connection does
escapes into the listener's nursery: an unexpected error is logged and ends that connection
only (the listener keeps serving others).

Internals used (checked by :func:`missing_internals`, asserted by tests/north/test_ws_adapter.py
so that a trio-websocket release that renames them fails the tests, not production):
the reader loop ``_reader_task`` and its event handlers ``_handle_close_connection_event``,
``_handle_message_event`` and ``_handle_ping_event``; ``_get_request``; ``_send``, ``_close_web_socket``,
``_close_stream``; state ``_wsproto``, ``_stream``, ``_stream_lock``, ``_close_reason``,
``_close_handshake``, ``_message_size``, ``_max_message_size``, ``_message_parts``
(``sidecar.north.ws_batch`` uses ``_abort_web_socket`` as well).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, WebSocketRequest
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

from sidecar.north.peers import Peer, PeerLimits, peer_of
from sidecar.quoting import quote

log = logging.getLogger(__name__)

#: Seconds the close frame of a failed connection may wait for the socket (behind a write in
#: progress) before the TCP connection is dropped without it.
FAIL_SEND_TIMEOUT = 2.0
#: Seconds a failed connection stays half-open for the client to read its close frame.
LINGER = 2.0
#: Seconds the reader may still take after the handler returned (close handshake, linger).
READER_GRACE = 5.0
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009

_METHODS = (
    "_reader_task",
    "_handle_close_connection_event",
    "_handle_message_event",
    "_handle_ping_event",
    "_get_request",
    "_send",
    "_close_web_socket",
    "_close_stream",
    "_abort_web_socket",
)
_STATE = (
    "_wsproto",
    "_stream",
    "_stream_lock",
    "_close_reason",
    "_close_handshake",
    "_message_size",
    "_max_message_size",
    "_message_parts",
)


def missing_internals(ws: WebSocketConnection) -> list[str]:
    """The trio-websocket internals this module and ``ws_batch`` use that ``ws`` lacks."""
    return [name for name in (*_METHODS, *_STATE) if not hasattr(ws, name)]


class SidecarWebSocket(WebSocketConnection):
    """A server-side connection that answers client faults with a close frame (module doc)."""

    async def fail(self, code: int, reason: str) -> None:
        """Fail the connection: close frame ``code`` (within :data:`FAIL_SEND_TIMEOUT`), then
        ``get_message`` raises ConnectionClosed and the TCP connection lingers and closes.
        Raises nothing but Cancelled (the stream is closed then too)."""
        if self._close_reason is not None or self._wsproto.state is not ConnectionState.OPEN:
            await self._close_stream()
            return
        # Set first: from here on senders (send_message, ws_batch) raise ConnectionClosed
        # instead of writing data after the close frame.
        self._close_reason = CloseReason(code, reason or None)
        sent = False
        with trio.move_on_after(FAIL_SEND_TIMEOUT):
            try:
                await self._send(CloseConnection(code=code, reason=reason))
                sent = True
            except ConnectionClosed:
                pass  # the peer is gone already
        await self._close_web_socket(code, reason or None)
        self._close_handshake.set()
        try:
            if sent:
                await self._linger()
        finally:
            await self._close_stream()

    async def _linger(self) -> None:
        with trio.move_on_after(LINGER):
            try:
                if isinstance(self._stream, trio.abc.HalfCloseableStream):
                    async with self._stream_lock:
                        await self._stream.send_eof()
                while await self._stream.receive_some(65536):
                    pass  # whatever the client still sends (its close reply): discarded
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass

    async def _handle_close_connection_event(self, event: CloseConnection) -> None:
        # A close frame from the peer moves wsproto to REMOTE_CLOSING (or CLOSED) before the
        # event; OPEN means wsproto failed to parse what the peer sent (1002 / 1007).
        if self._wsproto.state is ConnectionState.OPEN:
            log.debug(
                "%s websocket fault from the client: %s %s", self, event.code, quote(event.reason or "")
            )
            await self.fail(int(event.code), event.reason or "")
            return
        await super()._handle_close_connection_event(event)

    async def _handle_ping_event(self, event: Ping) -> None:
        # Frames read together with the fault still come out of wsproto: no pong after our
        # close frame (wsproto would refuse to encode it).
        if self._wsproto.state is ConnectionState.OPEN:
            await super()._handle_ping_event(event)

    async def _handle_message_event(self, event: BytesMessage | TextMessage) -> None:
        if self._message_size + len(event.data) > self._max_message_size:
            self._message_size = 0
            self._message_parts = []
            await self.fail(CLOSE_TOO_BIG, f"message larger than {self._max_message_size}")
            return
        await super()._handle_message_event(event)


async def _reader(ws: SidecarWebSocket) -> None:
    try:
        await ws._reader_task()
    except Exception:
        log.exception("%s websocket reader failed", ws)
        if ws._close_reason is None:
            ws._close_reason = CloseReason(1011, "internal error")
        ws._close_handshake.set()
        await trio.aclose_forcefully(ws._stream)


async def serve(
    handler: Callable[[WebSocketRequest, Peer], Awaitable[None]],
    host: str | None,
    port: int,
    ssl_context: Any = None,
    *,
    max_message_size: int,
    message_queue_size: int,
    handshake_timeout: float,
    disconnect_timeout: float = 5.0,
    limits: PeerLimits | None = None,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve WebSocket connections of :class:`SidecarWebSocket` until cancelled; ``started``
    with the listening port. ``handler`` runs once per accepted handshake, with the peer read
    at accept; whatever it (or the connection) raises is logged and ends that connection only.
    ``limits``: connections over them are refused at accept (``sidecar.north.peers``).
    Connections run in ``handler_nursery`` when given (they then outlive the listener:
    ``trio.serve_listeners``)."""
    listeners: list[Any]
    if ssl_context is None:
        listeners = list(await trio.open_tcp_listeners(port, host=host))
    else:
        listeners = list(
            await trio.open_ssl_over_tcp_listeners(port, ssl_context, host=host, https_compatible=True)
        )

    async def connection(stream: trio.abc.Stream) -> None:
        peer = peer_of(stream)
        refused = limits.connect(peer.key) if limits is not None else None
        try:
            if refused is not None:
                assert limits is not None
                await limits.refuse(stream, peer, refused)
                return

            async def handle(request: WebSocketRequest) -> None:
                await handler(request, peer)

            try:
                await _serve_connection(
                    stream,
                    handle,
                    max_message_size=max_message_size,
                    message_queue_size=message_queue_size,
                    handshake_timeout=handshake_timeout,
                    disconnect_timeout=disconnect_timeout,
                )
            except Exception:
                log.exception("websocket connection from %s failed", peer.address)
            finally:
                if limits is not None:
                    limits.disconnect(peer.key)
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(trio.serve_listeners, handler_nursery=handler_nursery), connection, listeners
        )
        task_status.started(_port(listeners[0]))


def _port(listener: Any) -> int:
    if isinstance(listener, trio.SSLListener):
        listener = listener.transport_listener
    assert isinstance(listener, trio.SocketListener)
    return int(listener.socket.getsockname()[1])


async def _serve_connection(
    stream: trio.abc.Stream,
    handler: Callable[[WebSocketRequest], Awaitable[None]],
    *,
    max_message_size: int,
    message_queue_size: int,
    handshake_timeout: float,
    disconnect_timeout: float,
) -> None:
    ws = SidecarWebSocket(
        stream,
        WSConnection(ConnectionType.SERVER),
        message_queue_size=message_queue_size,
        max_message_size=max_message_size,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_reader, ws)
        request = None
        with trio.move_on_after(handshake_timeout):
            request = await ws._get_request()
        if request is None:  # no handshake in time: the stream is closed by the caller
            nursery.cancel_scope.cancel()
            return
        failed = False
        try:
            await handler(request)
        except Exception:
            failed = True  # logged by the caller; the client gets 1011
            raise
        finally:
            with trio.move_on_after(disconnect_timeout):
                await ws.aclose(*((1011, "internal error") if failed else (1000, None)))
        # The reader ends by itself once the connection is closed; bounded in any case.
        nursery.cancel_scope.deadline = trio.current_time() + READER_GRACE

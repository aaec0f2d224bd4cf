"""Every use of trio-websocket's private names, in one module: the sidecar's server
connection class and the accessors the batched writer needs. Nothing else in the sidecar names a
trio-websocket internal; ``tests/north/test_trio_websocket_internals.py`` fails loudly when a
release renames or drops one (:data:`PRIVATE_NAMES`, :func:`missing_internals`), and the
dependency is pinned to the 0.12 series. Why we stay on trio-websocket instead of writing the
layer on wsproto directly: docs/design/stack-notes.md ("WebSocket layer"), with the figures.

trio-websocket 0.12 answers faults that wsproto finds in what a client sent — invalid UTF-8 in a
text frame (1007), framing errors such as a reserved opcode, RSV bits, an unmasked or fragmented
control frame (1002) — by dropping the TCP connection without a close frame: wsproto reports them
as a ``CloseConnection`` event while its state is still OPEN, and
``_handle_close_connection_event`` only answers close frames the peer sent. A message over
``max_message_size`` does get its 1009 close frame, but the TCP connection is left to the peer.
:class:`SidecarWebSocket` fails such connections the RFC 6455 way instead
(:meth:`SidecarWebSocket.fail`): close frame with the code, then a lingering TCP close (our side
half-closed, what the client still sends read and discarded for at most :data:`LINGER` seconds)
so that unread client bytes do not turn the close into a reset that could destroy the close
frame before the client reads it.

The batched writer (``sidecar.north.ws_batch``) encodes frames with the connection's wsproto
object and writes them under the connection's own stream lock, exactly as trio-websocket's
``_send`` does: :func:`encode`, :func:`transport`, :func:`write_lock`, :func:`close_reason`,
:func:`abort`.
"""

from __future__ import annotations

import logging

import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, WebSocketRequest
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, TextMessage

from sidecar.quoting import quote

log = logging.getLogger(__name__)

__all__ = [
    "LINGER",
    "PRIVATE_METHODS",
    "PRIVATE_NAMES",
    "PRIVATE_STATE",
    "SidecarWebSocket",
    "abort",
    "close_reason",
    "encode",
    "missing_internals",
    "read_handshake",
    "run_reader",
    "transport",
    "write_lock",
]

#: Seconds the close frame of a failed connection may wait for the socket (behind a write in
#: progress) before the TCP connection is dropped without it.
FAIL_SEND_TIMEOUT = 2.0
#: Seconds a failed connection stays half-open for the client to read its close frame.
LINGER = 2.0
CLOSE_TOO_BIG = 1009

#: Private methods of ``WebSocketConnection`` called or overridden here.
PRIVATE_METHODS = (
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
#: Private state of a ``WebSocketConnection`` read or written here.
PRIVATE_STATE = (
    "_wsproto",
    "_stream",
    "_stream_lock",
    "_close_reason",
    "_close_handshake",
    "_message_size",
    "_max_message_size",
    "_message_parts",
)
PRIVATE_NAMES = PRIVATE_METHODS + PRIVATE_STATE


def missing_internals(ws: WebSocketConnection) -> list[str]:
    """The names of :data:`PRIVATE_NAMES` that trio-websocket lacks: methods looked up on
    ``WebSocketConnection`` itself (an override here must still override something), state on
    the connection ``ws``. Empty with the pinned release."""
    return [m for m in PRIVATE_METHODS if not hasattr(WebSocketConnection, m)] + [
        name for name in PRIVATE_STATE if not hasattr(ws, name)
    ]


# --------------------------------------------------------------------------- the batched writer's view


def encode(ws: WebSocketConnection, event: Event) -> bytes:
    """The wire bytes of ``event`` (a message frame), from the connection's wsproto state."""
    return ws._wsproto.send(event)


def transport(ws: WebSocketConnection) -> trio.abc.Stream:
    """The byte stream under the connection."""
    return ws._stream


def write_lock(ws: WebSocketConnection) -> trio.StrictFIFOLock:
    """The lock every write to :func:`transport` holds (trio-websocket's own sends take it)."""
    return ws._stream_lock


def close_reason(ws: WebSocketConnection) -> CloseReason | None:
    """Why the connection closed (``None`` while open): set before the close frame is sent."""
    return ws._close_reason


async def abort(ws: WebSocketConnection) -> None:
    """Close the connection at once after a failed write (1006 for its reader)."""
    await ws._abort_web_socket()


# --------------------------------------------------------------------------- the server connection


async def read_handshake(ws: WebSocketConnection) -> WebSocketRequest:
    """Wait for the client's handshake request (the reader task must be running)."""
    return await ws._get_request()


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


async def run_reader(ws: SidecarWebSocket) -> None:
    """The connection's reader task; an unexpected error is logged and closes it (1011)."""
    try:
        await ws._reader_task()
    except Exception:
        log.exception("%s websocket reader failed", ws)
        if ws._close_reason is None:
            ws._close_reason = CloseReason(1011, "internal error")
        ws._close_handshake.set()
        await trio.aclose_forcefully(ws._stream)

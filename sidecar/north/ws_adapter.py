"""The sidecar's WebSocket listener on trio-websocket: :func:`serve` replaces
``serve_websocket`` (same listeners, TLS, handshake timeout) so that every connection is a
:class:`~sidecar.north._trio_websocket_internals.SidecarWebSocket` (close frames on client
faults, the RFC 6455 way), applies the per-peer connection limits at accept, and guarantees that
nothing a connection does escapes into the listener's nursery: an unexpected error is logged and
ends that connection only (the listener keeps serving others).

What this needs from trio-websocket beyond its public API lives in
``sidecar.north._trio_websocket_internals`` (one module, guarded by a test).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from functools import partial

import trio
from trio_websocket import WebSocketRequest
from wsproto import ConnectionType, WSConnection

from sidecar.north._trio_websocket_internals import SidecarWebSocket, read_handshake, run_reader
from sidecar.north.peers import Peer, PeerLimits, peer_of

log = logging.getLogger(__name__)

#: Seconds the reader may still take after the handler returned (close handshake, linger).
READER_GRACE = 5.0


async def serve(
    handler: Callable[[WebSocketRequest, Peer], Awaitable[None]],
    host: str | None,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
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
    listeners: list[trio.abc.Listener[trio.abc.Stream]]
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


def _port(listener: trio.abc.Listener[trio.abc.Stream]) -> int:
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
        nursery.start_soon(run_reader, ws)
        request = None
        with trio.move_on_after(handshake_timeout):
            request = await read_handshake(ws)
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

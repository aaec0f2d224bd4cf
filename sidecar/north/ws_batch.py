"""Several WebSocket messages in one socket write.

trio-websocket sends each message with its own ``send_all`` (one syscall per token event),
which was a quarter of the sidecar's CPU when relaying (docs/PERFORMANCE.md). Frames queued
for one connection are encoded into WebSocket frames together and written at once. Each
is still its own WebSocket message (the protocol is unchanged).

This uses trio-websocket's internals (``_wsproto``, ``_stream``, ``_stream_lock``,
``_close_reason``, ``_abort_web_socket``), exactly as its own ``_send`` does; the dependency
is pinned to the 0.12 series, and :func:`supported` falls back to ``send_message`` per frame
if a release renames them.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.events import BytesMessage, TextMessage

_INTERNALS = ("_wsproto", "_stream", "_stream_lock", "_close_reason", "_abort_web_socket")


def supported(ws: WebSocketConnection) -> bool:
    """Whether this connection exposes the internals :func:`send_batch` relies on."""
    return all(hasattr(ws, name) for name in _INTERNALS)


async def send_batch(ws: WebSocketConnection, frames: Sequence[str | bytes]) -> None:
    """Send ``frames`` in order as separate messages with one write; ``ConnectionClosed`` as
    ``send_message`` would raise it."""
    if not supported(ws):
        for frame in frames:
            await ws.send_message(frame)
        return
    if ws._close_reason:
        raise ConnectionClosed(ws._close_reason)
    proto = ws._wsproto
    data = b"".join(
        proto.send(TextMessage(data=f) if isinstance(f, str) else BytesMessage(data=f)) for f in frames
    )
    async with ws._stream_lock:
        try:
            await ws._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await ws._abort_web_socket()
            raise ConnectionClosed(ws._close_reason) from None

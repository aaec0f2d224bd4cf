"""Several WebSocket messages in one socket write, and a write that yields to a close frame.

trio-websocket sends each message with its own ``send_all`` (one syscall per token event),
which cost a quarter of the sidecar's CPU when relaying (measured: docs/results/optimisations.md). Frames queued
for one connection are encoded into WebSocket frames together and written at once, up to
:data:`MAX_WRITE` bytes per write. Each is still its own WebSocket message (the protocol is
unchanged).

A client that stops reading leaves a write blocked with the socket (the connection's write
lock) held, so a close frame (the stalled client's 1008) would queue behind the
rest of that write — and on a stuck TCP connection every further window of data can wait for
a zero-window probe, seconds apart. :meth:`BatchWriter.interrupt` stops the write in progress
at the end of the frame being written (plain TCP: the write goes through the socket's own
``send``, so it knows how far it got); the frames after it are dropped and the close frame is
the next thing on the wire after the kernel's buffers. Over TLS the write cannot be split
(``SSLStream``): the close frame follows the write in progress (at most :data:`MAX_WRITE`).

This writes as trio-websocket's own send does, through the accessors of
``sidecar.north._trio_websocket_internals`` (the one module naming its internals; the
dependency is pinned to the 0.12 series), and :func:`supported` falls back to ``send_message``
per frame if a release renames them.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.events import BytesMessage, TextMessage

from sidecar.north import _trio_websocket_internals as internals
from sidecar.socket_io import write_now

#: Most bytes one socket write carries (a single larger frame is written alone).
MAX_WRITE = 64 * 1024


def supported(ws: WebSocketConnection) -> bool:
    """Whether this connection exposes the internals :func:`send_batch` relies on."""
    return not internals.missing_internals(ws)


async def send_batch(
    ws: WebSocketConnection, frames: Sequence[str | bytes], *, max_write: int = MAX_WRITE
) -> None:
    """``BatchWriter(ws).send(frames)``: for a one-off batch."""
    await BatchWriter(ws, max_write=max_write).send(frames)


class BatchWriter:
    """The send side of one connection (one task sends; any task may :meth:`interrupt`)."""

    def __init__(self, ws: WebSocketConnection, *, max_write: int = MAX_WRITE) -> None:
        self.ws = ws
        self.max_write = max_write
        self.interrupted = False
        self._batched = supported(ws)  # checked once per connection, not per write
        self._scope: trio.CancelScope | None = None

    def interrupt(self) -> None:
        """The connection is about to be closed: stop the write in progress at the end of the
        frame being written, drop the rest, and send nothing more (:meth:`send` then raises
        ConnectionClosed)."""
        self.interrupted = True
        if self._scope is not None:
            self._scope.cancel()

    async def send(self, frames: Sequence[str | bytes]) -> None:
        """Send ``frames`` in order as separate messages, one socket write per ``max_write``
        bytes (frame-aligned; a larger frame alone), the socket released between writes;
        ``ConnectionClosed`` as ``send_message`` would raise it, or once interrupted."""
        ws = self.ws
        if not self._batched:
            for frame in frames:
                await ws.send_message(frame)
            return
        if internals.close_reason(ws) or self.interrupted:
            raise ConnectionClosed(internals.close_reason(ws))
        chunks: list[tuple[bytes, list[int]]] = []  # (bytes, end offset of each frame)
        parts: list[bytes] = []
        ends: list[int] = []
        size = 0
        for f in frames:
            data = internals.encode(ws, TextMessage(data=f) if isinstance(f, str) else BytesMessage(data=f))
            if parts and size + len(data) > self.max_write:
                chunks.append((b"".join(parts), ends))
                parts, ends, size = [], [], 0
            parts.append(data)
            size += len(data)
            ends.append(size)
        if parts:
            chunks.append((b"".join(parts), ends))
        stream = internals.transport(ws)
        lock = internals.write_lock(ws)
        plain = stream if isinstance(stream, trio.SocketStream) else None  # not TLS
        for data, frame_ends in chunks:
            sent = 0
            if lock.locked():
                await lock.acquire()
            else:  # no write under way: offer it to the kernel at once, without a yield
                if not (internals.close_reason(ws) or self.interrupted) and plain is not None:
                    sent = write_now(plain, data)
                    if sent == len(data):
                        continue
                lock.acquire_nowait()  # nothing ran since the check: it is free
            try:
                if internals.close_reason(ws) or self.interrupted:
                    # closed while we waited: nothing may follow the close frame (nothing was
                    # written at once in that case)
                    raise ConnectionClosed(internals.close_reason(ws))
                try:
                    if plain is not None:
                        await self._write_frames(plain.socket, data, frame_ends, sent)
                    else:
                        await stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await internals.abort(ws)
                    raise ConnectionClosed(internals.close_reason(ws)) from None
            finally:
                lock.release()
            if self.interrupted:
                raise ConnectionClosed(internals.close_reason(ws))

    async def _write_frames(
        self, sock: trio.socket.SocketType, data: bytes, frame_ends: list[int], sent: int = 0
    ) -> None:
        """Write ``data`` from offset ``sent``; when interrupted, stop at the end of the frame in
        progress. (A trio socket's ``send`` that raises Cancelled sent nothing, so ``sent`` is
        exact.)"""
        view = memoryview(data)
        with trio.CancelScope() as scope:
            self._scope = scope
            if self.interrupted:
                scope.cancel()
            try:
                while sent < len(data):
                    sent += await sock.send(view[sent:])
            finally:
                self._scope = None
        if sent < len(data):  # interrupted: complete the frame in progress, if one is
            boundary = next(end for end in frame_ends if end >= sent) if sent else 0
            while sent < boundary:
                sent += await sock.send(view[sent:boundary])

"""Reads and writes on a plain socket without trio's extra trips through its scheduler.

A trio socket's ``send`` (and ``SocketStream.send_all`` on it) checks for cancellation and
yields to the scheduler around every write even when the kernel takes the bytes at once; its
``recv`` first tries the read (on a connection that delivers one message at a time, usually a
wasted system call raising ``BlockingIOError``) before it waits. On the sidecar's per-event
paths — an engine connection's frames, a WebSocket client's batch, an HTTP response's chunk —
those trips are a measurable share of the CPU per event (docs/design/engine-transport.md).
:func:`write_now` offers the bytes to the kernel directly (trio's sockets are non-blocking);
what it does not take, the caller writes the usual way, which waits for room and raises what it
raises. :func:`receive_some` waits until the socket is readable, then reads once.
"""

from __future__ import annotations

import errno
import os

import trio

__all__ = ["receive_some", "write_now"]

#: errno of a read on a socket closed under it (trio's own set).
_CLOSED = frozenset({errno.EBADF, errno.ENOTSOCK})


def write_now(target: trio.abc.Stream | trio.socket.SocketType, data: bytes | memoryview) -> int:
    """Bytes of ``data`` the kernel took at once: from the start, without waiting, without a
    checkpoint. 0 for a stream that is not a plain socket (TLS), a full socket buffer or any
    error (the caller's own write then meets the error). The caller must hold whatever
    serializes its writes (nothing else may write to the socket meanwhile)."""
    if type(target) is trio.SocketStream:
        fd = target.socket.fileno()
    elif isinstance(target, trio.socket.SocketType):
        fd = target.fileno()
    else:
        return 0
    try:
        return os.write(fd, data)
    except OSError:
        return 0


async def receive_some(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray:
    """At most ``max_bytes`` of ``stream`` (``b""``: the peer closed it), as
    ``stream.receive_some``: a checkpoint, and the errors it raises. On a plain socket: one wait
    for readability, then one read (trio's would try the read first). Only one task may read
    ``stream``."""
    if type(stream) is not trio.SocketStream:
        return await stream.receive_some(max_bytes)
    fd = stream.socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("this socket was already closed")
    try:
        while True:
            await trio.lowlevel.wait_readable(fd)  # a close meanwhile raises ClosedResourceError
            try:
                return os.read(fd, max_bytes)
            except BlockingIOError:  # readable, then taken by nothing: a spurious wake-up
                continue
    except OSError as err:  # as trio's SocketStream translates them
        if err.errno in _CLOSED:
            raise trio.ClosedResourceError("this socket was already closed") from None
        raise trio.BrokenResourceError(f"socket connection broken: {err}") from err

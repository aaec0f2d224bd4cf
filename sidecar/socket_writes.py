"""One write to a plain socket without a trip through trio's scheduler.

A trio socket's ``send`` (and ``SocketStream.send_all`` on it) checks for cancellation and
yields to the scheduler around every write even when the kernel takes the bytes at once; on the
sidecar's write-per-event paths — an engine connection's frames, a WebSocket client's batch, an
HTTP response's chunk — those trips are a measurable share of the CPU per event
(docs/results/generate-transport.md, docs/results/openai-front.md). :func:`write_now` offers the
bytes to the kernel directly (trio's sockets are non-blocking); what it does not take, the
caller writes the usual way, which waits for room and raises what it raises.
"""

from __future__ import annotations

import os

import trio

__all__ = ["write_now"]


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

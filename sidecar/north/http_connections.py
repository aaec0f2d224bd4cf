"""Connection limits of the HTTP (probe) listener: in total and per peer address.

Counted from the TCP accept (a TLS handshake in progress holds a file descriptor too) to the
close, with :class:`~sidecar.north.peers.PeerLimits` (peers as there: an IP address, IPv6 per
/64). Unlike the WebSocket listener, a new connection over a limit does not simply lose: the
**oldest idle connection** — one with no request in progress — is closed to make room: of the
same peer at the per-peer limit, of any peer at the total one; first among those that never
completed a request (silent, or trickling one), then among keep-alive connections waiting
for their next. So a flood of idle connections, even from the kubelet's own address (a
``hostNetwork`` pod shares it), cannot keep a probe out: the probe sends its request at once
and the flood's older connections go first, and a scraper's keep-alive connection outlives
the flood's. A connection whose bytes wait unread (a request that has just arrived, not yet
parsed) is never chosen. Only when no connection can be closed that way is the new one
refused (HTTP 503, ``Retry-After: 1``, as :meth:`PeerLimits.refuse`). Both count in
``openengine_sidecar_limit_refusals_total{limit="http_connections"|"http_connections_per_peer"}``.
"""

from __future__ import annotations

import os
import socket
from typing import Protocol

import trio

from sidecar.core import metrics
from sidecar.north.peers import Peer, PeerLimits


class Tracked(Protocol):
    """One counted connection (the HTTP listener's per-connection server)."""

    @property
    def peer(self) -> Peer: ...

    @property
    def stream(self) -> trio.abc.Stream: ...


class HttpConnections:
    """The open connections of one HTTP listener (0: no limit)."""

    def __init__(
        self, max_connections: int = 0, max_connections_per_peer: int = 0, *, prefix: str = "http_"
    ) -> None:
        self.limits = PeerLimits(max_connections, max_connections_per_peer, prefix=prefix)
        self._open: set[Tracked] = set()
        # idle connections, longest idle first: those that never completed a request, the others
        self._silent: dict[Tracked, None] = {}
        self._idle: dict[Tracked, None] = {}

    @property
    def count(self) -> int:
        return self.limits.connections

    async def admit(self, conn: Tracked) -> bool:
        """Count ``conn`` (idle until :meth:`busy`), closing older idle connections over a
        limit (module doc); False when it was refused instead (then it is not counted and its
        stream is answered 503; the caller closes it)."""
        while (limit := self.limits.connect(conn.peer.key)) is not None:
            same_peer = limit.endswith("per_peer")
            victim = next(
                (
                    c
                    for idle in (self._silent, self._idle)
                    for c in idle
                    if (not same_peer or c.peer.key == conn.peer.key) and not _has_input(c.stream)
                ),
                None,
            )
            if victim is None:
                await self.limits.refuse(conn.stream, conn.peer, limit)
                return False
            metrics.child(metrics.LIMIT_REFUSALS, limit).inc()
            self.release(victim)
            await trio.aclose_forcefully(victim.stream)  # its task ends, reading a closed stream
        self._open.add(conn)
        self._silent[conn] = None
        return True

    def busy(self, conn: Tracked, busy: bool) -> None:
        """``conn`` has a request in progress (``busy``) or is idle again (now the youngest)."""
        if conn not in self._open:
            return
        self._silent.pop(conn, None)
        self._idle.pop(conn, None)
        if not busy:
            self._idle[conn] = None

    def release(self, conn: Tracked) -> None:
        """``conn`` is closed (or being closed to make room): uncounted. Idempotent."""
        if conn in self._open:
            self._open.discard(conn)
            self._silent.pop(conn, None)
            self._idle.pop(conn, None)
            self.limits.disconnect(conn.peer.key)


def _has_input(stream: trio.abc.Stream) -> bool:
    """Whether bytes wait unread on ``stream``'s socket: its client has spoken and the server
    will read it next (a client that has closed its side has not: it is gone)."""
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    try:
        with socket.socket(fileno=os.dup(stream.socket.fileno())) as sock:  # type: ignore[attr-defined]
            return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (AttributeError, OSError, ValueError):  # nothing waiting (EAGAIN), no socket, closed
        return False

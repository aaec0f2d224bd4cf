"""Connection limits of the WebSocket listener: in total, per peer address, streams per peer.

Counted from the TCP accept (a connection that never completes its handshake holds a file
descriptor too) to the close. A connection over a limit is refused before any WebSocket work:
on plaintext listeners with an HTTP ``503`` written at once (``Retry-After: 1``), the write side
closed, and what the client already sent discarded for at most :data:`REFUSE_LINGER` seconds
(closing with unread data would reset the connection and could destroy the answer); over TLS
(no answer is possible before a handshake) the TCP connection is closed at once. At most
:data:`MAX_REFUSING` refusals linger at a time; beyond that, new ones are closed at once too,
so refused connections can never use up the file descriptors either.

A *peer* is the client's IP address; IPv6 addresses count per /64 (one host usually holds a
whole /64). Behind a proxy every client is the proxy: raise the per-peer limits there (0 turns
them off). docs/SECURITY.md lists the limits and their flags.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
from dataclasses import dataclass

import trio

from sidecar.core import metrics

log = logging.getLogger(__name__)

#: Seconds a refused plaintext connection may take to read its 503 before it is closed.
REFUSE_LINGER = 1.0
#: Refused connections lingering at once (more are closed without an answer).
MAX_REFUSING = 64
#: File descriptors kept for everything but client connections (engine channels, KV sockets,
#: files, refused connections lingering): ``--max-connections`` is lowered to stay below the
#: process's ``RLIMIT_NOFILE`` minus this.
FD_RESERVE = 512

_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: text/plain\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is at the other end of a connection, read once at accept."""

    #: What the per-peer limits count by (:func:`peer_key`).
    key: str
    #: ``host:port`` for log lines.
    address: str


#: Seconds between two log lines about refused connections (the ones between are counted).
REFUSAL_LOG_INTERVAL = 10.0


def peer_key(address: object) -> str:
    """The peer an address counts against: its IP, an IPv6 one by /64 (``"?"`` when unknown)."""
    host = address[0] if isinstance(address, tuple) and address else None
    if not isinstance(host, str):
        return "?"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def peer_of(stream: trio.abc.Stream) -> Peer:
    """The :class:`Peer` of an accepted stream, read once at accept (a closed socket cannot
    tell its peer any more)."""
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    sock = getattr(stream, "socket", None)
    try:
        address = sock.getpeername() if sock is not None else None
    except OSError:
        address = None
    if not isinstance(address, tuple) or len(address) < 2:
        return Peer("?", "?")
    host, port = address[0], address[1]
    return Peer(peer_key(address), f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}")


class PeerLimits:
    """Open connections (total, per peer) and open streams per peer of one listener.

    ``max_connections`` / ``max_connections_per_peer`` / ``max_streams_per_peer``: 0 = no limit.
    ``prefix`` goes before the connection limits' names (metric label, log): ``"http_"`` for
    the HTTP listener's.
    """

    def __init__(
        self,
        max_connections: int = 0,
        max_connections_per_peer: int = 0,
        max_streams_per_peer: int = 0,
        *,
        prefix: str = "",
    ) -> None:
        self.prefix = prefix
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self.max_streams_per_peer = max_streams_per_peer
        self.connections = 0
        self._per_peer: dict[str, int] = {}
        self._streams: dict[str, int] = {}
        self._refusing = 0
        self._unlogged = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL

    # -- connections -------------------------------------------------------------------------

    def connect(self, peer: str) -> str | None:
        """Count a new connection of ``peer``; the name of the limit it exceeds instead (then
        it is not counted)."""
        if self.max_connections and self.connections >= self.max_connections:
            return self.prefix + "connections"
        held = self._per_peer.get(peer, 0)
        if self.max_connections_per_peer and held >= self.max_connections_per_peer:
            return self.prefix + "connections_per_peer"
        self.connections += 1
        self._per_peer[peer] = held + 1
        return None

    def disconnect(self, peer: str) -> None:
        self.connections -= 1
        _decrement(self._per_peer, peer)

    async def refuse(self, stream: trio.abc.Stream, peer: Peer, limit: str) -> None:
        """Refuse an accepted connection (see module doc); the caller closes ``stream``. Logged
        at most once per :data:`REFUSAL_LOG_INTERVAL`, with the count since the last line."""
        metrics.child(metrics.LIMIT_REFUSALS, limit).inc()
        self._unlogged += 1
        now = trio.current_time()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL:
            log.warning(
                "refused %d connection(s) over the limits (last: %s, %s; %d open)",
                self._unlogged,
                peer.address,
                limit,
                self.connections,
            )
            self._unlogged, self._logged_at = 0, now
        if isinstance(stream, trio.SSLStream) or self._refusing >= MAX_REFUSING:
            return
        self._refusing += 1
        try:
            body = b"too many connections (%s)\n" % limit.encode()
            with trio.move_on_after(REFUSE_LINGER):
                try:
                    await stream.send_all(_REFUSAL % (len(body), body))
                    if isinstance(stream, trio.abc.HalfCloseableStream):
                        await stream.send_eof()
                    received = 0
                    while received < 65536 and (data := await stream.receive_some(16384)):
                        received += len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        finally:
            self._refusing -= 1

    # -- streams per peer ------------------------------------------------------------------------

    def open_stream(self, peer: str) -> bool:
        """Count a stream of ``peer``; False (not counted) when it holds its share already."""
        held = self._streams.get(peer, 0)
        if self.max_streams_per_peer and held >= self.max_streams_per_peer:
            metrics.child(metrics.LIMIT_REFUSALS, "streams_per_peer").inc()
            return False
        self._streams[peer] = held + 1
        return True

    def close_stream(self, peer: str) -> None:
        _decrement(self._streams, peer)


def _decrement(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def fit_to_fd_limit(max_connections: int) -> int:
    """``max_connections`` made to fit the process's file-descriptor limit: the soft
    ``RLIMIT_NOFILE`` is raised (up to the hard one) to ``max_connections`` + :data:`FD_RESERVE`;
    if even the hard limit is lower, the connections allowed are lowered to fit (logged). Without
    that, connections would run into ``EMFILE`` first — for the engine's channels too."""
    if max_connections <= 0:
        return max_connections
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - no such limit on this platform
        return max_connections
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        except (OSError, ValueError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fitted = max(1, soft - FD_RESERVE)
        log.warning(
            "--max-connections %d lowered to %d: the file descriptor limit is %d (raise LimitNOFILE / ulimit -n)",
            max_connections,
            fitted,
            soft,
        )
        return fitted
    return max_connections

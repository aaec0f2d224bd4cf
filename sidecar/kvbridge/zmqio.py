"""pyzmq under trio: receive without blocking the thread, binding, and endpoint helpers.

ZMQ's notification FD is edge-triggered (docs/design/stack-notes.md): any send, receive or ``EVENTS`` read
may consume the notification. So we only wait on the FD after ``EVENTS`` says there is
nothing to do, and re-check ``EVENTS`` after every wake-up. One task owns each socket;
callers close sockets with ``linger=0`` in ``finally``.
"""

from __future__ import annotations

import trio
import zmq

from sidecar.kvbridge.errors import KvConfigError

_EVENTS = zmq.EVENTS
_POLLIN = zmq.POLLIN
_NOBLOCK = zmq.NOBLOCK


async def recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One multipart message. Cancellable while waiting; a checkpoint only when it waits."""
    while not (int(sock.getsockopt(_EVENTS)) & _POLLIN):
        await trio.lowlevel.wait_readable(sock.FD)
    return sock.recv_multipart(_NOBLOCK)


async def recv_some(sock: zmq.Socket[bytes], limit: int) -> list[list[bytes]]:
    """Wait for at least one message, then take every queued one, up to ``limit``."""
    while not (int(sock.getsockopt(_EVENTS)) & _POLLIN):
        await trio.lowlevel.wait_readable(sock.FD)
    out = [sock.recv_multipart(_NOBLOCK)]
    while len(out) < limit and int(sock.getsockopt(_EVENTS)) & _POLLIN:
        out.append(sock.recv_multipart(_NOBLOCK))
    return out


def bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind ``sock``; returns the bound endpoint (``LAST_ENDPOINT``). Raises ``OSError``."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as err:
        raise OSError(
            err.errno, f"cannot bind KV {zmq.SocketType(int(sock.type)).name} socket on {endpoint}: {err}"
        ) from err
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


def split_tcp(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``; raises :class:`KvConfigError`."""
    if not endpoint.startswith("tcp://"):
        raise KvConfigError(f"not a tcp:// endpoint: {endpoint!r}")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KvConfigError(f"endpoint {endpoint!r} needs host:port")
    return host, int(port)


def rank_endpoint(endpoint: str, rank_offset: int) -> str:
    """The bind endpoint of the ``rank_offset``-th rank: ``tcp`` port + offset, ``ipc`` path + ``_dp<N>``.

    Port 0 stays 0 (each rank gets its own ephemeral port). Raises :class:`KvConfigError`.
    """
    if endpoint.startswith("tcp://"):
        host, port = split_tcp(endpoint)
        if port == 0 or rank_offset == 0:
            return f"tcp://{host}:{port}"
        if port + rank_offset > 65535:
            raise KvConfigError(f"endpoint {endpoint!r} + rank {rank_offset} exceeds port 65535")
        return f"tcp://{host}:{port + rank_offset}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if rank_offset == 0 else f"{endpoint}_dp{rank_offset}"
    raise KvConfigError(f"unsupported endpoint {endpoint!r} (tcp://host:port or ipc://path)")


def advertised(bound: str, advertise_host: str | None) -> str:
    """A bound endpoint (``LAST_ENDPOINT``) with its host replaced by ``advertise_host`` if given."""
    if advertise_host and bound.startswith("tcp://"):
        _, port = split_tcp(bound)
        host = (
            f"[{advertise_host}]"
            if ":" in advertise_host and not advertise_host.startswith("[")
            else advertise_host
        )
        return f"tcp://{host}:{port}"
    return bound

"""Every listen address of ``run`` tried at once before anything serves, so an operator learns
of every clash in one message, each with its flag (a second sidecar on one host would
otherwise meet its default ports one failure at a time).

:func:`check_listeners` binds (and listens on) each address the way its server will — the
WebSocket and HTTP listeners with ``trio.open_tcp_listeners``, the KV bridge's endpoints with a
ZMQ socket of the same type —, holding them all at once so two flags given the same port clash
too, then releases them. The servers bind for real right after: an address taken in between is
still reported by the server itself, as one line.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import trio
import zmq

from sidecar.addresses import split_host_port
from sidecar.core.sidecar import StartupError
from sidecar.kvbridge import KvBridgeConfig
from sidecar.kvbridge.zmqio import rank_endpoint

__all__ = ["Failure", "Listener", "ListenerClash", "check_listeners", "check_run_listeners"]


@dataclass(frozen=True)
class Listener:
    """One listen address: ``flag`` (``--listen``), ``address`` as bound (``HOST:PORT``, or a
    ZMQ endpoint when ``zmq_type`` is set: ``zmq.PUB``, ``zmq.ROUTER``), ``note`` (``DP rank 1``)."""

    flag: str
    address: str
    zmq_type: int | None = None
    note: str = ""

    @property
    def port(self) -> int | None:
        """The TCP port, when there is one (``tcp://`` for a ZMQ endpoint)."""
        text = self.address
        if self.zmq_type is not None:
            if not text.startswith("tcp://"):
                return None
            text = text[len("tcp://") :]
        try:
            return split_host_port(text)[1]
        except ValueError:
            return None


@dataclass(frozen=True)
class Failure:
    """A listener that could not be bound, and why (``in_use``: another process has the port)."""

    listener: Listener
    reason: str
    in_use: bool = False


class ListenerClash(Exception):
    """Some listen addresses cannot be bound; ``str()`` is the one line that lists them all."""

    def __init__(self, failures: Sequence[Failure]) -> None:
        self.failures = list(failures)
        listed = ", ".join(
            f"{f.listener.flag} {f.listener.address} ({f.listener.note + ': ' if f.listener.note else ''}{f.reason})"
            for f in failures
        )
        hint = (
            " (in use by another process: a second sidecar on one host needs its own ports, or port 0 for any free one)"
            if any(f.in_use for f in failures)
            else ""
        )
        super().__init__(f"cannot listen on {listed}{hint}")


async def check_listeners(listeners: Sequence[Listener]) -> None:
    """Bind every one of ``listeners`` at once, then release them; :class:`ListenerClash`
    naming each that failed (in use, not a local address, a name that does not resolve).

    ZMQ endpoints other than ``tcp://`` (``ipc://``, ``inproc://``) are left to their server.
    Holds nothing once it returns or raises; cancellable while resolving host names.
    """
    failures: list[Failure] = []
    held: dict[int, str] = {}  # port -> the first flag of ours bound to it
    ctx = zmq.Context()
    try:
        with ExitStack() as stack:
            for lis in listeners:
                try:
                    if lis.zmq_type is None:
                        host, port = split_host_port(lis.address)
                        for listener in await trio.open_tcp_listeners(port, host=host):
                            stack.callback(listener.socket.close)
                    elif lis.address.startswith("tcp://"):
                        zsock = ctx.socket(lis.zmq_type)
                        stack.callback(zsock.close, linger=0)
                        zsock.bind(lis.address)
                    else:
                        continue
                except (OSError, zmq.ZMQError) as err:
                    failures.append(_failure(lis, err, held.get(lis.port or -1)))
                else:
                    if lis.port:
                        held.setdefault(lis.port, lis.flag)
    finally:
        ctx.destroy(linger=0)  # waits for the sockets' closing: their ports are free again
    if failures:
        raise ListenerClash(failures)


def _failure(lis: Listener, err: OSError | zmq.ZMQError, ours: str | None) -> Failure:
    # (pyzmq's strerror also names the address, given already)
    if isinstance(err, zmq.ZMQError) and err.errno is not None:
        reason = zmq.strerror(err.errno)
    else:
        reason = err.strerror or str(err)
    if err.errno != errno.EADDRINUSE:
        return Failure(lis, reason)
    if ours is not None:
        return Failure(lis, f"{reason}; {ours} is given that port too")
    return Failure(lis, reason, in_use=True)


async def check_run_listeners(
    listen: str,
    http_listen: str,
    kv: KvBridgeConfig | None,
    dp_ranks: Sequence[int],
    *,
    openai_listen: str | None = None,
) -> None:
    """:func:`check_listeners` over ``run``'s listeners: ``--listen``, ``--http-listen``,
    ``--openai-listen`` when given and,
    with ``kv`` (a bridge that will start), ``--kv-publish`` / ``--kv-replay`` of every DP rank
    in ``dp_ranks`` (rank 0 when empty). Raises :class:`StartupError` (the clash's line)."""
    listeners = [Listener("--listen", listen), Listener("--http-listen", http_listen)]
    if openai_listen is not None:
        listeners.append(Listener("--openai-listen", openai_listen))
    if kv is not None:
        for rank in dp_ranks or [0]:
            note = f"DP rank {rank}" if rank else ""
            listeners.append(
                Listener("--kv-publish", rank_endpoint(kv.publish_endpoint, rank), zmq.PUB, note)
            )
            if kv.replay_endpoint is not None:
                endpoint = rank_endpoint(kv.replay_endpoint, rank)
                listeners.append(Listener("--kv-replay", endpoint, zmq.ROUTER, note))
    try:
        await check_listeners(listeners)
    except ListenerClash as clash:
        raise StartupError(str(clash)) from None

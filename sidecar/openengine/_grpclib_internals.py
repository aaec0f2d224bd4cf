"""Every private name of grpclib (and of the h2 connection it holds) the sidecar uses: here only.

grpclib has no public API for what the Generate pool and the serving kit need, so this module
reaches into grpclib 0.4.9 and h2 4.x (pinned ``grpclib>=0.4.9,<0.5``) and nothing else in
the repository does. :func:`missing_internals` lists what a release lacks;
``tests/openengine/test_grpclib_internals.py`` asserts it is empty and exercises every
function against a real connection, so an upgrade that renames or reshapes one fails there,
loudly, instead of in production.

What is used, and why:

- ``Channel._protocol_factory`` (overridden, with ``Channel._config`` / ``_h2_config``): our
  connections are :class:`ClientProtocol` — hooks after grpclib's handling of h2 events
  (``EventsProcessor.processors`` chained: the peer's first SETTINGS, and for liveness DATA,
  HEADERS and PING acks), the h2 connection itself (``protocol.connection._connection``: its
  public ``ping`` / ``open_outbound_streams``; grpclib's ``Connection.flush`` after it), h2's
  closed-stream memory capped (``H2Connection._closed_streams._size_limit``, a
  ``SizeLimitDict``), and a transport wrapper that may batch writes.
- ``protocol.connection.write_ready`` and ``.stream_close_waiter``: the asyncio events a
  call waits on before it opens its stream (while the transport's buffer is over its high-water
  mark, or the peer's stream limit is reached). grpclib's ``connection_lost`` sets neither and
  such a call is in no list the lost connection terminates, so it would wait forever (issue
  22). :class:`ClientProtocol` replaces both with :class:`_LossAwareEvent`: on loss they are
  set and their waiters raise ``StreamTerminatedError`` (-> ``EngineUnavailable``).
- ``Channel._protocol``, ``Channel.__connect__()``, ``protocol.handler.connection_lost``:
  which connection a channel holds, connect it, and whether it is lost (the pool sizes a
  channel for the connection it computed the cap on).
- ``protocol.connection._connection.remote_settings.max_concurrent_streams``: the peer's
  stream limit.
- ``Server._server`` (the asyncio server): the port an ephemeral TCP listen got.
- ``grpclib.protocol.H2Connection`` (replaced; benchmark engine processes only): server
  connections advertising a different ``SETTINGS_MAX_CONCURRENT_STREAMS``.
- A client ``Stream``'s receive path (``_recv_initial_metadata_done``, ``_wrapper``,
  ``_stream.recv_data``, ``_codec``, ``_recv_type``, ``_dispatch``, ``_messages_received``
  and the connection's ``messages_received`` / ``last_message_received``):
  :func:`recv_bounded` is grpclib's ``Stream.recv_message`` with the gRPC length prefix checked
  before the message is read. grpclib reads a whole message into memory — acknowledging it to
  the engine's flow control as it goes — before decoding it, and the prefix may announce up to
  4 GiB; per message this costs what grpclib's own does plus one comparison, and a large
  message's decoding goes to the caller's ``decode_large`` (a worker thread:
  :mod:`sidecar.openengine.message_limits`). ``tests/openengine/test_bounded_recv.py`` holds
  the behaviour.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import grpclib.client
import grpclib.protocol
import grpclib.server
from grpclib.client import Channel, Handler, Stream
from grpclib.exceptions import StreamTerminatedError
from grpclib.protocol import H2Protocol
from h2.connection import H2Connection
from h2.events import RemoteSettingsChanged
from h2.settings import SettingCodes, Settings

from sidecar.openengine.errors import EngineMessageTooLarge, EngineProtocolError

__all__ = [
    "ClientChannel",
    "ClientProtocol",
    "DecodeLarge",
    "advertise_max_concurrent_streams",
    "bound_closed_streams",
    "channel_protocol",
    "closed_streams",
    "connect",
    "connection_lost",
    "missing_internals",
    "peer_stream_limit",
    "recv_bounded",
    "server_port",
]

#: Transport wrapper a :class:`ClientProtocol` applies to its transport.
TransportWrapper = Callable[[asyncio.Transport], Any]


class _LossAwareEvent(asyncio.Event):
    """An ``asyncio.Event`` whose waiters raise ``StreamTerminatedError`` once :meth:`lose` ran."""

    lost = False

    async def wait(self) -> Literal[True]:
        await super().wait()
        if self.lost:
            raise StreamTerminatedError("Connection lost")
        return True

    def lose(self) -> None:
        self.lost = True
        self.set()


#: The events of grpclib's ``Connection`` :class:`ClientProtocol` replaces with :class:`_LossAwareEvent`.
_LOSS_AWARE = ("write_ready", "stream_close_waiter")


class ClientProtocol(H2Protocol):
    """grpclib's client protocol, plus: ``settings_seen`` (set when the peer's first SETTINGS
    frame arrived, or the connection was lost), calls waiting to open a stream woken with an
    error when the connection is lost (module doc), a bound on the closed stream ids h2 remembers,
    an optional transport wrapper, hooks on h2 events (:meth:`add_event_hook`) and the h2
    connection itself (:meth:`h2`, :meth:`flush`). Subclasses extend :meth:`connection_made`
    (calling it first) to add their hooks."""

    settings_seen: asyncio.Event

    def __init__(
        self,
        config: Any,
        h2_config: Any,
        *,
        closed_streams_kept: int | None = None,
        wrap_transport: TransportWrapper | None = None,
    ) -> None:
        super().__init__(Handler(), config, h2_config)
        self._closed_streams_kept = closed_streams_kept
        self._wrap_transport = wrap_transport
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.settings_seen = asyncio.Event()
        if self._wrap_transport is not None:
            transport = self._wrap_transport(transport)
        self.transport = transport
        super().connection_made(transport)
        connection: Any = self.connection
        connection.write_ready = _LossAwareEvent()
        connection.write_ready.set()  # grpclib's starts set (nothing buffered yet)
        connection.stream_close_waiter = _LossAwareEvent()
        if self._closed_streams_kept is not None:
            bound_closed_streams(self.h2(), self._closed_streams_kept)
        seen = self.settings_seen
        self.add_event_hook(RemoteSettingsChanged, lambda event: seen.set())

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        if hasattr(self, "settings_seen"):
            self.settings_seen.set()
        if hasattr(self, "connection"):
            connection: Any = self.connection
            for name in _LOSS_AWARE:
                getattr(connection, name).lose()

    def add_event_hook(self, kind: type, after: Callable[[Any], None]) -> None:
        """Call ``after(event)`` for every h2 event of class ``kind``, after grpclib processed
        it (``EventsProcessor.processors``, replaced by a chain)."""
        processors: dict[Any, Any] = self.processor.processors
        inner = processors.get(kind)

        def process(event: Any) -> None:
            if inner is not None:
                inner(event)
            after(event)

        processors[kind] = process

    def h2(self) -> H2Connection:
        """The h2 connection (its public API: ``ping``, ``open_outbound_streams``, ...)."""
        connection: H2Connection = self.connection._connection
        return connection

    def flush(self) -> None:
        """Send what the h2 connection has queued (after calling it directly)."""
        self.connection.flush()


class ClientChannel(Channel):
    """A grpclib ``Channel`` whose connections are what :meth:`new_protocol` makes."""

    def new_protocol(self, config: Any, h2_config: Any) -> ClientProtocol:
        """A new connection's protocol, given grpclib's configurations (override to extend)."""
        return ClientProtocol(config, h2_config)

    def _protocol_factory(self) -> H2Protocol:
        return self.new_protocol(self._config, self._h2_config)


def channel_protocol(channel: Channel) -> H2Protocol | None:
    """The connection ``channel`` holds now (None before the first call or after ``close``)."""
    protocol: H2Protocol | None = getattr(channel, "_protocol", None)
    return protocol


async def connect(channel: Channel) -> H2Protocol:
    """Connect ``channel`` if it is not (what its first call would do); its connection.
    Connection errors propagate (``OSError`` and the like)."""
    protocol: H2Protocol = await channel.__connect__()
    return protocol


def connection_lost(protocol: H2Protocol) -> bool:
    """Whether the connection ``protocol`` stands for was lost."""
    handler: Any = protocol.handler  # grpclib.client.Handler
    return bool(handler.connection_lost)


def peer_stream_limit(protocol: Any) -> int | None:
    """The peer's ``SETTINGS_MAX_CONCURRENT_STREAMS`` on a grpclib connection (h2 reports
    2**32+1 while the peer has not set it), or None when it cannot be read."""
    try:
        return int(protocol.connection._connection.remote_settings.max_concurrent_streams)
    except (AttributeError, TypeError, ValueError):
        return None


def closed_streams(protocol: ClientProtocol) -> tuple[int, int]:
    """``(remembered, bound)``: the closed stream ids the connection remembers now, and how
    many it may (h2's ``SizeLimitDict``)."""
    closed: Any = protocol.h2()._closed_streams
    return len(closed), int(closed._size_limit)


def bound_closed_streams(connection: H2Connection, kept: int) -> None:
    """Make an h2 connection remember at most ``kept`` closed stream ids (h2's
    ``_closed_streams``, a ``SizeLimitDict``; used by the grpclib protocol above)."""
    closed: Any = connection._closed_streams
    closed._size_limit = kept


def server_port(server: grpclib.server.Server) -> int | None:
    """The TCP port a started server listens on (None for a unix socket or not started)."""
    listener: Any = server._server
    for sock in listener.sockets if listener is not None else ():
        address = sock.getsockname()
        if isinstance(address, tuple):
            return int(address[1])
    return None


def advertise_max_concurrent_streams(limit: int) -> None:
    """Make every HTTP/2 server connection grpclib opens from now on in this process advertise
    ``limit`` concurrent streams (grpclib's servers advertise h2's default, 100). For the
    benchmark's engine processes only: it replaces grpclib's ``H2Connection`` for good."""

    class _WideH2Connection(H2Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not self.config.client_side:
                self.local_settings = Settings(
                    client=False,
                    initial_values={
                        SettingCodes.MAX_CONCURRENT_STREAMS: limit,
                        SettingCodes.MAX_HEADER_LIST_SIZE: self.DEFAULT_MAX_HEADER_LIST_SIZE,
                    },
                )

    grpclib.protocol.H2Connection = _WideH2Connection  # type: ignore[misc]


#: ``await decode_large(codec_decode, data, message_type)``: decode a large message elsewhere.
DecodeLarge = Callable[[Callable[[bytes, Any], Any], bytes, Any], Awaitable[Any]]


async def recv_bounded(
    stream: Stream[Any, Any], limit: int, decode_large: DecodeLarge | None = None, inline_max: int = 0
) -> Any | None:
    """The next message of ``stream`` (``None`` at its end); :class:`EngineMessageTooLarge`
    when its length prefix exceeds ``limit`` bytes (:mod:`sidecar.openengine.errors`). A
    message over ``inline_max`` bytes is decoded by ``decode_large`` when given."""
    st: Any = stream
    if not st._recv_initial_metadata_done:
        await st.recv_initial_metadata()
    with st._wrapper:
        prefix = await st._stream.recv_data(5)
        if not prefix:
            return None
        if prefix[0]:
            raise EngineProtocolError("engine sent a compressed message (not negotiated)")
        size = int.from_bytes(prefix[1:5], "big")
        if size > limit:
            raise EngineMessageTooLarge(size, limit)
        data = await st._stream.recv_data(size)
        if len(data) != size:
            raise EngineProtocolError(f"engine ended a message after {len(data)} of {size} bytes")
        if size > inline_max and decode_large is not None:
            decoded = await decode_large(st._codec.decode, data, st._recv_type)
        else:
            decoded = st._codec.decode(data, st._recv_type)
        (message,) = await st._dispatch.recv_message(decoded)
        st._messages_received += 1
        st._stream.connection.messages_received += 1
        st._stream.connection.last_message_received = time.monotonic()
        return message


#: A client ``Stream``'s state :func:`recv_bounded` reads or writes (class-level or set in its methods).
_STREAM_STATE = (
    "_recv_initial_metadata_done",
    "_wrapper",
    "_stream",
    "_codec",
    "_recv_type",
    "_dispatch",
    "_messages_received",
)


def missing_internals() -> list[str]:
    """The class-level names above that this grpclib / h2 lacks (empty when all are there).
    What lives on a connection's instances is checked by the guard test on a real one."""
    wanted: list[tuple[Any, str]] = [
        (Channel, "_protocol_factory"),
        (Channel, "__connect__"),
        (grpclib.protocol, "H2Connection"),
        (grpclib.protocol, "EventsProcessor"),
        (H2Protocol, "connection_made"),
        (H2Protocol, "connection_lost"),
        (H2Connection, "DEFAULT_MAX_HEADER_LIST_SIZE"),
        (H2Connection(), "_closed_streams"),
        (Stream, "recv_initial_metadata"),
        (grpclib.protocol.Connection, "messages_received"),
        (grpclib.protocol.Connection, "last_message_received"),
    ]
    missing = [
        f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in wanted if not hasattr(owner, name)
    ]
    source = inspect.getsource(Stream)
    missing += [
        f"Stream.{n}" for n in _STREAM_STATE if f"self.{n}" not in source and f"    {n}" not in source
    ]
    connection = inspect.getsource(grpclib.protocol.Connection.__init__)
    missing += [f"Connection.{n}" for n in _LOSS_AWARE if f"self.{n} = Event()" not in connection]
    return missing

"""The Generate channel pool: HTTP/2 connections added and removed with the number of streams.

Why: an HTTP/2 peer caps the streams open on one connection (``SETTINGS_MAX_CONCURRENT_STREAMS``;
grpclib/h2 servers advertise 100), and a stream opened past the cap waits inside grpclib,
silently and without a timeout. h2 also counts a connection's open streams by walking all of
them on every new stream, so thousands of streams on one connection make stream setup O(n).

Rules (:meth:`GeneratePool.acquire`):

- ``min_channels`` connections are kept for the pool's life (created lazily, one per stream
  until there are that many); streams spread over them, least-loaded first.
- A channel takes at most ``cap`` streams: ``min(max_streams_per_channel, the peer's
  max_concurrent_streams)``. The peer's value is read from the connection's h2 state once its
  first SETTINGS frame has arrived (a new connection's first streams wait for it, up to
  :data:`SETTINGS_WAIT` seconds); until then at most :data:`ASSUMED_PEER_STREAMS` (100): h2-based
  engines enforce that from their first byte and end the whole connection past it.
- When every kept channel is full, streams go to the oldest extra channel with room; when none
  has room, another channel is opened (at most ``max_channels``; past that, the least-loaded
  channel is used and the stream may wait inside grpclib, as before this pool existed).
- An extra channel (beyond ``min_channels``) that drains to zero streams is closed after
  ``idle_close`` seconds (at once when 0, never when negative) unless a stream arrived
  meanwhile. A channel with a stream on it is never closed (except by
  :meth:`GeneratePool.close`).

Every channel of the client (control and KV too) is a :class:`SettingsAwareChannel`, whose
connections also coalesce the writes of one event-loop step into one send: a new stream's
HEADERS and DATA frames (and the frames of streams opened together) leave in one syscall.

**Liveness (HTTP/2 PING).** A hung engine process or a network path that silently drops
packets leaves a TCP connection open that nothing notices: the kernel keeps accepting our
bytes. With a :class:`Keepalive`, each connection sends a PING when the engine *owes* it
something (a stream is open, or one was opened since the engine last sent a frame) and the
engine has sent no DATA or HEADERS for ``interval`` seconds; a PING not acknowledged within
``timeout`` aborts the connection (its streams fail with ``EngineUnavailable``; the next call
opens a new connection). At most :data:`PINGS_PER_SILENCE` acknowledged PINGs are sent per
stretch without DATA/HEADERS: gRPC's C-core and Go servers by default answer a third PING
without data in between (within 5 minutes) with GOAWAY ``too_many_pings``, which would kill a
long prefill; after two acknowledged PINGs the connection counts as alive until the engine
sends data again. :meth:`EngineClient.probe_liveness` sends one PING now on every connection
whatever the count (the sidecar does so when the engine stops answering ``Health``).

What this needs from grpclib and h2 beyond their public API — the connection a channel holds,
hooks on its h2 events (SETTINGS; DATA, HEADERS and PING acks for liveness), the h2
connection (h2's public ``ping``, ``open_outbound_streams``, ``highest_outbound_stream_id``),
h2's closed-stream memory — comes from :mod:`sidecar.openengine._grpclib_internals`, the one
module that touches their internals.

Runs on the asyncio side (trio-asyncio loop). The counts are reservations made by
:meth:`acquire` and returned by the ``release`` callback it hands out; since grpclib closes
(or resets) a stream before the caller releases it, a channel's reservation count is never
below h2's own count of its open streams.

A connection given up for dead is *reset* (:func:`discard_unsent`): a plain close would leave
the kernel retransmitting what we had queued — a Generate's HEADERS, their RST_STREAM — for
minutes, so a request could reach the engine long after its Abort was answered NOT_FOUND
(docs/LIFECYCLE.md). Reset, nothing queued on a dead path arrives later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpclib.client import Channel
from h2.events import (
    DataReceived,
    InformationalResponseReceived,
    PingAckReceived,
    ResponseReceived,
    TrailersReceived,
)

from sidecar.openengine._grpclib_internals import (
    ClientChannel,
    ClientProtocol,
    channel_protocol,
    connect,
    connection_lost,
    peer_stream_limit,
)

log = logging.getLogger(__name__)

#: How long a stream on a new connection waits for the peer's first SETTINGS frame.
SETTINGS_WAIT = 2.0
#: Streams a peer is taken to allow until its SETTINGS arrive (both Generate pools): the least
#: RFC 9113 recommends, and what h2-based servers (grpclib) advertise — and enforce from their
#: first byte: h2 answers one stream more with GOAWAY, ending every stream on the connection.
ASSUMED_PEER_STREAMS = 100

#: How many times :meth:`GeneratePool.acquire` moves a stream off a channel whose cap turned out
#: lower than its reservations before it settles for waiting inside grpclib.
_MAX_MOVES = 8


#: Coalesce the writes of one event-loop step into one send (see :class:`_CoalescingTransport`).
COALESCE_WRITES = True

#: Closed stream ids each HTTP/2 connection remembers (h2's default: 65,536, ~7.5 MiB per
#: connection once filled). h2 keeps them to answer a frame that arrives for a stream after it
#: closed (a DATA frame already in flight when we reset a stream is ignored, not a connection
#: error); 4,096 closures cover far more than one round trip at any rate one connection
#: (<= 128 streams) sees. With h2's default the sidecar's RSS grew by ~0.1 MiB per 1,000
#: streams for 675,000 streams (soak), and a pool of up to 256 connections could hold
#: ~1.9 GiB of it; with 2,048 it was flat after warm-up (docs/RELIABILITY.md, soak).
CLOSED_STREAMS_KEPT = 4096


#: Acknowledged PINGs per stretch without DATA/HEADERS from the engine (module doc: gRPC
#: servers answer the third with GOAWAY ``too_many_pings``).
PINGS_PER_SILENCE = 2


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 PING liveness of engine connections (module doc). ``interval`` <= 0: off.
    ``on_dead`` is called (on the asyncio side) for each connection aborted by it."""

    interval: float = 10.0
    timeout: float = 10.0
    on_dead: Callable[[], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0


class _Liveness:
    """The PING timer of one connection (module doc). Lives and dies with its protocol."""

    def __init__(self, protocol: _PoolProtocol, keepalive: Keepalive) -> None:
        self._protocol = protocol
        self._keepalive = keepalive
        self._loop = asyncio.get_event_loop()
        self._last_data = self._loop.time()
        self._last_ping = 0.0
        self._pings = 0  # acknowledged PINGs since the last DATA/HEADERS
        self._stream_mark = 0  # highest outbound stream id at the last DATA/HEADERS
        self._outstanding: bytes | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._schedule(keepalive.interval)

    def _h2(self) -> Any:
        return self._protocol.h2()

    def data_seen(self) -> None:
        """The engine sent DATA or HEADERS: it is alive; the PING count starts again."""
        self._last_data = self._loop.time()
        self._pings = 0
        with contextlib.suppress(AttributeError):
            self._stream_mark = self._h2().highest_outbound_stream_id or 0

    def ack(self, payload: bytes) -> None:
        if payload == self._outstanding:
            self._outstanding = None
            self._pings += 1
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

    def _owed(self) -> bool:
        """The engine owes us an answer: a stream is open, or one opened since its last data."""
        h2 = self._h2()
        return bool(h2.open_outbound_streams) or (h2.highest_outbound_stream_id or 0) > self._stream_mark

    def _schedule(self, delay: float) -> None:
        if not self._closed:
            self._timer = self._loop.call_later(max(delay, 0.01), self._check)

    def _check(self) -> None:
        self._timer = None
        if self._closed:
            return
        interval = self._keepalive.interval
        now = self._loop.time()
        quiet_since = max(self._last_data, self._last_ping)
        if now - quiet_since < interval:
            self._schedule(quiet_since + interval - now)
            return
        try:
            due = self._outstanding is None and self._pings < PINGS_PER_SILENCE and self._owed()
        except AttributeError:  # the connection is being torn down
            due = False
        if due:
            self.ping()
        self._schedule(interval)

    def ping(self) -> None:
        """Send one PING now (unless one is outstanding) and arm its deadline."""
        if self._closed or self._outstanding is not None:
            return
        payload = os.urandom(8)
        try:
            self._h2().ping(payload)
            self._protocol.flush()
        except Exception as err:  # a closing connection: nothing to probe
            log.debug("engine PING not sent: %s", err)
            return
        self._outstanding = payload
        self._last_ping = self._loop.time()
        self._deadline = self._loop.call_later(self._keepalive.timeout, self._dead)

    def _dead(self) -> None:
        self._deadline = None
        if self._closed:
            return
        log.warning(
            "engine connection %s: no PING answer in %gs; closing it (a hung engine or a dead path)",
            self._protocol.peer_name(),
            self._keepalive.timeout,
        )
        if self._keepalive.on_dead is not None:
            self._keepalive.on_dead()
        self.close()
        self._protocol.abort()

    def close(self) -> None:
        self._closed = True
        for handle in (self._timer, self._deadline):
            if handle is not None:
                handle.cancel()
        self._timer = self._deadline = None


class _CoalescingTransport:
    """Forwards to an asyncio transport; writes made in one event-loop step leave in one
    ``write`` at the end of the step (a new stream's HEADERS and DATA frames, or many streams'
    frames, in one send instead of one each). ``close`` sends what is pending first."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_event_loop()

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def discard_unsent(sock: socket.socket | None) -> None:
    """Make closing ``sock`` a reset (``SO_LINGER`` 0): what is still queued for the peer is
    dropped instead of retransmitted after the close (a no-op for a Unix socket)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _PoolProtocol(ClientProtocol):
    """The client's connections: ``settings_seen``, coalesced writes, :data:`CLOSED_STREAMS_KEPT`
    closed streams remembered, and (with a :class:`Keepalive`) liveness."""

    liveness: _Liveness | None = None

    def __init__(self, config: Any, h2_config: Any, *, keepalive: Keepalive | None = None) -> None:
        super().__init__(
            config,
            h2_config,
            closed_streams_kept=CLOSED_STREAMS_KEPT,
            wrap_transport=_CoalescingTransport if COALESCE_WRITES else None,
        )
        self._keepalive = keepalive

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if self._keepalive is not None and self._keepalive.enabled:
            liveness = self.liveness = _Liveness(self, self._keepalive)
            for kind in (DataReceived, ResponseReceived, TrailersReceived, InformationalResponseReceived):
                self.add_event_hook(kind, lambda event: liveness.data_seen())
            self.add_event_hook(PingAckReceived, lambda event: liveness.ack(event.ping_data))

    def peer_name(self) -> str:
        try:
            peer = self.transport.get_extra_info("peername")
        except Exception:  # pragma: no cover - diagnostics only
            peer = None
        return str(peer) if peer else "(unix socket)"

    def abort(self) -> None:
        """Drop the connection at once (no flush: the peer may never read), as a reset
        (:func:`discard_unsent`)."""
        if self.transport is not None:
            discard_unsent(self.transport.get_extra_info("socket"))
            self.transport.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.liveness is not None:
            self.liveness.close()
        super().connection_lost(exc)


class SettingsAwareChannel(ClientChannel):
    """A grpclib ``Channel`` whose connections report when the peer's settings are known and,
    given a :class:`Keepalive`, check their liveness with PINGs."""

    def __init__(self, *args: Any, keepalive: Keepalive | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keepalive = keepalive

    def new_protocol(self, config: Any, h2_config: Any) -> ClientProtocol:
        return _PoolProtocol(config, h2_config, keepalive=self._keepalive)


def probe_liveness(channel: Channel) -> None:
    """One PING now on ``channel``'s connection, if it has one with liveness (module doc)."""
    liveness = getattr(channel_protocol(channel), "liveness", None)
    if liveness is not None:
        liveness.ping()


class _Slot:
    """One channel of the pool: its reservations and its current cap."""

    __slots__ = ("cap", "channel", "idle_timer", "load", "protocol")

    def __init__(self, channel: Channel, cap: int) -> None:
        self.channel = channel
        self.load = 0
        self.cap = cap
        self.protocol: Any = None  # the connection ``cap`` was computed for
        self.idle_timer: asyncio.TimerHandle | None = None


class GeneratePool:
    """Channels for Generate streams, grown and shrunk with their number (module docstring)."""

    def __init__(
        self,
        new_channel: Callable[[], Channel],
        *,
        min_channels: int = 4,
        max_streams_per_channel: int = 128,
        max_channels: int = 256,
        idle_close: float = 5.0,
    ) -> None:
        self._new_channel = new_channel
        self._min = max(1, min_channels)
        self._limit = max(1, max_streams_per_channel)
        self._max = max(self._min, max_channels)
        self._idle_close = idle_close
        self._slots: list[_Slot] = []
        self._closed = False

    @property
    def channel_count(self) -> int:
        """Channels in the pool (connected or not)."""
        return len(self._slots)

    @property
    def stream_count(self) -> int:
        """Streams holding a reservation (opening, open or closing)."""
        return sum(s.load for s in self._slots)

    def loads(self) -> list[tuple[int, int]]:
        """``(streams, cap)`` per channel, oldest first (for tests and diagnostics)."""
        return [(s.load, s.cap) for s in self._slots]

    async def acquire(self) -> tuple[Channel, Callable[[], None]]:
        """A channel for one new stream and the callback that returns its place (call it once,
        after the stream closed). Connects the channel if needed; connection errors propagate."""
        for move in range(_MAX_MOVES + 1):
            slot, forced = self._pick()
            self._reserve(slot)
            try:
                fits = await self._settle(slot)
            except BaseException:
                self._release(slot)
                raise
            if fits or forced or move == _MAX_MOVES:
                released = False

                def release(slot: _Slot = slot) -> None:
                    nonlocal released
                    if not released:
                        released = True
                        self._release(slot)

                return slot.channel, release
            self._release(slot)  # the peer allows fewer streams than we reserved: move
        raise AssertionError("unreachable")

    def channels(self) -> list[Channel]:
        """The pool's channels (connected or not)."""
        return [s.channel for s in self._slots]

    def close(self) -> list[Channel]:
        """Forget every channel and return them for closing (in-flight streams then fail)."""
        self._closed = True
        for slot in self._slots:
            if slot.idle_timer is not None:
                slot.idle_timer.cancel()
        channels = [s.channel for s in self._slots]
        self._slots = []
        return channels

    # -- internals --------------------------------------------------------------------------

    def _pick(self) -> tuple[_Slot, bool]:
        """The channel for the next stream; ``True`` when every channel is full (forced)."""
        slots = self._slots
        if len(slots) < self._min:
            return self._add(), False
        best: _Slot | None = None
        for slot in slots[: self._min]:
            if slot.load < slot.cap and (best is None or slot.load < best.load):
                best = slot
        if best is not None:
            return best, False
        for slot in slots[self._min :]:
            if slot.load < slot.cap:
                return slot, False
        if len(slots) < self._max:
            return self._add(), False
        return min(slots, key=lambda s: s.load), True

    def _add(self) -> _Slot:
        slot = _Slot(self._new_channel(), min(self._limit, ASSUMED_PEER_STREAMS))
        self._slots.append(slot)
        return slot

    def _reserve(self, slot: _Slot) -> None:
        slot.load += 1
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None

    async def _settle(self, slot: _Slot) -> bool:
        """Connect ``slot``'s channel, learn the peer's limit; False if it is now over its cap."""
        protocol = channel_protocol(slot.channel)
        if protocol is None or protocol is not slot.protocol or connection_lost(protocol):
            protocol = await connect(slot.channel)
            seen = getattr(protocol, "settings_seen", None)
            if seen is not None and not seen.is_set():
                # asyncio.timeout, never wait_for: Python 3.11's wait_for returns the result when
                # a cancel arrives as the wait completes (the SETTINGS frame and the caller's
                # cancel read in one wakeup), the cancel is lost and the stream opened anyway
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SETTINGS_WAIT):
                        await seen.wait()
            if protocol is not slot.protocol:
                slot.protocol = protocol
                peer = peer_stream_limit(protocol)
                slot.cap = max(1, min(self._limit, ASSUMED_PEER_STREAMS if peer is None else peer))
        return slot.load <= slot.cap

    def _release(self, slot: _Slot) -> None:
        slot.load -= 1
        if slot.load > 0 or self._closed or self._idle_close < 0:
            return
        if slot not in self._slots[self._min :]:
            return  # a kept channel (or already gone)
        if self._idle_close == 0:
            self._close_if_idle(slot)
        elif slot.idle_timer is None:
            loop = asyncio.get_event_loop()
            slot.idle_timer = loop.call_later(self._idle_close, self._close_if_idle, slot)

    def _close_if_idle(self, slot: _Slot) -> None:
        slot.idle_timer = None
        if self._closed or slot.load > 0 or slot not in self._slots[self._min :]:
            return
        self._slots.remove(slot)
        slot.channel.close()

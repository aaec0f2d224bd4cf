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
  :data:`SETTINGS_WAIT` seconds); until then ``max_streams_per_channel`` applies.
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

grpclib internals used (checked against grpclib 0.4.9, pinned ``<0.5``): ``Channel._protocol``,
``Channel._protocol_factory``, ``Channel.__connect__``, ``EventsProcessor.processors`` and the
h2 connection at ``protocol.connection._connection``; reading the peer's limit is guarded.
h2 internal (h2 4.x): ``H2Connection._closed_streams._size_limit`` (:data:`CLOSED_STREAMS_KEPT`).

Runs on the asyncio side (trio-asyncio loop). The counts are reservations made by
:meth:`acquire` and returned by the ``release`` callback it hands out; since grpclib closes
(or resets) a stream before the caller releases it, a channel's reservation count is never
below h2's own count of its open streams.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from grpclib.client import Channel, Handler
from grpclib.protocol import H2Protocol
from h2.events import RemoteSettingsChanged

#: How long a stream on a new connection waits for the peer's first SETTINGS frame.
SETTINGS_WAIT = 2.0

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


class _SettingsAwareProtocol(H2Protocol):
    """grpclib's client protocol, plus an event set when the peer's first SETTINGS arrived
    (or the connection was lost), and coalesced writes."""

    settings_seen: asyncio.Event

    def connection_made(self, transport: Any) -> None:
        self.settings_seen = asyncio.Event()
        if COALESCE_WRITES:
            transport = _CoalescingTransport(transport)
        super().connection_made(transport)
        closed: Any = self.connection._connection._closed_streams  # h2's SizeLimitDict
        closed._size_limit = CLOSED_STREAMS_KEPT
        processors = self.processor.processors
        inner: Callable[[Any], None] = processors[RemoteSettingsChanged]  # type: ignore[assignment]
        seen = self.settings_seen

        def on_settings(event: Any) -> None:
            inner(event)
            seen.set()

        processors[RemoteSettingsChanged] = on_settings

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        if hasattr(self, "settings_seen"):
            self.settings_seen.set()


class SettingsAwareChannel(Channel):
    """A grpclib ``Channel`` whose connections report when the peer's settings are known."""

    def _protocol_factory(self) -> H2Protocol:
        return _SettingsAwareProtocol(Handler(), self._config, self._h2_config)


def peer_stream_limit(protocol: Any) -> int | None:
    """The peer's ``SETTINGS_MAX_CONCURRENT_STREAMS`` on a grpclib connection (h2 reports
    2**32+1 while the peer has not set it), or None when it cannot be read."""
    try:
        return int(protocol.connection._connection.remote_settings.max_concurrent_streams)
    except (AttributeError, TypeError, ValueError):
        return None


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
        slot = _Slot(self._new_channel(), self._limit)
        self._slots.append(slot)
        return slot

    def _reserve(self, slot: _Slot) -> None:
        slot.load += 1
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None

    async def _settle(self, slot: _Slot) -> bool:
        """Connect ``slot``'s channel, learn the peer's limit; False if it is now over its cap."""
        protocol = slot.channel._protocol
        if protocol is None or protocol is not slot.protocol or protocol.handler.connection_lost:
            protocol = await slot.channel.__connect__()
            seen = getattr(protocol, "settings_seen", None)
            if seen is not None and not seen.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(seen.wait(), SETTINGS_WAIT)
            if protocol is not slot.protocol:
                slot.protocol = protocol
                peer = peer_stream_limit(protocol)
                slot.cap = self._limit if peer is None else max(1, min(self._limit, peer))
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

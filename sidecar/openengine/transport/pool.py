"""A pool of trio-native HTTP/2 connections to the engine (:mod:`sidecar.openengine.transport.connection`),
added and removed with the number of streams. The engine client keeps one for Generate streams
and one for everything else (control calls, Drain, KV-event subscriptions), so control traffic
never waits behind token streams.

Why a pool: an HTTP/2 peer caps the streams open on one connection
(``SETTINGS_MAX_CONCURRENT_STREAMS``; h2-based servers advertise 100), and a stream past the
cap would have to wait. Rules (:meth:`ConnectionPool.acquire`):

- ``min_connections`` connections are kept for the pool's life (opened lazily, one per stream
  until there are that many); streams spread over them, least-loaded first;
- a connection takes at most ``cap`` streams: ``min(max_streams_per_connection, the peer's
  SETTINGS_MAX_CONCURRENT_STREAMS)``; a new connection's first streams wait for the peer's first
  SETTINGS (at most :data:`SETTINGS_WAIT` s; until then the peer is assumed to allow
  :data:`ASSUMED_PEER_STREAMS`, so a loaded engine slower than that to send its SETTINGS is not
  sent more streams than h2/grpclib servers allow — it would close the connection);
- when every kept connection is full, streams go to the oldest extra connection with room; when
  none has room another is opened (at most ``max_connections``); past that a stream waits for
  room (bounded by its caller's deadline);
- an extra connection that drains to zero streams is closed ``idle_close`` seconds later (at
  once when 0, never when negative) unless a stream arrived meanwhile; a connection with a
  stream is never closed by the pool (only by :meth:`ConnectionPool.close`);
- a connection that is lost, or that the engine sends GOAWAY on, takes no new stream and is
  forgotten; the next stream opens a new one (reconnect after an engine restart).

Resources: every connection's tasks run in the nursery given to the pool (the client's);
:meth:`close` closes them all. Connecting is bounded by :data:`CONNECT_TIMEOUT`; a failure is
raised to the streams waiting for that connection as :class:`CallError` (``lost``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from sidecar.openengine.transport.connection import CallError, EngineConnection, Keepalive

#: How long a stream on a new connection waits for the peer's first SETTINGS frame.
SETTINGS_WAIT = 2.0
#: Streams a peer is taken to allow until its SETTINGS arrive: the least RFC 9113 recommends,
#: and what h2-based servers (grpclib) advertise — and enforce from their first byte: h2 answers
#: one stream more with GOAWAY, ending every stream on the connection.
ASSUMED_PEER_STREAMS = 100
#: Bound of one connection attempt.
CONNECT_TIMEOUT = 10.0
#: How many times :meth:`ConnectionPool.acquire` moves a stream off a connection whose cap
#: turned out lower than its reservations.
_MAX_MOVES = 8


@dataclass(frozen=True)
class ConnectionOptions:
    """How each connection of a pool is set up (:class:`~sidecar.openengine.transport.connection.EngineConnection`)."""

    stream_window: int = 64 * 1024
    conn_window: int = 16 * 1024 * 1024
    keepalive: Keepalive | None = None


class _Slot:
    __slots__ = ("conn", "failure", "idle_gen", "kept", "ready", "streams")

    def __init__(self, kept: bool) -> None:
        self.conn: EngineConnection | None = None
        self.failure: CallError | None = None
        self.kept = kept
        self.streams = 0
        self.ready = trio.Event()  # connected (conn set) or failed (failure set)
        self.idle_gen = 0  # bumped on each acquire: an idle timer checks it did not change

    def alive(self) -> bool:
        return self.failure is None and (self.conn is None or self.conn.usable)


class ConnectionPool:
    """See the module doc. ``connect`` opens the byte stream of a new connection."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[trio.abc.Stream]],
        nursery: trio.Nursery,
        *,
        min_connections: int = 4,
        max_streams_per_connection: int = 128,
        max_connections: int = 256,
        idle_close: float = 5.0,
        options: ConnectionOptions | None = None,
        name: str = "engine",
    ) -> None:
        self._connect = connect
        self._nursery = nursery
        self.min_connections = max(1, min_connections)
        self.max_streams = max(1, max_streams_per_connection)
        self.max_connections = max(self.min_connections, max_connections)
        self.idle_close = idle_close
        self._options = options or ConnectionOptions()
        self._name = name
        self._slots: list[_Slot] = []
        self._room = trio.Event()
        self._closed = False

    @property
    def channel_count(self) -> int:
        """Connections in the pool (connected or not)."""
        return len(self._slots)

    @property
    def stream_count(self) -> int:
        """Streams holding a place (opening, open or closing)."""
        return sum(s.streams for s in self._slots)

    def connections(self) -> list[EngineConnection]:
        return [s.conn for s in self._slots if s.conn is not None]

    def loads(self) -> list[tuple[int, int]]:
        """``(streams, cap)`` per connection, oldest first (for tests and diagnostics)."""
        return [(s.streams, self._cap(s)) for s in self._slots]

    def _cap(self, slot: _Slot) -> int:
        peer = slot.conn.peer_max_streams if slot.conn is not None else None
        return min(self.max_streams, ASSUMED_PEER_STREAMS if peer is None else max(0, peer))

    # -- acquire / release ---------------------------------------------------------------------

    async def acquire(self) -> tuple[EngineConnection, Callable[[], None]]:
        """A connection with room for one more stream, and the callable that gives its place
        back (call it once, after the stream ended). Raises :class:`CallError` (``lost``)."""
        for _ in range(_MAX_MOVES):
            slot = self._pick()
            while slot is None:
                if self._closed:
                    raise CallError("engine client is closed", lost=True)
                if self._room.is_set():
                    self._room = trio.Event()
                await self._room.wait()
                slot = self._pick()
            slot.streams += 1
            slot.idle_gen += 1
            released = False

            def release(slot: _Slot = slot) -> None:
                nonlocal released
                if not released:
                    released = True
                    self._release(slot)

            try:
                if not slot.ready.is_set():
                    await slot.ready.wait()
                conn = slot.conn
                if conn is None:
                    raise slot.failure or CallError("engine connection failed", lost=True)
                if not conn.settings_seen.is_set():
                    with trio.move_on_after(SETTINGS_WAIT):
                        await conn.settings_seen.wait()
            except BaseException:
                release()
                raise
            if conn.usable and slot.streams <= self._cap(slot):
                return conn, release
            release()  # the peer allows fewer streams than we reserved (or the connection died)
            await trio.lowlevel.checkpoint()
        raise CallError(f"no engine connection with room for a stream after {_MAX_MOVES} moves", lost=True)

    def _pick(self) -> _Slot | None:
        """The least busy kept connection with room; else a spare one with room; else a new
        connection if the pool may open one (a kept one while below ``min_connections``)."""
        if self._closed:
            raise CallError("engine client is closed", lost=True)
        slots = self._slots
        kept = 0
        best: _Slot | None = None
        spare: _Slot | None = None
        dead = False
        for s in slots:  # one pass: this runs once per call
            if not s.alive():
                dead = dead or not s.streams
                continue
            room = s.streams < self._cap(s)
            if s.kept:
                kept += 1
                if room and (best is None or s.streams < best.streams):
                    best = s
            elif room and spare is None:
                spare = s
        if dead:
            slots = self._slots = [s for s in slots if s.alive() or s.streams]
        if kept < self.min_connections and len(slots) < self.max_connections:
            return self._open(kept=True)
        if best is not None:
            return best
        if spare is not None:
            return spare
        if len(slots) < self.max_connections:
            return self._open(kept=False)
        return None

    def _open(self, *, kept: bool) -> _Slot:
        slot = _Slot(kept)
        self._slots.append(slot)
        self._nursery.start_soon(self._serve, slot)
        return slot

    def _release(self, slot: _Slot) -> None:
        slot.streams -= 1
        self._room.set()
        if slot.streams == 0 and not slot.kept and self.idle_close >= 0 and slot.conn is not None:
            if self.idle_close == 0:
                self._close_slot(slot)
            else:
                self._nursery.start_soon(self._close_when_idle, slot, slot.idle_gen)

    async def _close_when_idle(self, slot: _Slot, gen: int) -> None:
        await trio.sleep(self.idle_close)
        if slot.streams == 0 and slot.idle_gen == gen:
            self._close_slot(slot)

    def _close_slot(self, slot: _Slot) -> None:
        if slot in self._slots:
            self._slots.remove(slot)
        if slot.conn is not None:
            slot.conn.close("idle extra engine connection closed")

    # -- connections ---------------------------------------------------------------------------

    async def _serve(self, slot: _Slot) -> None:
        """Connect, then run the connection until it ends (in the pool's nursery)."""
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                stream = await self._connect()
        except (OSError, trio.TooSlowError) as err:
            slot.failure = CallError(f"engine unreachable ({type(err).__name__}: {err})", lost=True)
            slot.ready.set()
            self._forget(slot)
            return
        opts = self._options
        conn = EngineConnection(
            stream,
            stream_window=opts.stream_window,
            conn_window=opts.conn_window,
            keepalive=opts.keepalive,
            name=self._name,
        )
        slot.conn = conn
        if self._closed:
            conn.close("engine client is closed")
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(conn.run)
                slot.ready.set()
        finally:
            slot.ready.set()
            self._forget(slot)

    def _forget(self, slot: _Slot) -> None:
        if slot.streams == 0 and slot in self._slots:
            self._slots.remove(slot)
        self._room.set()

    def close(self) -> None:
        """Close every connection (their calls fail as lost); new streams are refused."""
        self._closed = True
        for slot in self._slots:
            if slot.conn is not None:
                slot.conn.close("engine client is closed")
        self._room.set()


__all__ = ["ASSUMED_PEER_STREAMS", "CONNECT_TIMEOUT", "SETTINGS_WAIT", "ConnectionOptions", "ConnectionPool"]

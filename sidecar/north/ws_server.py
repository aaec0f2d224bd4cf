"""The WebSocket plane: north protocol v1 on ``/v1/ws`` (docs/design/architecture.md, docs/PROTOCOL.md).

Per connection, one nursery holds a reader (this task), a single writer (the only task that
touches the socket's send side, fed by a queue bounded in frames and in bytes) and one task per
admitted stream or ``call``. A client that stops reading fills the queue; stream tasks then
block (back-pressure reaches the engine through HTTP/2 flow control); one still blocked after
``stall_timeout`` gets the connection closed (1008) and its streams cancelled and aborted. A
connection that closes for any reason cancels its streams; every admitted stream still gets its
upstream closed and its Abort sent by :class:`~sidecar.core.lifecycle.StreamSupervisor`.

Limits a client meets here (docs/SECURITY.md): connections in total and per peer address
(refused at accept, ``sidecar.north.peers``), streams per connection and per peer, ``call``s in
flight per connection (more are answered ``OVERLOADED`` at once, never queued), bytes queued
for the client. Whatever a client controls is quoted (``sidecar.quoting``) in log lines, and a
repeated event is logged once per connection with its count.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

import betterproto2
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from sidecar.core import metrics
from sidecar.core.errors import Rejection
from sidecar.core.handoff import KvSessionRelease
from sidecar.core.lifecycle import (
    OUTCOME_CLIENT_CANCELLED,
    OUTCOME_CLIENT_GONE,
    ClientGone,
    Outcome,
    StreamHandle,
)
from sidecar.north import codec, wire, ws_adapter
from sidecar.north.auth import bearer_matches
from sidecar.north.codec import Encoding
from sidecar.north.peers import Peer, PeerLimits, fit_to_fd_limit
from sidecar.north.ws_batch import BatchWriter
from sidecar.openengine import pb

log = logging.getLogger(__name__)

WS_PATH = "/v1/ws"
CLOSE_UNDECODABLE = 1007
WRITE_BATCH = 256  # most frames one socket write carries
COALESCE_MAX = 64 * 1024  # most bytes of events merged into one ``events`` frame
STALL_CLOSE_GRACE = 5.0  # seconds a stalled client gets to read up to its close frame
CLOSE_POLICY = 1008


class StreamHost(Protocol):
    """What the WebSocket plane needs from the core (implemented by ``sidecar.core.sidecar.Sidecar``)."""

    def admit(
        self, request: pb.GenerateRequest, metadata: dict[str, str], *, kv_session_bytes: bytes | None = None
    ) -> StreamHandle:
        """Admission before the engine: raise Rejection, or register and return the stream (its
        ``request`` is what the engine gets: with ``kv_session_bytes`` spliced in verbatim)."""
        ...

    async def run_stream(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome: ...

    async def call(
        self, method: str, request: betterproto2.Message | KvSessionRelease | None, *, owner: object = None
    ) -> object:
        """A unary ``call``: returns the result body (a Struct or pb message) or raises Rejection.
        ``owner`` (the connection) is whose share of the engine call lane it uses."""
        ...


@dataclass
class WsConfig:
    """Limits of the WebSocket plane (CLI flags of ``run``)."""

    max_message_size: int = 4 * 1024 * 1024
    max_streams_per_connection: int = 1024
    #: ``call`` messages of one connection in progress at once; more are refused (OVERLOADED).
    max_calls_per_connection: int = 64
    #: Frames queued for one client (plus the batch being written).
    out_buffer: int = 256
    #: Bytes queued for one client (characters of a text frame; plus the batch being written;
    #: a single larger frame is queued when nothing else is).
    max_pending_bytes: int = 1024 * 1024
    stall_timeout: float = 30.0
    message_queue_size: int = 16
    auth_token: str | None = None
    #: A connection that has not completed its WebSocket handshake by then is closed (a
    #: plaintext client on a TLS port, a client that connects and stays silent).
    handshake_timeout: float = 10.0
    #: Open connections (0: no limit; lowered to fit the file-descriptor limit at start).
    max_connections: int = 4096
    #: Open connections per peer address (0: no limit).
    max_connections_per_peer: int = 512
    #: Open streams per peer address, over all its connections (0: no limit).
    max_streams_per_peer: int = 0


class FinalText(str):
    """An ``end`` / ``result`` / ``protocol_error`` JSON frame of a coalescing connection:
    queued like any frame, never merged into an ``events`` frame (a subclass, so the writer
    needs no unwrapping; wsproto sends it as the text it is; msgspec does not decode it)."""

    __slots__ = ()


class FinalBytes(bytes):
    """The msgpack counterpart of :class:`FinalText`."""

    __slots__ = ()


def final(frame: str | bytes) -> str | bytes:
    """Mark ``frame`` as one that is never coalesced."""
    return FinalText(frame) if isinstance(frame, str) else FinalBytes(frame)


def coalesce_queued(frames: list[str | bytes], max_bytes: int = COALESCE_MAX) -> list[str | bytes]:
    """Merge each run of consecutive ``event`` frames of one encoding (at most ``max_bytes``
    of them) into one ``events`` frame (docs/PROTOCOL.md, "Coalesced events"). Everything
    keeps its place: a final frame (:func:`final`) or a change of encoding ends a run, and a
    run of one stays as it was."""
    out: list[str | bytes] = []
    run: list[str | bytes] = []
    run_type: type | None = None
    size = 0

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(codec.coalesce_events(run, Encoding.JSON if run_type is str else Encoding.MSGPACK))
        run.clear()

    for frame in frames:
        kind = type(frame)
        if kind is not str and kind is not bytes:  # final
            flush()
            out.append(frame)
            continue
        if run and (kind is not run_type or size + len(frame) > max_bytes):
            flush()
        if not run:
            run_type, size = kind, 0
        run.append(frame)
        size += len(frame)
    flush()
    return out


class Connection:
    """One client connection: reader, single writer, per-stream tasks (see module doc).

    ``coalesce``: the client opted in to ``events`` frames (``/v1/ws?coalesce=1``); the
    writer then merges the event frames it finds queued together.

    Task tree (:meth:`serve`)::

        connection nursery ── writer (in ``_writing``)
        └─ streams nursery ── reader (in ``_reading``), one task per stream or call

    The connection ends by cancelling what owns its parts: ``_reading`` when the client left,
    a fault closed the connection, or the sidecar is closing (:meth:`finish`); its streams are
    then ended through their handles, the streams nursery waits for them (each sends its
    Abort and queues its ``end``), and the writer sends what they queued and closes.
    ``_writing`` is cancelled when nothing more can be sent on a fault. ``closed`` (set in
    :meth:`_stop_sending` only) tells senders, also those waiting for room, to give up.
    """

    def __init__(
        self,
        ws: WebSocketConnection,
        host: StreamHost,
        config: WsConfig,
        *,
        coalesce: bool = False,
        peer: Peer | None = None,
        limits: PeerLimits | None = None,
    ) -> None:
        self.ws = ws
        self.coalesce = coalesce
        self.host = host
        self.config = config
        self.peer = peer or Peer("?", "?")
        self.limits = limits
        # unbounded as a channel: send() bounds it by frames and bytes before queueing
        self.out_send, self.out_recv = trio.open_memory_channel[str | bytes](math.inf)
        self.batch = BatchWriter(ws)
        self.streams: dict[str | int, StreamHandle] = {}
        #: Ids of the calls not answered yet (a call reusing one is refused, see ``id_in_use``).
        self.calls: set[str | int] = set()
        self.closed = False  # nothing more can be sent (_stop_sending)
        self._reading = trio.CancelScope()
        self._writing = trio.CancelScope()
        self._calls = 0  # call tasks in progress
        self._queued_frames = 0
        self._queued_bytes = 0
        self._dequeued = trio.Event()  # set (and replaced) whenever the writer takes frames
        self._waiting = 0  # senders waiting for room in the queue
        self._stalled = False
        #: events logged once per connection: cause -> occurrences (the rest summed at the end)
        self._noted: dict[str, int] = {}

    async def serve(self) -> None:
        """Serve the connection until it ends (class doc)."""
        metrics.CONNECTIONS.inc()
        try:
            async with trio.open_nursery() as connection:
                connection.start_soon(self._writer)
                async with trio.open_nursery() as streams:
                    with self._reading:
                        await self._reader(streams)
                    # However reading ended, each stream is ended through its own handle, so it
                    # still closes its upstream, sends its Abort and counts its outcome (a
                    # stream already cancelled — drain, shutdown — keeps its first reason).
                    for handle in list(self.streams.values()):
                        handle.cancel(OUTCOME_CLIENT_GONE)
                self.out_send.close()  # every stream has queued its end: the writer sends the rest
        finally:
            metrics.CONNECTIONS.dec()
            for cause, count in self._noted.items():
                if count > 1:
                    log.warning("client %s: %s %d times on this connection", self.peer.address, cause, count)

    def finish(self) -> None:
        """Graceful end (the sidecar is closing): stop reading; once the streams have ended,
        what they queued is sent and the connection closes with 1001."""
        self._reading.cancel()

    def _note(self, cause: str) -> bool:
        """Count an event of ``cause``; True the first time on this connection (log it then;
        the count is logged when the connection ends)."""
        count = self._noted.get(cause, 0) + 1
        self._noted[cause] = count
        return count == 1

    # -- sending ---------------------------------------------------------------------------

    async def _writer(self) -> None:
        # Everything queued since the last write goes out in one write (ws_batch): one
        # syscall per batch instead of per token event; each frame stays its own message.
        receive_nowait = self.out_recv.receive_nowait
        with self._writing:
            try:
                async for frame in self.out_recv:
                    batch = [frame]
                    while len(batch) < WRITE_BATCH:
                        try:
                            batch.append(receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    # room for more while this batch is written (it is held until then: at most
                    # twice the queue's bounds in all)
                    self._queued_frames -= len(batch)
                    self._queued_bytes -= sum(map(len, batch))
                    self._wake_senders()
                    await self.batch.send(coalesce_queued(batch) if self.coalesce else batch)
            except (ConnectionClosed, trio.ClosedResourceError):
                self._lost()
                return
            # The send side was closed after the last stream ended: a graceful end.
            await self.ws.aclose(1001, "sidecar shutting down")

    def _stop_sending(self) -> None:
        """Nothing more can be sent: senders (also those waiting for room) get ClientGone."""
        self.closed = True
        self.out_recv.close()
        self._wake_senders()

    def _lost(self) -> None:
        """The peer is gone: stop sending and reading; the streams then end."""
        self._stop_sending()
        self._reading.cancel()

    def _wake_senders(self) -> None:
        if self._waiting:
            self._dequeued.set()
            self._dequeued = trio.Event()

    def _has_room(self, size: int) -> bool:
        queued = self._queued_bytes
        return self._queued_frames < self.config.out_buffer and (
            not queued or queued + size <= self.config.max_pending_bytes
        )

    async def send(self, frame: str | bytes) -> None:
        """Queue a frame; raise ClientGone if the client left or stayed stuck past stall_timeout."""
        if self.closed:
            raise ClientGone
        size = len(frame)
        if not self._has_room(size):
            self._waiting += 1
            try:
                with trio.move_on_after(self.config.stall_timeout):
                    while not self._has_room(size) and not self.closed:
                        await self._dequeued.wait()
            finally:
                self._waiting -= 1
            if self.closed:
                raise ClientGone
            if not self._has_room(size):
                await self._stalled_client()
        try:
            self.out_send.send_nowait(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ClientGone from None
        self._queued_frames += 1
        self._queued_bytes += size

    async def _stalled_client(self) -> NoReturn:
        """A sender waited ``stall_timeout`` for room: close the connection (once, one log
        line however many senders were waiting), raise ClientGone."""
        if not self._stalled:
            self._stalled = True
            log.warning(
                "client %s stalled for %.0fs: disconnecting (%d frames, %d bytes queued; %d senders waiting)",
                self.peer.address,
                self.config.stall_timeout,
                self._queued_frames,
                self._queued_bytes,
                self._waiting + 1,
            )
            # The write in progress stops at the end of its current frame (ws_batch), so the
            # close frame queues only behind the kernel's buffers: a client that wakes up
            # within the grace reads what was on its way, then the close frame.
            self.batch.interrupt()
            await self._close(CLOSE_POLICY, "client stalled", grace=STALL_CLOSE_GRACE)
        raise ClientGone

    async def send_final(self, frame: str | bytes) -> None:
        """Send an ``end``/``result``/``protocol_error``: never raises (dropped when the
        client is gone), never coalesced."""
        try:
            await self.send(final(frame) if self.coalesce else frame)
        except ClientGone:
            pass

    async def _close(self, code: int, reason: str, grace: float = 1.0) -> None:
        """Close with ``code`` on a fault (shielded, at most ``grace`` seconds; then the TCP
        connection is dropped and the peer sees 1006); the connection then ends."""
        self._stop_sending()
        with trio.move_on_after(grace) as scope:
            scope.shield = True
            await self.ws.aclose(code, reason)
        self._reading.cancel()
        self._writing.cancel()

    # -- receiving -------------------------------------------------------------------------

    async def _reader(self, stream_nursery: trio.Nursery) -> None:
        while True:
            try:
                frame = await self.ws.get_message()
            except ConnectionClosed:
                self._lost()  # the client left: its streams end, nothing more is sent
                return
            try:
                cmd = codec.decode_frame(frame)
            except codec.FrameDecodeError as err:
                metrics.PROTOCOL_ERRORS.inc()
                await self._close(CLOSE_UNDECODABLE, str(err)[:120])
                return
            except codec.ProtocolError as err:
                metrics.PROTOCOL_ERRORS.inc()
                enc = Encoding.JSON if isinstance(frame, str) else Encoding.MSGPACK
                reply: wire.End | wire.Result | wire.ProtocolErrorMessage = codec.error_reply(err)
                if err.stream is not None and err.stream in self.streams:
                    reply = codec.id_in_use(stream=err.stream)  # its end belongs to the open stream
                elif err.call is not None and err.call in self.calls:
                    reply = codec.id_in_use(call=err.call)
                await self.send_final(codec.encode(reply, enc))
                continue
            except Exception:  # a decoder bug: this frame is refused, nothing else is affected
                metrics.PROTOCOL_ERRORS.inc()
                if self._note("frames the decoder failed on"):
                    log.exception("client %s: the decoder failed on a frame", self.peer.address)
                enc = Encoding.JSON if isinstance(frame, str) else Encoding.MSGPACK
                reply = codec.error_reply(
                    codec.ProtocolError("invalid message: the sidecar could not decode it")
                )
                await self.send_final(codec.encode(reply, enc))
                continue
            if isinstance(cmd, codec.GenerateCommand):
                if cmd.stream in self.streams:
                    await self._refuse_reused_id(codec.id_in_use(stream=cmd.stream), cmd.encoding)
                else:
                    await self._generate(cmd, stream_nursery)
            elif isinstance(cmd, codec.CancelCommand):
                handle = self.streams.get(cmd.stream)
                if handle is not None:
                    handle.cancel(OUTCOME_CLIENT_CANCELLED)
                # cancel of an unknown or finished stream: nothing to do (idempotent, documented)
            elif cmd.call in self.calls:
                await self._refuse_reused_id(codec.id_in_use(call=cmd.call), cmd.encoding)
            elif self._calls >= self.config.max_calls_per_connection:
                metrics.child(metrics.LIMIT_REFUSALS, "calls_per_connection").inc()
                limit = self.config.max_calls_per_connection
                error = codec.error_body(
                    pb.ErrorCode.OVERLOADED, f"at most {limit} calls in progress per connection", True
                )
                await self.send_final(codec.encode(codec.result_error(cmd.call, error), cmd.encoding))
            else:
                self.calls.add(cmd.call)
                self._calls += 1
                stream_nursery.start_soon(self._call, cmd)

    async def _refuse_reused_id(self, reply: wire.ProtocolErrorMessage, encoding: Encoding) -> None:
        """A ``generate`` / ``call`` reusing an open id: ``protocol_error`` naming it (no ``end`` /
        ``result``, which would look like the open one's)."""
        metrics.PROTOCOL_ERRORS.inc()
        await self.send_final(codec.encode(reply, encoding))

    async def _reject(self, cmd: codec.GenerateCommand, rejection: Rejection) -> None:
        outcome = Outcome.from_rejection(rejection)
        metrics.STREAMS.labels(outcome.kind, rejection.code_name).inc()
        await self.send_final(self._end_frame(cmd.stream, outcome, cmd.encoding))

    async def _generate(self, cmd: codec.GenerateCommand, nursery: trio.Nursery) -> None:
        if len(self.streams) >= self.config.max_streams_per_connection:
            limit = self.config.max_streams_per_connection
            await self._reject(
                cmd, Rejection(pb.ErrorCode.OVERLOADED, f"at most {limit} open streams per connection", True)
            )
            return
        limits = self.limits
        if limits is not None and not limits.open_stream(self.peer.key):
            await self._reject(
                cmd,
                Rejection(
                    pb.ErrorCode.OVERLOADED,
                    f"at most {limits.max_streams_per_peer} open streams per client address",
                    True,
                ),
            )
            return
        try:
            handle = self.host.admit(cmd.request, cmd.metadata, kv_session_bytes=cmd.kv_session_bytes)
        except Rejection as rejection:
            if limits is not None:
                limits.close_stream(self.peer.key)
            await self._reject(cmd, rejection)
            return
        self.streams[cmd.stream] = handle
        nursery.start_soon(self._run_stream, cmd.stream, cmd.encoding, handle)

    async def _run_stream(self, stream_id: str | int, encoding: Encoding, handle: StreamHandle) -> None:
        encoder = codec.EventEncoder(stream_id, encoding)
        send = self.send

        async def emit(ev: pb.GenerateResponse) -> None:
            # prefillReady (terminal: the last event): relay the engine's KvSessionRef bytes exactly as received
            await send(encoder.encode(ev, kv_session_bytes=handle.kv_session_bytes))

        handle.log_fields = {"stream": stream_id}  # on the stream's log records
        try:
            outcome = await self.host.run_stream(handle, emit)
        finally:
            del self.streams[stream_id]
            if self.limits is not None:
                self.limits.close_stream(self.peer.key)
        await self.send_final(self._end_frame(stream_id, outcome, encoding))

    @staticmethod
    def _end_frame(stream_id: str | int, outcome: Outcome, encoding: Encoding) -> str | bytes:
        error = None
        if outcome.code is not None:
            error = codec.error_body(outcome.code, outcome.message, outcome.retryable)
        return codec.encode(codec.end_message(stream_id, outcome.kind, error), encoding)

    async def _call(self, cmd: codec.CallCommand) -> None:
        try:
            try:
                body = await self.host.call(cmd.method, cmd.request, owner=self)
                reply = codec.result_ok(cmd.call, body)
            except Rejection as rejection:
                reply = codec.result_error(
                    cmd.call, codec.error_body(rejection.code, rejection.message, rejection.retryable)
                )
            finally:
                self.calls.discard(cmd.call)  # answered: the id may be reused (before the client sees it)
            await self.send_final(codec.encode(reply, cmd.encoding))
        finally:
            self._calls -= 1  # in progress until its answer is queued (a stuck client's pile up)


class NorthPlane:
    """The WebSocket listener and its open connections.

    ``serve`` accepts connections until :meth:`close` (or until cancelled); :meth:`close` stops
    accepting and asks every connection to finish: stop reading, let its streams end, send its
    last frames (the ``end`` frames) and close with 1001. ``serve`` returns once the last
    connection has ended (:meth:`wait_closed`); the caller bounds that wait and cancels
    ``serve`` — the nursery that owns every connection — at its deadline.
    """

    def __init__(
        self, host: StreamHost, config: WsConfig | None = None, *, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self.config = config or WsConfig()
        self.ssl_context = ssl_context
        self.connections: set[Connection] = set()
        self.limits: PeerLimits | None = None
        self._accepting = trio.CancelScope()
        self._closed = trio.Event()

    async def serve(
        self,
        listen_host: str,
        listen_port: int,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until closed and every connection ended, or cancelled; ``task_status.started(port)``."""
        cfg = self.config
        self.limits = limits = PeerLimits(
            fit_to_fd_limit(cfg.max_connections), cfg.max_connections_per_peer, cfg.max_streams_per_peer
        )

        async def handler(request: WebSocketRequest, peer: Peer) -> None:
            if request.path.split("?", 1)[0] != WS_PATH:
                await request.reject(404, body=b"not found: the north protocol lives at /v1/ws\n")
                return
            if cfg.auth_token is not None and not _authorized(request, cfg.auth_token):
                await request.reject(401)
                return
            ws = await request.accept()
            conn = Connection(ws, self.host, cfg, coalesce=_opted_in(request.path), peer=peer, limits=limits)
            self.connections.add(conn)
            if self._accepting.cancel_called:
                conn.finish()  # accepted as the plane was closing
            try:
                await conn.serve()
            finally:
                self.connections.discard(conn)

        try:
            async with trio.open_nursery() as connections:
                with self._accepting:
                    await ws_adapter.serve(
                        handler,
                        listen_host,
                        listen_port,
                        self.ssl_context,
                        max_message_size=cfg.max_message_size,
                        message_queue_size=cfg.message_queue_size,
                        handshake_timeout=cfg.handshake_timeout,
                        limits=limits,
                        handler_nursery=connections,
                        task_status=task_status,
                    )
        finally:
            self._closed.set()

    def close(self) -> None:
        """Stop accepting; every connection finishes (class doc)."""
        self._accepting.cancel()
        for conn in list(self.connections):
            conn.finish()

    async def wait_closed(self) -> None:
        """Return once ``serve`` has returned (every connection ended)."""
        await self._closed.wait()


def _opted_in(path: str) -> bool:
    """``coalesce=1`` in the query string of the handshake (docs/PROTOCOL.md)."""
    from urllib.parse import parse_qs

    _, _, query = path.partition("?")
    return parse_qs(query).get("coalesce", [""])[-1] == "1"


def _authorized(request: WebSocketRequest, token: str) -> bool:
    for name, value in request.headers:
        if name.lower() == b"authorization":
            return bearer_matches(value, token)
    return False

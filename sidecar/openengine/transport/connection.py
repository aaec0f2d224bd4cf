"""One trio-native HTTP/2 connection to the engine, carrying gRPC calls (unary and
server-streaming: every call the sidecar makes).

A connection is a plain trio object: one reader task and one writer task; per call only a small
:class:`GrpcCall` that the reader fills and the caller drains (no task, no event-loop hop). HTTP/2
framing, flow-control accounting and the stream states are
:mod:`sidecar.openengine.transport.http2`'s (HPACK decoding the ``hpack`` library's); the gRPC layer
above the frames is :mod:`sidecar.openengine.transport.grpc_framing`'s; this module moves bytes and maps
events to calls.

:class:`EngineConnection` (``await nursery.start(conn.run)``):

- writes: the protocol object buffers frames; the writer task sends them after the current
  scheduler pass, so frames queued together (many calls' frames, WINDOW_UPDATEs, resets)
  leave in one ``send``. A new call's HEADERS + DATA, and a reset, go out at once when the
  writer is idle (its turn not already due, no write under way): a request then waits for the
  engine alone, and a cancelled call's RST_STREAM leaves before the lifecycle's Abort; what is
  queued after it in the same pass is coalesced by the writer as before;
- flow control: a call's bytes are acknowledged to the protocol object (which queues a
  WINDOW_UPDATE once half a window is due) when its caller has taken every complete message
  received (at once while the caller keeps up; the bytes of a message still incomplete too, so
  a message larger than the window cannot stall): at most ``stream_window`` bytes wait for a
  caller that stopped reading, and only its own stream is held back — the engine feels a slow
  client as backpressure on that request;
- sizes: each message's gRPC length prefix is checked against the call's ``max_message``
  before the message is buffered (over it: the stream is reset and the call fails
  ``too_large``);
- the peer's SETTINGS (``peer_max_streams``) are applied; a GOAWAY fails the calls the
  peer did not process (``lost``, retryable) and the connection takes no new call;
- errors are scoped as RFC 9113 says: a malformed response or a stream-level violation resets
  that stream alone and fails its call; a connection-level violation closes the connection
  (GOAWAY), failing its calls as ``lost`` — after the events that came before it.

**Liveness** (with a :class:`Keepalive`). A hung engine process or a network path that silently
drops packets leaves a TCP connection open that nothing notices: the kernel keeps accepting our
bytes. So a connection sends a PING when the engine *owes* it something (a call is open, or one
started since the engine last sent a frame) and the engine has sent no DATA or HEADERS for
``interval`` seconds; a PING not acknowledged within ``timeout`` closes the connection (its
calls fail as ``lost``; the pool opens a new one for the next call). At most
:data:`PINGS_PER_SILENCE` acknowledged PINGs are sent per stretch without DATA/HEADERS: gRPC's
C-core and Go servers by default answer a third PING without data in between with GOAWAY
``too_many_pings``, which would kill a long prefill; after two acknowledged PINGs the
connection counts as alive until the engine sends data again. :meth:`EngineConnection.ping`
sends one more whatever the count (the engine watch does when ``Health`` times out). A
connection given up for dead is *reset* (:func:`discard_unsent`): a plain close would leave the
kernel retransmitting what we had queued — a Generate's HEADERS, an RST_STREAM — for minutes,
so a request could reach the engine long after its Abort was answered NOT_FOUND.

Errors: a call fails with :class:`CallError` (``status`` for a gRPC status, ``lost`` for a
reset stream or a lost connection). Cancellation: :meth:`GrpcCall.cancel` (synchronous, idempotent)
writes RST_STREAM(CANCEL) at once when the writer is idle, else queues it for the writer task;
either way no checkpoint of the caller's, whatever the caller's scope.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

import trio

from sidecar.openengine.transport import http2 as h2_client
from sidecar.openengine.transport.grpc_framing import (
    INTERNAL,
    INVALID_ARGUMENT,
    MAX_HEADER_LIST,
    MAX_MESSAGE,
    UNKNOWN,
    CallError,
    Headers,
    MessageReader,
    TooLarge,
    grpc_status,
    header_map,
    response_problem,
)
from sidecar.socket_io import receive_some, write_now

log = logging.getLogger(__name__)

_CANCEL = 8  # HTTP/2 error code CANCEL
_READ_SIZE = 256 * 1024
_LAST_STREAM_ID = 2**31 - 2  # a client's last odd stream id is 2^31 - 1
#: How long a connection whose reader is done waits for its writer to send what is queued (a
#: GOAWAY after a violation, resets) before it closes.
_LAST_WRITE = 1.0

#: Acknowledged PINGs per stretch without DATA/HEADERS from the engine (module doc: gRPC
#: servers answer the third with GOAWAY ``too_many_pings``).
PINGS_PER_SILENCE = 2


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 PING liveness of engine connections (module doc). ``interval`` <= 0: off.
    ``on_dead`` is called for each connection closed by it."""

    interval: float = 10.0
    timeout: float = 10.0
    on_dead: Callable[[], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0


def discard_unsent(sock: socket.socket | None) -> None:
    """Make closing ``sock`` a reset (``SO_LINGER`` 0): what is still queued for the peer is
    dropped instead of retransmitted after the close (a no-op for a Unix socket)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class GrpcCall:
    """One gRPC call on a connection: :meth:`receive` its messages, then its end."""

    __slots__ = (
        "_body",
        "_conn",
        "_failure",
        "_messages",
        "_reader",
        "_unacked",
        "_waiter",
        "closed",
        "id",
        "status",
    )

    def __init__(self, conn: EngineConnection, stream_id: int, body: bytes, max_message: int) -> None:
        self._conn = conn
        self.id = stream_id
        self._body = memoryview(body)  # request bytes not yet sent (flow control)
        self._messages: collections.deque[bytes] = collections.deque()
        self._unacked = 0  # received bytes not yet acknowledged (messages wait for the caller)
        self._reader = MessageReader(max_message)
        self._waiter: trio.lowlevel.Task | None = None
        self._failure: CallError | None = None
        #: (status, message) once the engine ended the call with its trailers.
        self.status: tuple[int, str] | None = None
        #: Nothing more will be received or sent on this stream.
        self.closed = False

    async def receive(self) -> bytes | None:
        """The next message; ``None`` once the call ended with status OK. Raises
        :class:`CallError` (after the messages that came before it). One schedule point per
        call, as trio's own channels: the wait when there was nothing yet, else a yield."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            if self._messages:
                msg = self._messages.popleft()
                if self._unacked and not self._messages:  # caught up: the engine may send on
                    n, self._unacked = self._unacked, 0
                    self._conn._ack(self, n)
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return msg
            if self._failure is not None:
                raise self._failure
            if self.status is not None:
                if self.status[0]:
                    raise CallError(self.status[1], self.status[0])
                return None
            self._waiter = trio.lowlevel.current_task()

            def abort(_: Callable[[], object]) -> trio.lowlevel.Abort:
                self._waiter = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
            waited = True

    @property
    def ready(self) -> bool:
        """:meth:`receive` would return (or raise) without waiting for the engine."""
        return bool(self._messages) or self._failure is not None or self.status is not None

    def cancel(self) -> None:
        """Stop the call: RST_STREAM(CANCEL) unless it already ended (idempotent, synchronous)."""
        if not self.closed:
            self._conn._reset(self, _CANCEL)

    def _wake(self) -> None:
        task, self._waiter = self._waiter, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def _fail(self, failure: CallError) -> None:
        if self._failure is None and self.status is None:
            self._failure = failure
        self._wake()


#: ``peer_max_streams`` when the engine's SETTINGS set no limit.
UNLIMITED_STREAMS = 2**31


class EngineConnection:
    """One HTTP/2 connection (module doc). Create, then ``await nursery.start(conn.run)``."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        stream_window: int = 64 * 1024,
        conn_window: int = 16 * 1024 * 1024,
        keepalive: Keepalive | None = None,
        name: str = "engine",
    ) -> None:
        self._stream = stream
        self.name = name
        self.stream_window = stream_window
        self.keepalive = keepalive
        self.calls: dict[int, GrpcCall] = {}
        self._h2 = h2_client.ClientConnection(stream_window=stream_window, max_header_list=MAX_HEADER_LIST)
        self._conn_window = conn_window
        self._writer: trio.lowlevel.Task | None = None  # the writer task while it waits
        self._out: list[bytes] = []  # bytes taken from the protocol object, not yet sent: sent first
        self._want_write = False  # the writer is asked to send (its turn comes after this pass)
        self._writing = False  # the writer waits for the socket in the middle of a send
        self._closing = False  # the reader is done: the writer returns once nothing is queued
        self._written = trio.Event()  # the writer returned
        self._sending: collections.deque[GrpcCall] = collections.deque()  # calls with body left
        self.settings_seen = trio.Event()
        self.peer_max_streams: int | None = None
        self.goaway = False
        self.failure: CallError | None = None
        self.closed = trio.Event()
        self._cancel = trio.CancelScope()
        # liveness
        self._last_data = 0.0
        self._last_ping = 0.0
        self._pings = 0  # acknowledged PINGs since the last DATA/HEADERS
        self._started = 0  # calls started, and as many at the last DATA/HEADERS (``_owed``)
        self._mark = 0
        self._outstanding: bytes | None = None
        self._ping_deadline = math.inf
        self._kick = trio.Event()
        self._dead = False  # closed by liveness: reset, not closed (:func:`discard_unsent`)

    @property
    def usable(self) -> bool:
        """New calls may start here (open, no GOAWAY, a stream id left)."""
        return (
            self.failure is None
            and not self.goaway
            and (self._h2.highest_outbound_stream_id or 0) < _LAST_STREAM_ID
        )

    # -- the service ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until it closes (peer EOF, error, :meth:`close`); every call
        still open then fails (``lost``). ``task_status.started()`` once our preface is queued."""
        self._h2.initiate_connection()
        if self._conn_window > 65_535:
            self._h2.increment_flow_control_window(self._conn_window - 65_535)
        self._last_data = trio.current_time()
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop)
                    if self.keepalive is not None and self.keepalive.enabled:
                        nursery.start_soon(self._liveness_loop)
                    task_status.started()
                    await self._read_loop()
                    # the writer sends what is queued (a GOAWAY after a violation, resets) first:
                    # cancelled in the middle of a send, those bytes would be lost
                    self._closing = True
                    self._flush_soon()
                    with trio.move_on_after(_LAST_WRITE):
                        await self._written.wait()
                    nursery.cancel_scope.cancel()
        except Exception as err:  # a defect here closes this connection only, never the client
            log.exception("engine connection %s failed; closing it", self.name)
            self._lost(CallError(f"engine connection failed ({type(err).__name__}: {err})", lost=True))
        finally:
            failure = self.failure or CallError("engine connection closed", lost=True)
            self.failure = failure
            for call in list(self.calls.values()):
                call.closed = True
                call._fail(failure)
            self.calls.clear()
            self._sending.clear()
            self.settings_seen.set()
            self.closed.set()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                if self._dead:  # reset: nothing queued on a dead path may arrive later
                    discard_unsent(getattr(self._stream, "socket", None))
                else:
                    self._h2.close_connection()  # GOAWAY (already queued after a violation)
                    try:
                        await self._stream.send_all(b"".join(self._out) + self._h2.data_to_send())
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                await self._stream.aclose()

    def close(self, reason: str = "engine connection closed") -> None:
        """Close now (synchronous): open calls fail (``lost``)."""
        self._lost(CallError(reason, lost=True))
        self._cancel.cancel()

    def _lost(self, failure: CallError) -> None:
        if self.failure is None:
            self.failure = failure

    # -- writing -------------------------------------------------------------------------------

    def _flush_soon(self) -> None:
        if not self._want_write:
            self._want_write = True
            task, self._writer = self._writer, None
            if task is not None:
                trio.lowlevel.reschedule(task)

    def _write_through(self) -> None:
        """Send what is queued now unless the writer's turn is already due or a write is under
        way, then ask for the writer's turn: what is queued after this in the same scheduler
        pass still leaves together in its one send. A new call or a reset thus reaches the
        engine without waiting for the writer twice (its wake-up, its checkpoint), and a reset
        leaves before the Abort that follows it on another connection."""
        if not (self._want_write or self._writing or self._closing):
            self._out.append(self._h2.data_to_send())
            data = b"".join(self._out)
            self._out.clear()
            sent = write_now(self._stream, data)
            if sent < len(data):
                self._out.append(data[sent:])
        self._flush_soon()

    async def _write_loop(self) -> None:
        try:
            await self._write_until_closing()
        finally:
            self._written.set()

    async def _write_until_closing(self) -> None:
        while True:
            if not self._want_write:
                if self._closing:
                    return
                self._writer = trio.lowlevel.current_task()

                def abort(_: Callable[[], object]) -> trio.lowlevel.Abort:
                    self._writer = None
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)
            # let the tasks woken with us queue their frames too: one send for all of them
            await trio.lowlevel.cancel_shielded_checkpoint()
            self._want_write = False
            data = self._h2.data_to_send()
            if self._out:
                self._out.append(data)
                data = b"".join(self._out)
                self._out.clear()
            if data:
                try:
                    sent = write_now(self._stream, data)
                    if sent < len(data):
                        self._writing = True
                        try:
                            await self._stream.send_all(memoryview(data)[sent:])
                        finally:
                            self._writing = False
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as err:
                    self.close(f"engine connection lost while sending ({type(err).__name__}: {err})")
                    return

    # -- calls ---------------------------------------------------------------------------------

    def start_call(self, headers: Headers, message: bytes, *, max_message: int = MAX_MESSAGE) -> GrpcCall:
        """Open a stream with ``headers`` and send ``message`` (one gRPC message, then
        END_STREAM) as far as flow control allows now (the rest follows WINDOW_UPDATEs).
        Each message received is bounded by ``max_message``."""
        if not self.usable:
            raise self.failure or CallError("engine connection is going away", lost=True)
        conn = self._h2
        try:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, headers)
        except h2_client.HeadersTooLarge as err:  # nothing was sent: the request's own fault
            raise CallError(str(err), INVALID_ARGUMENT) from None
        except h2_client.H2Error as err:
            raise CallError(
                f"engine connection refused a new stream ({type(err).__name__}: {err})", lost=True
            ) from None
        call = GrpcCall(self, sid, len(message).to_bytes(5, "big") + message, max_message)
        self.calls[sid] = call
        self._started += 1
        self._send_body(call)
        if call._body:
            self._sending.append(call)
        self._write_through()
        return call

    def _send_body(self, call: GrpcCall) -> None:
        conn = self._h2
        body = call._body
        while body:
            n = min(len(body), conn.local_flow_control_window(call.id), conn.max_outbound_frame_size)
            if n <= 0:
                break
            chunk, body = body[:n], body[n:]
            conn.send_data(call.id, chunk.tobytes(), end_stream=not body)
        call._body = body

    def _resume_sends(self) -> None:
        for _ in range(len(self._sending)):
            call = self._sending.popleft()
            if call.closed:
                continue
            try:
                self._send_body(call)
            except h2_client.H2Error:
                continue  # the stream closed meanwhile
            if call._body:
                self._sending.append(call)

    def _ack(self, call: GrpcCall, n: int, *, flush: bool = True) -> None:
        """``n`` received bytes of ``call`` are consumed: give them back to the windows (a
        WINDOW_UPDATE is queued once half a window is due; the writer is woken only then).
        ``flush=False``: the caller sends it (the reader after each read, a reset at once)."""
        self._h2.acknowledge_received_data(n, call.id)
        if flush:
            out = self._h2.data_to_send()
            if out:
                self._out.append(out)
                self._flush_soon()

    def _reset(self, call: GrpcCall, code: int) -> None:
        """Reset ``call``'s stream (nothing more is received on it; the messages already
        queued stay for the caller, then its failure)."""
        if call.closed:
            return
        self._end(call, flush=False)
        if self.failure is None:
            self._h2.reset_stream(call.id, code)
            self._write_through()
        self._close_if_done()

    def _end(self, call: GrpcCall, *, flush: bool = True) -> None:
        call.closed = True
        self.calls.pop(call.id, None)
        if call._unacked:  # bytes the caller will not take: back to the connection window
            n, call._unacked = call._unacked, 0
            self._ack(call, n, flush=flush)

    def _close_if_done(self) -> None:
        """After a GOAWAY, the connection closes once its last call ended."""
        if self.goaway and not self.calls:
            self.close("the engine sent GOAWAY")

    # -- reading -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        stream = self._stream
        conn = self._h2
        try:
            while True:
                data = await receive_some(stream, _READ_SIZE)
                if not data:
                    self._lost(CallError("the engine closed the connection", lost=True))
                    return
                try:
                    events = conn.receive_data(data)
                except h2_client.ProtocolViolation as err:
                    for event in err.events:  # what came before the violation still counts
                        self._event(event)
                    log.warning("engine connection %s: %s; closing it", self.name, err)
                    self._lost(CallError(f"the engine broke HTTP/2 ({type(err).__name__}: {err})", lost=True))
                    return
                for event in events:
                    self._event(event)
                out = conn.data_to_send()  # e.g. SETTINGS and PING acknowledgements, resets
                if out:
                    self._out.append(out)
                    self._flush_soon()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as err:
            self._lost(CallError(f"engine connection lost ({type(err).__name__}: {err})", lost=True))

    def _event(self, event: h2_client.Event) -> None:
        if isinstance(event, h2_client.DataReceived):
            self._on_data(event)
        elif isinstance(event, h2_client.ResponseReceived):
            self._on_response(event)
        elif isinstance(event, h2_client.TrailersReceived):
            self._on_trailers(event)
        elif isinstance(event, h2_client.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None:  # END_STREAM without trailers
                self._end(call)
                call._fail(CallError("Missing grpc-status header", UNKNOWN))
        elif isinstance(event, h2_client.StreamReset):
            call = self.calls.get(event.stream_id)
            if call is not None:
                self._end(call)
                code = event.error_code
                call._fail(CallError(f"the engine reset the stream (HTTP/2 error {code!s})", lost=True))
        elif isinstance(event, h2_client.StreamBroken):
            call = self.calls.get(event.stream_id)
            if call is not None:  # the protocol object reset the stream already
                log.warning("engine connection %s: %s; stream reset", self.name, event.reason)
                self._end(call)
                call._fail(CallError(f"the engine broke HTTP/2 on this stream ({event.reason})"))
        elif isinstance(event, h2_client.WindowUpdated | h2_client.RemoteSettingsChanged):
            if isinstance(event, h2_client.RemoteSettingsChanged):
                peer = event.max_concurrent_streams
                self.peer_max_streams = UNLIMITED_STREAMS if peer is None else peer
                self.settings_seen.set()
            if self._sending:
                self._resume_sends()
        elif isinstance(event, h2_client.PingAckReceived):
            if event.ping_data == self._outstanding:
                self._outstanding = None
                self._ping_deadline = math.inf
                self._pings += 1
        elif isinstance(event, h2_client.ConnectionTerminated):
            self._on_goaway(event)
        elif isinstance(event, h2_client.InformationalResponseReceived):
            self._seen()

    def _seen(self) -> None:
        """The engine sent DATA or HEADERS: alive; the PING count starts again."""
        self._last_data = trio.current_time()
        self._pings = 0
        self._mark = self._started

    def _on_data(self, event: h2_client.DataReceived) -> None:
        self._seen()
        size = event.flow_controlled_length
        call = self.calls.get(event.stream_id)
        if call is None:
            self._h2.acknowledge_received_data(size, event.stream_id)
            return
        try:
            messages = call._reader.feed(event.data)
        except TooLarge as err:
            self._reset(call, _CANCEL)
            self._h2.acknowledge_received_data(size, call.id)
            call._fail(CallError(str(err), too_large=(err.size, err.limit)))
            return
        except CallError as err:
            self._reset(call, _CANCEL)
            self._h2.acknowledge_received_data(size, call.id)
            call._fail(err)
            return
        call._unacked += size
        if messages:
            call._messages.extend(messages)
            call._wake()
        elif not call._messages:  # part of a message, the caller waiting: let the rest come
            n, call._unacked = call._unacked, 0
            self._ack(call, n, flush=False)

    def _on_response(self, event: h2_client.ResponseReceived) -> None:
        self._seen()
        call = self.calls.get(event.stream_id)
        if call is None:
            return
        headers = header_map(event.headers)
        problem = response_problem(headers)
        if problem is not None:
            if not event.stream_ended:
                self._reset(call, _CANCEL)
            else:
                self._end(call)
            call._fail(CallError(problem[1], problem[0]))
        elif event.stream_ended:  # trailers-only
            call.status = grpc_status(headers)
            self._end(call)
            call._wake()

    def _on_trailers(self, event: h2_client.TrailersReceived) -> None:
        self._seen()
        call = self.calls.get(event.stream_id)
        if call is None:
            return
        if call._reader.pending:
            call._fail(CallError("the engine ended the stream inside a gRPC message", INTERNAL))
        else:
            call.status = grpc_status(header_map(event.headers))
        self._end(call)
        call._wake()

    def _on_goaway(self, event: h2_client.ConnectionTerminated) -> None:
        self.goaway = True
        last = event.last_stream_id
        code = event.error_code
        for sid in [s for s in self.calls if s > last]:
            call = self.calls.pop(sid)
            call.closed = True
            call._fail(CallError(f"the engine is going away (GOAWAY, {code!s}): not processed", lost=True))
        self._close_if_done()

    # -- liveness ------------------------------------------------------------------------------

    def _owed(self) -> bool:
        """The engine owes us frames: a call is open, or one started since its last frame."""
        return bool(self.calls) or self._started > self._mark

    def ping(self) -> None:
        """Send one PING now (unless one is outstanding); unanswered within the keepalive
        timeout, the connection is closed."""
        if self.failure is not None or self._outstanding is not None or self.keepalive is None:
            return
        payload = os.urandom(8)
        self._h2.ping(payload)
        self._outstanding = payload
        self._last_ping = trio.current_time()
        self._ping_deadline = self._last_ping + self.keepalive.timeout
        self._flush_soon()
        self._kick.set()

    async def _liveness_loop(self) -> None:
        assert self.keepalive is not None
        interval, on_dead = self.keepalive.interval, self.keepalive.on_dead
        while True:
            now = trio.current_time()
            wake = min(max(self._last_data, self._last_ping) + interval, self._ping_deadline)
            if now < wake:
                self._kick = trio.Event()
                with trio.move_on_at(wake):
                    await self._kick.wait()
                continue
            if now >= self._ping_deadline:
                log.warning(
                    "engine connection %s: no PING answer in %gs; closing it (a hung engine or a dead path)",
                    self.name,
                    self.keepalive.timeout,
                )
                if on_dead is not None:
                    on_dead()
                self._dead = True
                self.close("the engine did not answer a PING in time")
                return
            if self._outstanding is None and self._pings < PINGS_PER_SILENCE and self._owed():
                self.ping()
            else:
                self._last_ping = now  # quiet again for an interval


__all__ = [
    "MAX_MESSAGE",
    "PINGS_PER_SILENCE",
    "CallError",
    "EngineConnection",
    "GrpcCall",
    "Keepalive",
    "discard_unsent",
]

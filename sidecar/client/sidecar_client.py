"""Python client of the north protocol v1 (trio, trio-websocket).

    async with open_sidecar("ws://127.0.0.1:8600") as sc:
        async with sc.generate({"model": "m", "prompt": "Hi"}) as stream:
            async for event in stream:          # wire.Event: .response (typed proto3 JSON view)
                print(event.response.text, end="")
        stream.end                              # wire.End: .outcome, .error
        card = await sc.call("describe")

One reader task per connection decodes every frame and dispatches it to the stream's
bounded channel (or the waiting call); writers share one lock. A consumer that does not
read its stream fills the channel and then pauses the reader, which back-pressures the
sidecar (and so the engine) -- read your streams, or leave their blocks.

Cancellation: leaving a ``generate`` block before its ``end`` (break, exception,
cancellation) sends ``cancel`` and waits, shielded and bounded by ``cancel_timeout``, for
the ``end``. Losing the connection ends every open stream and call with
``SidecarConnectionError`` -- and so does cancelling the scope around ``open_sidecar`` (or
leaving its block): once the reader has stopped, no stream waits for an ``end`` that can no
longer arrive, so the cancellation completes promptly (the sidecar cancels and aborts the
streams of a closed connection itself).
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import betterproto2
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    DisconnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from sidecar.north import codec, wire
from sidecar.north.codec import Encoding
from sidecar.north.pbjson import message_to_json
from sidecar.nursery import first_leaf, open_background_nursery
from sidecar.quoting import clip

__all__ = [
    "DEFAULT_PATH",
    "SidecarCallError",
    "SidecarClient",
    "SidecarConnectionError",
    "SidecarError",
    "SidecarStream",
    "SidecarStreamError",
    "open_sidecar",
    "sidecar_url",
]

log = logging.getLogger(__name__)

#: Path added to a sidecar URL that has none.
DEFAULT_PATH = "/v1/ws"


class SidecarError(Exception):
    """Base of the client's errors."""


class SidecarConnectionError(SidecarError):
    """Could not connect, or the connection was lost (``close_code`` when the peer sent one).
    Retryable: the request may be sent again, to this sidecar or another."""

    retryable = True

    def __init__(self, message: str, *, close_code: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code

    def copy(self) -> SidecarConnectionError:
        """A fresh instance to raise (one error object raised in many tasks would mix tracebacks)."""
        return SidecarConnectionError(str(self), close_code=self.close_code)


class SidecarCallError(SidecarError):
    """A ``call`` answered ``ok: false``: ``code`` is an ``ERROR_CODE_*`` name."""

    def __init__(self, method: str, error: wire.ErrorBody) -> None:
        super().__init__(f"{method}: {error.code}: {error.message}")
        self.method = method
        self.code = error.code
        self.message = error.message
        self.retryable = error.retryable


class SidecarStreamError(SidecarError):
    """Raised by ``SidecarStream.check()`` for an ``end`` other than ``completed``."""

    def __init__(self, end: wire.End) -> None:
        error = end.error
        detail = f"{error.code}: {error.message}" if error is not None else "no error details"
        super().__init__(f"stream {end.outcome}: {detail}")
        self.outcome = end.outcome
        self.code = error.code if error is not None else None
        self.message = error.message if error is not None else ""
        self.retryable = error.retryable if error is not None else False


def sidecar_url(url: str) -> str:
    """Normalize a sidecar address: ``ws://h:p`` -> ``ws://h:p/v1/ws``; ``h:p`` -> ``ws://h:p/v1/ws``.
    A URL with a path (or ``wss://``) keeps it; other schemes are a ``ValueError``."""
    if "://" not in url:
        url = "ws://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"sidecar URL must be ws:// or wss://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"sidecar URL has no host: {url!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path=DEFAULT_PATH)
    return urllib.parse.urlunsplit(parts)


class SidecarStream:
    """One ``generate``: iterate it for ``wire.Event``s; ``end`` is set once the stream ended.

    Iteration stops after the ``end`` (check ``end.outcome``, or call ``check()``); it raises
    ``SidecarConnectionError`` if the connection is lost first.
    """

    def __init__(self, client: SidecarClient, stream_id: int, buffer: int) -> None:
        self.id = stream_id
        self.end: wire.End | None = None
        #: ``kvSessionBytes`` of the ``prefillReady`` event, if one arrived.
        self.kv_session_bytes: bytes | None = None
        self._client = client
        self._send, self._recv = trio.open_memory_channel[wire.Event](buffer)
        self._ended = trio.Event()
        self._error: SidecarConnectionError | None = None
        self._opened = False
        self._abandoned = False
        self._cancel_sent = False

    def __aiter__(self) -> SidecarStream:
        return self

    async def __anext__(self) -> wire.Event:
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error.copy() from None
            raise StopAsyncIteration from None

    async def cancel(self) -> None:
        """Ask the sidecar to cancel (idempotent); keep iterating to see the remaining events and
        the ``end`` (normally ``cancelled``)."""
        if self._cancel_sent or self.end is not None or self._error is not None or not self._opened:
            return
        self._cancel_sent = True
        await self._client._send(wire.Cancel(stream=self.id))

    async def wait_end(self) -> wire.End:
        """Skip the remaining events and return the ``end``; ``SidecarConnectionError`` if lost."""
        async for _ in self:
            pass
        assert self.end is not None
        return self.end

    def check(self) -> wire.End:
        """Return the ``end`` if ``completed``; else raise ``SidecarStreamError`` (or
        ``SidecarConnectionError``). Call after the stream ended."""
        if self._error is not None:
            raise self._error.copy()
        if self.end is None:
            raise RuntimeError("stream has not ended yet")
        if self.end.outcome != "completed":
            raise SidecarStreamError(self.end)
        return self.end

    # reader side
    async def _deliver(self, event: wire.Event) -> None:
        if event.kv_session_bytes is not None:
            self.kv_session_bytes = event.kv_session_bytes
        if self._abandoned:
            return
        try:
            await self._send.send(event)  # bounded: a slow consumer pauses the reader
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left its block meanwhile

    def _finish(self, end: wire.End | None, error: SidecarConnectionError | None) -> None:
        if self._ended.is_set():
            return
        self.end, self._error = end, error
        self._send.close()
        self._ended.set()


class _PendingCall:
    def __init__(self, method: str) -> None:
        self.method = method
        self.done = trio.Event()
        self.result: wire.Result | None = None
        self.error: SidecarConnectionError | None = None


#: The longest wait for the PING that confirms an unanswered one (see ``SidecarClient._keepalive``).
CONFIRM_TIMEOUT = 2.0


class SidecarClient:
    """One WebSocket connection to a sidecar; create with ``open_sidecar``."""

    def __init__(
        self, ws: WebSocketConnection, *, encoding: Encoding, stream_buffer: int, cancel_timeout: float
    ) -> None:
        self._ws = ws
        self.encoding = encoding
        self._stream_buffer = stream_buffer
        self._cancel_timeout = cancel_timeout
        self._send_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._streams: dict[str | int, SidecarStream] = {}
        self._calls: dict[str | int, _PendingCall] = {}
        self._lost: SidecarConnectionError | None = None
        #: The last ``protocol_error`` message the sidecar sent (it cannot be matched to a request).
        self.last_protocol_error: str | None = None
        self._reader_idle = False  # the reader waits for a frame (nothing queued on our side)
        self._frames_received = 0  # every frame proves the sidecar alive (its PONG may queue behind)

    @property
    def cancel_timeout(self) -> float:
        """How long a cancelled stream waits for its ``end`` (and best-effort calls are bounded)."""
        return self._cancel_timeout

    @property
    def closed(self) -> bool:
        return self._lost is not None

    async def _send(self, msg: wire.ClientMessage) -> None:
        if self._lost is not None:
            raise self._lost.copy()
        frame = codec.encode(msg, self.encoding)
        async with self._send_lock:
            try:
                await self._ws.send_message(frame)
            except ConnectionClosed as err:
                raise self._connection_lost(err).copy() from None

    def _connection_lost(
        self, err: ConnectionClosed | None, message: str | None = None
    ) -> SidecarConnectionError:
        if self._lost is None:
            reason = err.reason if err is not None else None
            code = reason.code if reason is not None else None
            if message is None:
                message = "connection to sidecar closed" + (
                    f" ({reason.code} {reason.name}{': ' + reason.reason if reason.reason else ''})"
                    if reason
                    else ""
                )
            self._lost = SidecarConnectionError(message, close_code=code)
            for stream in list(self._streams.values()):
                stream._finish(None, self._lost)
            for call in list(self._calls.values()):
                call.error = self._lost
                call.done.set()
        return self._lost

    async def _reader(self) -> None:
        """Decode and dispatch every frame until the connection closes; never raises (a failure
        ends all streams and calls with ``SidecarConnectionError``)."""
        try:
            while True:
                self._reader_idle = True
                frame = await self._ws.get_message()
                self._reader_idle = False
                self._frames_received += 1
                try:
                    msg = codec.decode_server_frame(frame)
                except codec.ProtocolError as err:
                    log.warning("ignoring a message from the sidecar: %s", err)
                    continue
                await self._dispatch(msg)
        except ConnectionClosed as err:
            self._connection_lost(err)
        except codec.FrameDecodeError as err:
            self._connection_lost(None, str(err))
            with trio.move_on_after(self._cancel_timeout) as scope:
                scope.shield = True
                await self._ws.aclose(1007, "undecodable frame")
        except Exception as err:
            log.exception("sidecar client reader failed")
            self._connection_lost(None, f"client reader failed: {err!r}")
            with trio.move_on_after(self._cancel_timeout) as scope:
                scope.shield = True
                await self._ws.aclose(1011, "client error")
        finally:
            # Cancelled (the scope around ``open_sidecar`` was cancelled, or its block is
            # closing): no ``end`` or result can arrive any more, so nothing may wait for one
            # (a stream leaving its block would otherwise wait its whole ``cancel_timeout``).
            self._connection_lost(None, "connection to sidecar closed by the client")

    async def _keepalive(self, interval: float, timeout: float) -> None:
        """WebSocket PINGs every ``interval`` while a stream or call is open; a PING without a
        PONG within ``timeout``, while no frame arrived meanwhile and this client is not the one
        holding frames back (its reader idle), means the sidecar or the path to it is gone: every
        stream and call ends with ``SidecarConnectionError`` (a frozen sidecar never closes its
        connection). Frames still arriving prove the sidecar alive: on a busy connection whose
        client reads slower than the sidecar writes, the PONG waits behind a backlog of events.

        One unanswered PING is confirmed by a second (``min(timeout, CONFIRM_TIMEOUT)``) before
        the connection counts as lost: a client whose own process was starved of CPU past the
        deadline wakes up with the PONG or frames still unread in its socket, and its reader
        needs that long to take them (CI saw a busy test process declare a working sidecar lost)."""
        while self._lost is None:
            await trio.sleep(interval)
            if not (self._streams or self._calls) or not self._reader_idle:
                continue
            received = self._frames_received
            try:
                if await self._pinged(timeout) or await self._pinged(min(timeout, CONFIRM_TIMEOUT)):
                    continue
            except ConnectionClosed:
                return  # the reader reports it
            if self._frames_received == received and self._reader_idle and self._lost is None:
                log.warning(
                    "the sidecar did not answer a ping within %gs: connection considered lost", timeout
                )
                self._connection_lost(
                    None, f"no answer to a ping within {timeout:g}s (sidecar hung or unreachable)"
                )

    async def _pinged(self, timeout: float) -> bool:
        """True if the sidecar answers one PING within ``timeout``; raises ``ConnectionClosed``."""
        with trio.move_on_after(timeout):
            await self._ws.ping()
            return True
        return False

    async def _dispatch(self, msg: wire.ServerMessage) -> None:
        if type(msg) is wire.Event:
            stream = self._streams.get(msg.stream)
            if stream is not None:
                await stream._deliver(msg)
        elif type(msg) is wire.End:
            stream = self._streams.get(msg.stream)
            if stream is not None:
                stream._finish(msg, None)
        elif type(msg) is wire.Result:
            call = self._calls.get(msg.call)
            if call is not None:
                call.result = msg
                call.done.set()
        elif type(msg) is wire.Events:
            for item in msg.items:
                await self._dispatch(item)
        elif type(msg) is wire.ProtocolErrorMessage:
            log.warning("sidecar reported a protocol error: %s", msg.message)
            self.last_protocol_error = msg.message

    @asynccontextmanager
    async def generate(
        self,
        request: Mapping[str, Any] | betterproto2.Message,
        metadata: Mapping[str, str] | None = None,
        kv_session_bytes: bytes | None = None,
    ) -> AsyncIterator[SidecarStream]:
        """Start a stream. ``request`` is a ``pb.GenerateRequest`` or its proto3 JSON form;
        ``kv_session_bytes`` the ``kvSessionBytes`` of a prefill's ``prefillReady`` event.

        Leaving the block before the ``end`` sends ``cancel`` and waits (shielded, at most
        ``cancel_timeout``) for the ``end``. Raises ``SidecarConnectionError`` when not connected.
        """
        body = message_to_json(request) if isinstance(request, betterproto2.Message) else dict(request)
        stream = SidecarStream(self, next(self._ids), self._stream_buffer)
        self._streams[stream.id] = stream
        try:
            await self._send(
                wire.Generate(
                    stream=stream.id,
                    request=body,
                    metadata=dict(metadata) if metadata else None,
                    kv_session_bytes=kv_session_bytes,
                )
            )
            stream._opened = True
            yield stream
        finally:
            stream._abandoned = True
            stream._recv.close()
            if stream._opened and not stream._ended.is_set():
                with trio.move_on_after(self._cancel_timeout, shield=True):
                    try:
                        await stream.cancel()
                        await stream._ended.wait()
                    except SidecarConnectionError:
                        pass
                if not stream._ended.is_set():
                    log.warning("stream %s: no end within %.1fs of cancel", stream.id, self._cancel_timeout)
            self._streams.pop(stream.id, None)

    async def call(self, method: str, params: Mapping[str, Any] | betterproto2.Message | None = None) -> Any:
        """A unary call (``describe``, ``load``, ``health``, ``listLoras``, ``loadLora``,
        ``unloadLora``); returns the result ``body``. Raises ``SidecarCallError`` when the
        sidecar answers with an error, ``SidecarConnectionError`` when the connection is lost.
        Bound it with ``trio.fail_after``."""
        if isinstance(params, betterproto2.Message):
            params = message_to_json(params)
        call_id = next(self._ids)
        pending = _PendingCall(method)
        self._calls[call_id] = pending
        try:
            await self._send(wire.Call(call=call_id, method=method, params=dict(params) if params else None))
            await pending.done.wait()
        finally:
            self._calls.pop(call_id, None)
        if pending.error is not None:
            raise pending.error.copy()
        result = pending.result
        assert result is not None
        if result.ok:
            return result.body
        raise SidecarCallError(method, result.error or wire.ErrorBody(code="ERROR_CODE_UNSPECIFIED"))


@asynccontextmanager
async def open_sidecar(
    url: str,
    *,
    encoding: Encoding | str = Encoding.JSON,
    connect_timeout: float = 10.0,
    cancel_timeout: float = 5.0,
    stream_buffer: int = 64,
    max_message_size: int = 16 * 2**20,
    ssl_context: ssl.SSLContext | None = None,
    coalesce: bool = False,
    auth_token: str | None = None,
    keepalive_interval: float = 10.0,
    keepalive_timeout: float = 10.0,
) -> AsyncIterator[SidecarClient]:
    """Connect to a sidecar (``sidecar_url`` normalizes ``url``) and run the connection's reader.

    ``encoding`` picks JSON text frames or msgpack binary frames for the whole connection.
    ``coalesce`` opts in to ``events`` frames (several events in one frame; the URL gets
    ``coalesce=1``); the client handles them transparently. ``auth_token`` is sent as
    ``Authorization: Bearer <token>`` (a sidecar run with ``--auth-token-file`` refuses the
    handshake without it: ``SidecarConnectionError``). While a stream or call is open, a
    WebSocket PING every ``keepalive_interval`` seconds (0: never) must be answered within
    ``keepalive_timeout``, else (once a second PING confirms it, and no frame arrived meanwhile)
    the connection counts as lost (a hung sidecar or a dead path).
    Raises ``SidecarConnectionError`` if the connection cannot be opened. Leaving the block
    closes the connection (open streams see it as lost; leave their blocks first), waiting at
    most ``cancel_timeout`` for the sidecar's close reply.
    """
    full_url = sidecar_url(url)
    if coalesce:
        parts = urllib.parse.urlsplit(full_url)
        full_url = urllib.parse.urlunsplit(
            parts._replace(query="&".join(filter(None, [parts.query, "coalesce=1"])))
        )
    enc = Encoding(encoding)
    connected = False
    body_error: BaseException | None = None  # what the caller's block raised, if anything
    if full_url.startswith("wss://"):
        await _check_tls(full_url, ssl_context, connect_timeout)
    try:
        async with open_websocket_url(
            full_url,
            ssl_context,
            extra_headers=[(b"authorization", f"Bearer {auth_token}".encode())] if auth_token else None,
            message_queue_size=16,
            max_message_size=max_message_size,
            connect_timeout=connect_timeout,
            disconnect_timeout=cancel_timeout,
        ) as ws:
            connected = True
            client = SidecarClient(
                ws, encoding=enc, stream_buffer=stream_buffer, cancel_timeout=cancel_timeout
            )
            async with open_background_nursery() as nursery:  # reader and keepalive never raise
                nursery.start_soon(client._reader)
                if keepalive_interval > 0:
                    nursery.start_soon(client._keepalive, keepalive_interval, keepalive_timeout)
                try:
                    yield client
                except BaseException as err:
                    body_error = err
                    raise
                finally:
                    nursery.cancel_scope.cancel(reason="sidecar client closed")
    except DisconnectionTimeout:
        # Leaving the block: the close handshake got no answer within ``cancel_timeout`` (a
        # frozen sidecar or a dead path). The connection is gone either way: nothing to raise
        # but what the caller's block raised (trio-websocket raises the timeout in its place).
        if body_error is not None:
            raise body_error from None
        log.debug("closing the connection to %s: no close reply within %gs", full_url, cancel_timeout)
    except (HandshakeError, OSError) as err:
        if connected:
            raise  # from the caller's block
        raise SidecarConnectionError(
            f"cannot connect to {full_url}: {connect_failure(err, connect_timeout)}"
        ) from err


def connect_failure(err: BaseException, connect_timeout: float) -> str:
    """What went wrong opening a connection, in words: refused, TLS, timeout, an HTTP refusal."""
    if isinstance(err, ConnectionRejected):
        return _refusal(err)
    if isinstance(err, ConnectionTimeout):
        return (
            f"no WebSocket handshake within {connect_timeout:g}s (is it a TLS port spoken to as ws://, "
            "or a sidecar that does not answer?)"
        )
    cause = _root_cause(err)
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (nothing listens there: is the sidecar running?)"
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve the host ({cause.strerror or cause})"
    if isinstance(cause, ssl.SSLError | trio.BrokenResourceError):
        return _tls_failure(cause)
    if isinstance(cause, OSError):
        return cause.strerror or str(cause) or type(cause).__name__
    return str(cause) or type(cause).__name__


def _refusal(err: ConnectionRejected) -> str:
    """A refused WebSocket handshake in words (the server's body escaped and cut)."""
    status = err.status_code
    if any(k.lower() == wire.LISTENER_HEADER.encode() and v == b"http" for k, v in err.headers):
        return (
            "that is the sidecar's HTTP port (probes, metrics), not its WebSocket port: "
            "connect to its --listen address (default port 8600)"
        )
    if status == 401:
        return "401 unauthorized: the sidecar wants a bearer token (--auth-token-file); none or a wrong one was sent"
    try:
        phrase = f" {HTTPStatus(status).phrase}"
    except ValueError:
        phrase = ""
    body = (err.body or b"").decode(errors="replace").strip()
    text = f"the WebSocket handshake was refused with HTTP {status}{phrase}" + (
        f" ({clip(body, 200)})" if body else ""
    )
    if status not in (HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.SERVICE_UNAVAILABLE):  # a sidecar at capacity
        text += ": is it the address of a sidecar's --listen (default port 8600)?"
    return text


def _root_cause(err: BaseException) -> BaseException:
    """The innermost cause: through ``__cause__`` (trio-websocket's HandshakeError, trio's
    "all attempts to connect failed") and the first member of exception groups."""
    seen: set[int] = set()
    while id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, BaseExceptionGroup):
            err = first_leaf(err)
        elif err.__cause__ is not None:
            err = err.__cause__
        else:
            break
    return err


def _tls_failure(err: BaseException) -> str:
    ssl_err = err if isinstance(err, ssl.SSLError) else err.__cause__
    if isinstance(ssl_err, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted: {ssl_err.verify_message or ssl_err.reason}"
    reason = getattr(ssl_err, "reason", None) or str(ssl_err or err) or "connection closed"
    return f"TLS handshake failed ({reason}): is it a plain ws:// port?"


async def _check_tls(url: str, ssl_context: ssl.SSLContext | None, connect_timeout: float) -> None:
    """Handshake TLS with a ``wss://`` sidecar first, so a plain port or an untrusted certificate
    is named at once (trio-websocket would wait out its connect timeout)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    context = ssl_context or ssl.create_default_context()
    try:
        with trio.fail_after(connect_timeout):
            stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=context)
            try:
                await stream.do_handshake()
            finally:
                await trio.aclose_forcefully(stream)
    except trio.TooSlowError:
        raise SidecarConnectionError(
            f"cannot connect to {url}: no TLS handshake within {connect_timeout:g}s"
        ) from None
    except (OSError, trio.BrokenResourceError) as err:
        raise SidecarConnectionError(
            f"cannot connect to {url}: {connect_failure(err, connect_timeout)}"
        ) from err

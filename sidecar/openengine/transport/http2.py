"""The client side of one HTTP/2 connection (RFC 9113), I/O-free: what gRPC
calls need and nothing more. :mod:`sidecar.openengine.transport.connection` moves its bytes.

Why not the ``h2`` library (docs/design/engine-transport.md): h2 is a complete, general state
machine — header validation and normalisation, a frame object and an event object per frame,
HPACK's dynamic table on every request — and configured as lean as it goes it still cost the
sidecar a fifth more CPU per short request. This module keeps what a client of gRPC calls uses:
it frames and parses bytes directly, tracks each stream's windows and state, and leaves HPACK
*decoding* to the ``hpack`` library (its dynamic table must see every header block the engine
sends, in order).

:class:`ClientConnection` offers what the transport uses, named as ``h2.connection.H2Connection``
names it: :meth:`~ClientConnection.send_headers`, :meth:`~ClientConnection.send_data`,
:meth:`~ClientConnection.reset_stream`, :meth:`~ClientConnection.acknowledge_received_data`,
:meth:`~ClientConnection.ping`, :meth:`~ClientConnection.close_connection` queue frames;
:meth:`~ClientConnection.data_to_send` takes them; :meth:`~ClientConnection.receive_data` turns
received bytes into events (the classes below).

Requests are encoded without touching the engine's HPACK table (static-table references and
literals *without indexing*, RFC 7541 6.1/6.2.2), so a header's bytes never depend on what went
before and each distinct header is encoded once per connection (only a peer lowering
SETTINGS_HEADER_TABLE_SIZE below 4,096 gets the size update RFC 7541 4.2 requires, once).

Errors are scoped as RFC 9113 section 5.4 says. A *stream* error — a malformed response
(section 8.1.1: DATA before the response HEADERS, trailers without END_STREAM, a 1xx that ends
the stream), a zero WINDOW_UPDATE on a stream, a stream's window overflowing or overrun — resets
that stream alone (RST_STREAM queued) and yields :class:`StreamBroken`; the other streams go on.
A *connection* error — a frame that breaks framing, HPACK or the connection's flow control, a
first frame that is not SETTINGS (section 3.4), SETTINGS_ENABLE_PUSH other than 0 from a server
(section 6.5.2), PUSH_PROMISE — raises :class:`ProtocolViolation` from
:meth:`~ClientConnection.receive_data` (a GOAWAY with its ``code`` is queued; the connection is
done), carrying the events parsed before it. Asking for what the connection cannot do now (a
stream id after the last, more streams than the peer allows, data on a closed stream or beyond
the window) raises :class:`StreamUnavailable`; request headers over the peer's
SETTINGS_MAX_HEADER_LIST_SIZE raise :class:`HeadersTooLarge`. All are :class:`H2Error`.

Our own SETTINGS take effect when the peer acknowledges them (section 6.5.3): until then each
stream's receive window is the protocol's default. A stream the peer ends while our request is
still being sent (flow control held it back) is closed with RST_STREAM(NO_ERROR) (section 8.1).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final, cast

import hpack
import hpack.table

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types and flags (RFC 9113 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# settings (RFC 9113 6.5.2)
(
    HEADER_TABLE_SIZE,
    ENABLE_PUSH,
    MAX_CONCURRENT_STREAMS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
) = range(1, 7)

# error codes (RFC 9113 7)
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB

DEFAULT_WINDOW: Final = 65_535
DEFAULT_MAX_FRAME: Final = 16_384
MAX_WINDOW: Final = 2**31 - 1
LAST_STREAM_ID: Final = 2**31 - 1

_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_HEAD = struct.Struct(">BHBBI")  # length as 1 + 2 bytes, type, flags, stream id


class H2Error(Exception):
    """An HTTP/2 failure; ``code`` is the HTTP/2 error code that goes with it."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class ProtocolViolation(H2Error):
    """The peer broke HTTP/2 (or HPACK): the connection is done; a GOAWAY is queued.
    ``events``: what the same :meth:`ClientConnection.receive_data` parsed before it."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message, code)
        self.events: list[Event] = []


class StreamUnavailable(H2Error):
    """A local request the connection cannot carry out now (no stream id or slot left, a
    closed stream, data beyond the window)."""


class HeadersTooLarge(H2Error):
    """A request's header list is larger than the peer's SETTINGS_MAX_HEADER_LIST_SIZE."""


# -- events -------------------------------------------------------------------------------------

#: A decoded header block (shared between blocks of the same bytes: never changed in place).
Headers = Sequence[tuple[bytes, bytes]]
#: The bytes of a header block made only of one-byte indexed fields (RFC 7541 6.1, indexes 1-126):
#: decoding such a block reads the dynamic table without changing it.
_ONE_BYTE_INDEXED: Final = bytes(range(0x81, 0xFF))
#: Decoded blocks of that kind kept per connection (an engine repeats a handful: its response
#: head and its trailers once their fields are in the table).
_DECODED_BLOCKS: Final = 16


class ResponseReceived:
    """A stream's response headers; ``stream_ended``: they also ended it (trailers-only)."""

    __slots__ = ("headers", "stream_ended", "stream_id")

    def __init__(self, stream_id: int, headers: Headers, stream_ended: bool) -> None:
        self.stream_id, self.headers, self.stream_ended = stream_id, headers, stream_ended


class InformationalResponseReceived:
    """A 1xx response head (the real response follows)."""

    __slots__ = ("headers", "stream_id")

    def __init__(self, stream_id: int, headers: Headers) -> None:
        self.stream_id, self.headers = stream_id, headers


class TrailersReceived:
    """A stream's trailers (they end it)."""

    __slots__ = ("headers", "stream_id")

    def __init__(self, stream_id: int, headers: Headers) -> None:
        self.stream_id, self.headers = stream_id, headers


class DataReceived:
    """DATA on an open stream; ``flow_controlled_length`` (payload with padding) is what
    :meth:`ClientConnection.acknowledge_received_data` gives back once consumed."""

    __slots__ = ("data", "flow_controlled_length", "stream_id")

    def __init__(self, stream_id: int, data: bytes, flow_controlled_length: int) -> None:
        self.stream_id, self.data, self.flow_controlled_length = stream_id, data, flow_controlled_length


class StreamEnded:
    """A DATA frame ended the stream (no trailers came)."""

    __slots__ = ("stream_id",)

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class StreamReset:
    """The peer reset an open stream (RST_STREAM)."""

    __slots__ = ("error_code", "stream_id")

    def __init__(self, stream_id: int, error_code: int) -> None:
        self.stream_id, self.error_code = stream_id, error_code


class StreamBroken:
    """The peer broke HTTP/2 on one stream (a stream error, RFC 9113 5.4.2): the stream was
    reset (RST_STREAM with ``error_code`` queued); ``reason`` says what happened."""

    __slots__ = ("error_code", "reason", "stream_id")

    def __init__(self, stream_id: int, error_code: int, reason: str) -> None:
        self.stream_id, self.error_code, self.reason = stream_id, error_code, reason


class WindowUpdated:
    """A send window grew: queued request bytes may go on."""

    __slots__ = ()


class RemoteSettingsChanged:
    """The peer's SETTINGS were applied (acknowledged; send windows may have changed)."""

    __slots__ = ("max_concurrent_streams",)

    def __init__(self, max_concurrent_streams: int | None) -> None:
        self.max_concurrent_streams = max_concurrent_streams


class PingAckReceived:
    """The answer to our PING."""

    __slots__ = ("ping_data",)

    def __init__(self, ping_data: bytes) -> None:
        self.ping_data = ping_data


class ConnectionTerminated:
    """The peer sent GOAWAY: streams above ``last_stream_id`` were not processed."""

    __slots__ = ("error_code", "last_stream_id")

    def __init__(self, last_stream_id: int, error_code: int) -> None:
        self.last_stream_id, self.error_code = last_stream_id, error_code


Event = (
    ResponseReceived
    | InformationalResponseReceived
    | TrailersReceived
    | DataReceived
    | StreamEnded
    | StreamReset
    | StreamBroken
    | WindowUpdated
    | RemoteSettingsChanged
    | PingAckReceived
    | ConnectionTerminated
)

_WINDOW_UPDATED = WindowUpdated()


# -- request header encoding (RFC 7541, never indexed into the peer's table) --------------------


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(value: bytes) -> bytes:
    return _integer(len(value), 7, 0) + value  # H = 0: no Huffman coding


_STATIC = hpack.table.HeaderTable.STATIC_TABLE
_STATIC_FIELD = {field: i for i, field in reversed(list(enumerate(_STATIC, 1)))}
_STATIC_NAME = {name: i for i, (name, _) in reversed(list(enumerate(_STATIC, 1)))}


def encode_header(name: bytes, value: bytes) -> bytes:
    """One header field: a static-table reference, else a literal without indexing (by the
    static table's name index when there is one)."""
    index = _STATIC_FIELD.get((name, value))
    if index is not None:
        return _integer(index, 7, 0x80)
    index = _STATIC_NAME.get(name)
    if index is not None:
        return _integer(index, 4, 0) + _string(value)
    return b"\x00" + _string(name) + _string(value)


_ENCODED_KEPT = 4096  # distinct header fields remembered per connection (request ids do not repeat)


# -- the connection ------------------------------------------------------------------------------


class _StreamState:
    __slots__ = ("head", "local_closed", "recv_window", "send_window", "unacked")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window  # what the peer may still send before a WINDOW_UPDATE
        self.unacked = 0  # consumed bytes not yet given back by a WINDOW_UPDATE
        self.head = 0  # 0 nothing received, 1 informational, 2 response, 3 trailers
        self.local_closed = False


class ClientConnection:
    """One client HTTP/2 connection's state (module doc). ``stream_window``: the receive window
    of each stream (our SETTINGS_INITIAL_WINDOW_SIZE); ``max_header_list``: the largest response
    header list accepted (our SETTINGS_MAX_HEADER_LIST_SIZE)."""

    def __init__(self, *, stream_window: int = DEFAULT_WINDOW, max_header_list: int = 64 * 1024) -> None:
        if not 0 <= stream_window <= MAX_WINDOW:
            raise ValueError(f"stream window {stream_window} out of range")
        self.stream_window = stream_window
        self.max_header_list = max_header_list
        self.streams: dict[int, _StreamState] = {}
        self.highest_outbound_stream_id = 0
        self.closed = False  # GOAWAY sent or a violation seen: nothing more is parsed
        self.goaway_received = False
        # the peer's settings
        self.max_concurrent_streams: int | None = None  # unlimited until its SETTINGS say
        self.max_outbound_frame_size = DEFAULT_MAX_FRAME
        self._peer_initial_window = DEFAULT_WINDOW
        self.peer_max_header_list: int | None = None  # unlimited until its SETTINGS say
        self._settings_seen = False  # the peer's first SETTINGS arrived
        # our SETTINGS apply once acknowledged; until then a stream's window is the default
        self._recv_initial = DEFAULT_WINDOW
        # the size our encoder's (unused) dynamic table may have; lowering it below that must be
        # signalled at the start of the next header block (RFC 7541 4.2; hpack and nghttp2 insist)
        self._table_size = 4_096
        self._table_update = b""
        # connection windows
        self._send_window = DEFAULT_WINDOW
        self._recv_window = DEFAULT_WINDOW
        self._recv_max = DEFAULT_WINDOW
        self._recv_unacked = 0
        # I/O
        self._out: list[bytes] = []
        self._buf = b""
        self._block: list[bytes] | None = None  # header block fragments awaiting CONTINUATION
        self._block_head = (0, 0)  # (stream id, flags of its HEADERS frame)
        self._block_size = 0
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list)
        # decoded blocks of one-byte indexed fields only: valid until a block changes the table
        self._decoded: dict[bytes, Headers] = {}
        self._encoded: dict[tuple[bytes, bytes], bytes] = {}

    # -- sending ---------------------------------------------------------------------------------

    def _frame(self, ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        n = len(payload)
        self._out.append(_HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + payload)

    def initiate_connection(self) -> None:
        """Queue the preface and our SETTINGS (no push; our stream window and header limit)."""
        self._out.append(PREFACE)
        settings = (
            (ENABLE_PUSH, 0),
            (INITIAL_WINDOW_SIZE, self.stream_window),
            (MAX_HEADER_LIST_SIZE, self.max_header_list),
        )
        self._frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings))

    def increment_flow_control_window(self, increment: int) -> None:
        """Grow the connection's receive window by ``increment`` (a WINDOW_UPDATE)."""
        if not 0 < increment <= MAX_WINDOW - self._recv_max:
            raise ValueError(f"window increment {increment} out of range")
        self._recv_max += increment
        self._recv_window += increment
        self._frame(WINDOW_UPDATE, 0, 0, _U32.pack(increment))

    def data_to_send(self) -> bytes:
        """Every frame queued since the last call, as one ``bytes``."""
        if not self._out:
            return b""
        out = b"".join(self._out)
        self._out.clear()
        return out

    def get_next_available_stream_id(self) -> int:
        sid = self.highest_outbound_stream_id + 2 if self.highest_outbound_stream_id else 1
        if sid > LAST_STREAM_ID:
            raise StreamUnavailable("no stream id left on this connection", NO_ERROR)
        return sid

    def send_headers(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool = False
    ) -> None:
        """Open ``stream_id`` (the next id) with ``headers``."""
        if self.closed or self.goaway_received:
            raise StreamUnavailable("the connection is closing")
        if stream_id != self.get_next_available_stream_id():
            raise StreamUnavailable(f"stream {stream_id} is not the next stream id")
        limit = self.max_concurrent_streams
        if limit is not None and len(self.streams) >= limit:
            raise StreamUnavailable(f"the peer allows {limit} concurrent streams")
        if self.peer_max_header_list is not None:  # its size as RFC 9113 6.5.2 counts it
            size = sum(len(name) + len(value) + 32 for name, value in headers)
            if size > self.peer_max_header_list:
                raise HeadersTooLarge(
                    f"request headers of {size} bytes exceed the engine's limit of "
                    f"{self.peer_max_header_list} (SETTINGS_MAX_HEADER_LIST_SIZE)"
                )
        cache = self._encoded
        parts = []
        for field in headers:
            encoded = cache.get(field)
            if encoded is None:
                if len(cache) >= _ENCODED_KEPT:
                    cache.clear()
                encoded = cache[field] = encode_header(*field)
            parts.append(encoded)
        block = b"".join(parts)
        if self._table_update:
            block, self._table_update = self._table_update + block, b""
        self.highest_outbound_stream_id = stream_id
        stream = self.streams[stream_id] = _StreamState(self._peer_initial_window, self._recv_initial)
        flags = END_STREAM if end_stream else 0
        stream.local_closed = end_stream
        size = self.max_outbound_frame_size
        if len(block) <= size:
            self._frame(HEADERS, flags | END_HEADERS, stream_id, block)
            return
        self._frame(HEADERS, flags, stream_id, block[:size])
        for start in range(size, len(block), size):
            last = start + size >= len(block)
            self._frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[start : start + size])

    def local_flow_control_window(self, stream_id: int) -> int:
        """How many bytes of DATA ``stream_id`` may send now."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            raise StreamUnavailable(f"stream {stream_id} is closed for sending")
        return min(self._send_window, stream.send_window)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """One DATA frame (within the windows and the peer's frame size)."""
        n = len(data)
        if n > self.local_flow_control_window(stream_id) or n > self.max_outbound_frame_size:
            raise StreamUnavailable(f"{n} bytes exceed the send window or frame size of stream {stream_id}")
        stream = self.streams[stream_id]
        stream.send_window -= n
        self._send_window -= n
        if end_stream:
            stream.local_closed = True
        self._frame(DATA, END_STREAM if end_stream else 0, stream_id, data)

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None:
        """RST_STREAM ``stream_id`` unless it is closed already (idempotent)."""
        if self.streams.pop(stream_id, None) is not None:
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(error_code))

    def acknowledge_received_data(self, size: int, stream_id: int) -> None:
        """``size`` received bytes were consumed: a WINDOW_UPDATE once half a window is due
        (the connection's, and the stream's while it is open)."""
        if self.closed or size <= 0:
            return
        self._recv_unacked += size
        if self._recv_unacked >= self._recv_max // 2:
            n, self._recv_unacked = self._recv_unacked, 0
            self._recv_window += n
            self._frame(WINDOW_UPDATE, 0, 0, _U32.pack(n))
        stream = self.streams.get(stream_id)
        if stream is not None and stream.head < 3:
            stream.unacked += size
            if stream.unacked >= self.stream_window // 2:
                n, stream.unacked = stream.unacked, 0
                stream.recv_window += n
                self._frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(n))

    def ping(self, payload: bytes) -> None:
        if len(payload) != 8:
            raise ValueError("a PING carries 8 bytes")
        self._frame(PING, 0, 0, payload)

    def close_connection(self, error_code: int = NO_ERROR) -> None:
        """Queue GOAWAY (we never accept streams: last stream id 0); nothing more is parsed."""
        if not self.closed:
            self.closed = True
            self._frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(error_code))

    # -- receiving -------------------------------------------------------------------------------

    def _violation(self, message: str, code: int = PROTOCOL_ERROR) -> ProtocolViolation:
        self.close_connection(code)
        return ProtocolViolation(message, code)

    def _stream_error(self, sid: int, code: int, reason: str, events: list[Event]) -> None:
        """A stream error (RFC 9113 5.4.2): reset ``sid`` alone and report it."""
        del self.streams[sid]
        self._frame(RST_STREAM, 0, sid, _U32.pack(code))
        events.append(StreamBroken(sid, code, reason))

    def _remote_end(self, sid: int, stream: _StreamState) -> None:
        """The peer ended ``sid``; a request still being sent is cut short with RST_STREAM
        (NO_ERROR) so the stream closes on both sides (RFC 9113 8.1)."""
        del self.streams[sid]
        if not stream.local_closed:
            self._frame(RST_STREAM, 0, sid, _U32.pack(NO_ERROR))

    def receive_data(self, data: bytes | bytearray) -> list[Event]:
        """The events in ``data`` (complete frames; a partial one waits for the rest). Raises
        :class:`ProtocolViolation` (GOAWAY queued) when the peer broke the protocol."""
        if self.closed:
            return []
        if type(data) is not bytes:
            data = bytes(data)
        if self._buf:
            data = self._buf + data
        events: list[Event] = []
        try:
            self._buf = self._parse(data, events)
        except ProtocolViolation as err:
            err.events = events
            raise
        return events

    def _parse(self, data: bytes, events: list[Event]) -> bytes:
        """Parse the complete frames of ``data`` into ``events``; returns the rest."""
        pos, end = 0, len(data)
        head, max_frame = _HEAD.unpack_from, DEFAULT_MAX_FRAME
        while end - pos >= 9:
            hi, lo, ftype, flags, sid = head(data, pos)
            length = hi << 16 | lo
            if length > max_frame:
                raise self._violation(f"a frame of {length} bytes (at most {max_frame})", FRAME_SIZE_ERROR)
            stop = pos + 9 + length
            if stop > end:
                break
            payload = data[pos + 9 : stop]
            pos = stop
            sid &= LAST_STREAM_ID
            if not self._settings_seen and (ftype != SETTINGS or flags & ACK):
                raise self._violation("the server's first frame is not SETTINGS (RFC 9113 3.4)")
            if self._block is not None and ftype != CONTINUATION:
                raise self._violation("a header block was interrupted")
            if ftype == DATA:
                self._on_data(flags, sid, payload, events)
            elif ftype == HEADERS:
                self._on_headers(flags, sid, payload, events)
            elif ftype == CONTINUATION:
                self._on_continuation(flags, sid, payload, events)
            elif ftype == WINDOW_UPDATE:
                self._on_window_update(sid, payload, events)
            elif ftype == RST_STREAM:
                self._on_rst_stream(sid, payload, events)
            elif ftype == SETTINGS:
                self._on_settings(flags, sid, payload, events)
            elif ftype == PING:
                self._on_ping(flags, sid, payload, events)
            elif ftype == GOAWAY:
                self._on_goaway(sid, payload, events)
            elif ftype == PRIORITY:
                if sid == 0 or length != 5:
                    raise self._violation(
                        "a malformed PRIORITY frame", FRAME_SIZE_ERROR if sid else PROTOCOL_ERROR
                    )
            elif ftype == PUSH_PROMISE:
                raise self._violation("PUSH_PROMISE, though we disabled push")
            # other frame types are ignored (RFC 9113 5.5)
            if self.closed:  # a GOAWAY we sent (a stream error is not one)
                break
        return data[pos:] if pos < end else b""

    def _stream_of(self, sid: int, what: str) -> _StreamState | None:
        """The open stream ``sid``; None for a closed one (its frames may still be on the way);
        a violation for stream 0, a stream the peer could not know or one of the peer's."""
        stream = self.streams.get(sid)
        if stream is not None:
            return stream
        if sid == 0 or sid & 1 == 0 or sid > self.highest_outbound_stream_id:
            raise self._violation(f"{what} on stream {sid}, which we did not open")
        return None

    def _on_data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise self._violation("DATA beyond the connection window", FLOW_CONTROL_ERROR)
        stream = self._stream_of(sid, "DATA")
        if stream is None:  # a closed stream: the bytes count for the connection only
            self.acknowledge_received_data(size, sid)
            return
        stream.recv_window -= size
        problem = None
        if stream.recv_window < 0:
            problem = FLOW_CONTROL_ERROR, f"DATA beyond the window of stream {sid}"
        elif stream.head != 2:
            problem = PROTOCOL_ERROR, f"DATA on stream {sid} outside a response"
        if problem is not None:
            self._stream_error(sid, *problem, events)
            self.acknowledge_received_data(size, sid)  # the connection's share
            return
        if flags & PADDED:
            unpadded = _unpad(payload)
            if unpadded is None:
                raise self._violation("padding beyond the DATA payload")
            payload = unpadded
        events.append(DataReceived(sid, payload, size))
        if flags & END_STREAM:
            self._remote_end(sid, stream)
            events.append(StreamEnded(sid))

    def _on_headers(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0 or sid & 1 == 0:
            raise self._violation(f"HEADERS on stream {sid}, which we did not open")
        if flags & PADDED:
            unpadded = _unpad(payload)
            if unpadded is None:
                raise self._violation("padding beyond the HEADERS payload")
            payload = unpadded
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise self._violation("a HEADERS frame too short for its priority", FRAME_SIZE_ERROR)
            payload = payload[5:]
        if flags & END_HEADERS:
            self._on_header_block(sid, flags, payload, events)
        else:
            self._block, self._block_head, self._block_size = [payload], (sid, flags), len(payload)

    def _on_continuation(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if self._block is None or sid != self._block_head[0]:
            raise self._violation("CONTINUATION without the HEADERS it continues")
        # each frame's 9-byte header counts too: empty CONTINUATIONs cannot pile up without end
        self._block_size += 9 + len(payload)
        if self._block_size > self.max_header_list:
            raise self._violation(f"a header block above {self.max_header_list} bytes", ENHANCE_YOUR_CALM)
        self._block.append(payload)
        if flags & END_HEADERS:
            block, self._block = b"".join(self._block), None
            self._on_header_block(sid, self._block_head[1], block, events)

    def _decode(self, block: bytes) -> Headers:
        """``block`` decoded; a repeated block of one-byte indexed fields from the cache (only a
        block with another representation can change the dynamic table, and it clears the cache)."""
        headers = self._decoded.get(block)
        if headers is not None:
            return headers
        headers = tuple(cast("list[tuple[bytes, bytes]]", self._decoder.decode(block, raw=True)))
        if block.translate(None, _ONE_BYTE_INDEXED):
            self._decoded.clear()
        elif len(self._decoded) < _DECODED_BLOCKS:
            self._decoded[block] = headers
        return headers

    def _on_header_block(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        try:  # every block, even a closed stream's: the decoder's table must see them all
            headers = self._decode(block)
        except hpack.OversizedHeaderListError as err:
            raise self._violation(f"response headers too large ({err})", ENHANCE_YOUR_CALM) from None
        except hpack.HPACKError as err:
            raise self._violation(
                f"undecodable header block ({type(err).__name__}: {err})", COMPRESSION_ERROR
            ) from None
        stream = self._stream_of(sid, "HEADERS")
        if stream is None:
            return
        ended = bool(flags & END_STREAM)
        if stream.head == 2:  # trailers
            if not ended:
                self._stream_error(
                    sid, PROTOCOL_ERROR, f"trailers without END_STREAM on stream {sid}", events
                )
                return
            stream.head = 3
            self._remote_end(sid, stream)
            events.append(TrailersReceived(sid, headers))
            return
        status = next((v for k, v in headers if k == b":status"), b"")
        if status[:1] == b"1" and not ended:
            stream.head = 1
            events.append(InformationalResponseReceived(sid, headers))
            return
        stream.head = 2
        if ended:
            self._remote_end(sid, stream)
        events.append(ResponseReceived(sid, headers, ended))

    def _on_window_update(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise self._violation("a WINDOW_UPDATE of the wrong size", FRAME_SIZE_ERROR)
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if sid == 0:
            if increment == 0:
                raise self._violation("a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise self._violation("the connection's send window above 2^31-1", FLOW_CONTROL_ERROR)
        else:
            stream = self._stream_of(sid, "WINDOW_UPDATE")
            if stream is None:
                return
            if increment == 0:  # RFC 9113 6.9: a stream error
                self._stream_error(sid, PROTOCOL_ERROR, f"a WINDOW_UPDATE of 0 on stream {sid}", events)
                return
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:  # RFC 9113 6.9.1: terminate the stream
                reason = f"the send window of stream {sid} above 2^31-1"
                self._stream_error(sid, FLOW_CONTROL_ERROR, reason, events)
                return
        events.append(_WINDOW_UPDATED)

    def _on_rst_stream(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise self._violation("an RST_STREAM of the wrong size", FRAME_SIZE_ERROR)
        if self._stream_of(sid, "RST_STREAM") is None:
            return
        del self.streams[sid]
        events.append(StreamReset(sid, _U32.unpack(payload)[0]))

    def _on_settings(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid != 0:
            raise self._violation("SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise self._violation("a SETTINGS acknowledgement with a payload", FRAME_SIZE_ERROR)
            if self._recv_initial != self.stream_window:  # our SETTINGS apply from now on
                delta, self._recv_initial = self.stream_window - self._recv_initial, self.stream_window
                for stream in self.streams.values():
                    stream.recv_window += delta
            return
        if len(payload) % 6:
            raise self._violation("a SETTINGS payload not a multiple of 6 bytes", FRAME_SIZE_ERROR)
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == MAX_CONCURRENT_STREAMS:
                self.max_concurrent_streams = value
            elif key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise self._violation("SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1", FLOW_CONTROL_ERROR)
                delta, self._peer_initial_window = value - self._peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise self._violation("a stream's send window above 2^31-1", FLOW_CONTROL_ERROR)
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise self._violation(f"SETTINGS_MAX_FRAME_SIZE {value} out of range")
                self.max_outbound_frame_size = value
            elif key == ENABLE_PUSH and value != 0:  # RFC 9113 6.5.2: never from a server
                raise self._violation(f"SETTINGS_ENABLE_PUSH {value} from the server")
            elif key == MAX_HEADER_LIST_SIZE:
                self.peer_max_header_list = value
            elif key == HEADER_TABLE_SIZE and value < self._table_size:  # (we never index into it)
                self._table_size = value
                self._table_update = _integer(value, 5, 0x20)  # a dynamic table size update
            # others: advisory or unknown
        self._frame(SETTINGS, ACK, 0)
        self._settings_seen = True
        events.append(RemoteSettingsChanged(self.max_concurrent_streams))

    def _on_ping(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid != 0:
            raise self._violation("PING on a stream")
        if len(payload) != 8:
            raise self._violation("a PING of the wrong size", FRAME_SIZE_ERROR)
        if flags & ACK:
            events.append(PingAckReceived(payload))
        else:
            self._frame(PING, ACK, 0, payload)

    def _on_goaway(self, sid: int, payload: bytes, events: list[Event]) -> None:
        if sid != 0:
            raise self._violation("GOAWAY on a stream")
        if len(payload) < 8:
            raise self._violation("a GOAWAY shorter than 8 bytes", FRAME_SIZE_ERROR)
        self.goaway_received = True
        last, code = _U32.unpack_from(payload, 0)[0] & LAST_STREAM_ID, _U32.unpack_from(payload, 4)[0]
        events.append(ConnectionTerminated(last, code))


def _unpad(payload: bytes) -> bytes | None:
    """A PADDED frame's payload without its padding; None when the padding does not fit."""
    if not payload or payload[0] >= len(payload):
        return None
    return payload[1 : len(payload) - payload[0]]


__all__ = [
    "PREFACE",
    "ClientConnection",
    "ConnectionTerminated",
    "DataReceived",
    "Event",
    "H2Error",
    "HeadersTooLarge",
    "InformationalResponseReceived",
    "PingAckReceived",
    "ProtocolViolation",
    "RemoteSettingsChanged",
    "ResponseReceived",
    "StreamBroken",
    "StreamEnded",
    "StreamReset",
    "StreamUnavailable",
    "TrailersReceived",
    "WindowUpdated",
]

"""``h2_client.ClientConnection``: the I/O-free HTTP/2 client connection of the trio Generate
transport (RFC 9113), tested in memory.

Interoperability runs against the ``h2`` library as the server peer (bytes moved between the two
objects, no sockets); what h2 cannot be made to send (bad frames, split header blocks, floods)
is built by hand with :func:`frame` and an ``hpack.Encoder`` that indexes into the dynamic
table as a real server would.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.openengine.transport import http2 as h2_client
from sidecar.openengine.transport.http2 import (
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ClientConnection,
    ConnectionTerminated,
    DataReceived,
    HeadersTooLarge,
    InformationalResponseReceived,
    PingAckReceived,
    ProtocolViolation,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamBroken,
    StreamEnded,
    StreamReset,
    StreamUnavailable,
    TrailersReceived,
    WindowUpdated,
)

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/openengine.v1.Engine/Generate"),
    (b":authority", b"engine"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc+proto"),
    (b"user-agent", b"openengine-sidecar/test"),
]
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
TRAILERS = [(b"grpc-status", b"0"), (b"grpc-message", b"")]
Codes = h2.settings.SettingCodes


# -- frames by hand -------------------------------------------------------------------------------


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame's bytes."""
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def setting(key: int, value: int) -> bytes:
    return struct.pack(">HI", key, value)


def u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def parse(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """``data`` (our output, the preface skipped) as (type, flags, stream id, payload) frames."""
    data = data.removeprefix(PREFACE)
    frames = []
    while data:
        n = int.from_bytes(data[:3], "big")
        assert len(data) >= 9 + n, "a truncated frame"
        frames.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9 : 9 + n]))
        data = data[9 + n :]
    return frames


def window_updates(data: bytes) -> list[tuple[int, int]]:
    """The (stream id, increment) of each WINDOW_UPDATE in ``data``."""
    return [(sid, int.from_bytes(p, "big")) for t, _, sid, p in parse(data) if t == WINDOW_UPDATE]


def describe(event: Any) -> tuple[Any, ...]:
    """An event as comparable values: its class, then its ``__slots__`` in their (alphabetical)
    order; the events have no ``__eq__``."""
    values = (getattr(event, name) for name in type(event).__slots__)
    return (type(event), *(list(v) if isinstance(v, tuple) else v for v in values))


def opened(**kwargs: Any) -> tuple[ClientConnection, hpack.Encoder]:
    """A client past the handshake (an empty server SETTINGS, and the server's acknowledgement
    of ours) with stream 1 open and answered (response headers received) and stream 3 open and
    unanswered; the server's HPACK encoder."""
    conn = ClientConnection(**kwargs)
    conn.initiate_connection()
    handshake = frame(SETTINGS, 0, 0) + frame(SETTINGS, h2_client.ACK, 0)
    assert [type(e) for e in conn.receive_data(handshake)] == [RemoteSettingsChanged]
    conn.send_headers(1, REQUEST, end_stream=True)
    conn.send_headers(3, REQUEST, end_stream=True)
    encoder = hpack.Encoder()
    [event] = conn.receive_data(frame(HEADERS, END_HEADERS, 1, encoder.encode(RESPONSE)))
    assert isinstance(event, ResponseReceived)
    conn.data_to_send()
    return conn, encoder


def test_repeated_header_block_follows_the_dynamic_table() -> None:
    """A block of one-byte indexed fields is decoded once and then reused, but only while the
    dynamic table is unchanged: after a block that inserts a field (shifting the dynamic
    indexes) the same bytes mean the new table's fields."""
    conn, encoder = opened()
    conn.send_headers(5, REQUEST, end_stream=True)
    conn.send_headers(7, REQUEST, end_stream=True)
    conn.send_headers(9, REQUEST, end_stream=True)
    head = [(b":status", b"200"), (b"x-engine", b"a")]
    first = encoder.encode(head)  # inserts x-engine: a (dynamic index 62)
    again = encoder.encode(head)  # all indexed now: one byte per field
    assert again == bytes([0x88, 0x80 | 62])
    [e1] = conn.receive_data(frame(HEADERS, END_HEADERS, 3, first))
    [e2] = conn.receive_data(frame(HEADERS, END_HEADERS, 5, again))
    assert list(e1.headers) == list(e2.headers) == head
    inserting = encoder.encode([(b":status", b"200"), (b"x-engine", b"b")])  # b at 62, a at 63
    [e3] = conn.receive_data(frame(HEADERS, END_HEADERS, 7, inserting))
    assert list(e3.headers) == [(b":status", b"200"), (b"x-engine", b"b")]
    [e4] = conn.receive_data(frame(HEADERS, END_HEADERS, 9, again))
    assert list(e4.headers) == [(b":status", b"200"), (b"x-engine", b"b")]


# -- our client with h2 as the server -------------------------------------------------------------


class Peer:
    """A ``ClientConnection`` and an h2 server connection, bytes moved between them in memory."""

    def __init__(self, **kwargs: Any) -> None:
        self.client = ClientConnection(**kwargs)
        self.server = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.client.initiate_connection()
        self.server.initiate_connection()

    def to_server(self) -> list[Any]:
        """Our queued bytes into h2: its events."""
        return self.server.receive_data(self.client.data_to_send())

    def to_client(self) -> list[Any]:
        """h2's queued bytes into ours: our events."""
        return self.client.receive_data(self.server.data_to_send())

    def settle(self) -> tuple[list[Any], list[Any]]:
        """Move bytes both ways until neither side has any: (our events, h2's events)."""
        ours: list[Any] = []
        theirs: list[Any] = []
        while True:
            out = self.client.data_to_send()
            if out:
                theirs += self.server.receive_data(out)
            back = self.server.data_to_send()
            if back:
                ours += self.client.receive_data(back)
            if not out and not back:
                return ours, theirs

    def request(self, headers: list[tuple[bytes, bytes]] = REQUEST, body: bytes = b"") -> int:
        """Open the next stream with ``headers`` and ``body`` (END_STREAM) and deliver them."""
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, headers, end_stream=not body)
        if body:
            self.client.send_data(sid, body, end_stream=True)
        self.to_server()
        return sid


@pytest.fixture
def peer() -> Peer:
    peer = Peer(stream_window=65_536)
    peer.settle()
    return peer


def test_settings_exchanged_both_ways() -> None:
    """The preface and SETTINGS go both ways: h2 applies and acknowledges ours (stream window,
    no push, header list limit); we apply h2's, acknowledge them (h2 sees the ACK) and report its
    MAX_CONCURRENT_STREAMS."""
    peer = Peer(stream_window=65_536, max_header_list=50_000)
    theirs = peer.to_server()
    changed = [e for e in theirs if isinstance(e, h2.events.RemoteSettingsChanged)]
    assert len(changed) == 1
    assert {k: v.new_value for k, v in changed[0].changed_settings.items()} == {
        Codes.ENABLE_PUSH: 0,
        Codes.INITIAL_WINDOW_SIZE: 65_536,
        Codes.MAX_HEADER_LIST_SIZE: 50_000,
    }
    from_server = peer.server.data_to_send()
    kinds = [(t, flags) for t, flags, _, _ in parse(from_server)]
    assert (SETTINGS, 0) in kinds and (SETTINGS, h2_client.ACK) in kinds  # h2's, and its ACK of ours
    ours = peer.client.receive_data(from_server)
    assert [type(e) for e in ours] == [RemoteSettingsChanged]
    assert ours[0].max_concurrent_streams == 100 == peer.server.local_settings.max_concurrent_streams
    ack = peer.client.data_to_send()
    assert parse(ack) == [(SETTINGS, h2_client.ACK, 0, b"")]
    assert [type(e) for e in peer.server.receive_data(ack)] == [h2.events.SettingsAcknowledged]
    assert peer.server.remote_settings.initial_window_size == 65_536


def test_grpc_call_round_trip(peer: Peer) -> None:
    """A full call: h2 decodes exactly our request headers and DATA (END_STREAM); its response
    headers, several DATA frames (one padded) and trailers come out as our events in order, with
    each DATA's flow-controlled length; the stream is gone after the trailers."""
    client, server = peer.client, peer.server
    sid = client.get_next_available_stream_id()
    assert sid == 1
    client.send_headers(sid, REQUEST)
    body = b"\x00\x00\x00\x00\x05hello"
    client.send_data(sid, body, end_stream=True)
    received = peer.to_server()
    assert [type(e) for e in received] == [
        h2.events.RequestReceived,
        h2.events.DataReceived,
        h2.events.StreamEnded,
    ]
    assert received[0].headers == REQUEST
    assert received[1].data == body
    server.send_headers(sid, RESPONSE)
    server.send_data(sid, b"a" * 10)
    server.send_data(sid, b"b" * 3000, pad_length=20)
    server.send_data(sid, b"c")
    server.send_headers(sid, TRAILERS, end_stream=True)
    events = peer.to_client()
    assert [describe(e) for e in events] == [
        (ResponseReceived, RESPONSE, False, sid),
        (DataReceived, b"a" * 10, 10, sid),
        (DataReceived, b"b" * 3000, 3021, sid),
        (DataReceived, b"c", 1, sid),
        (TrailersReceived, TRAILERS, sid),
    ]
    assert sid not in client.streams


def test_trailers_only_response(peer: Peer) -> None:
    """Response headers with END_STREAM (a gRPC error without messages): one ResponseReceived
    with stream_ended, and the stream is gone."""
    sid = peer.request()
    headers = [*RESPONSE, (b"grpc-status", b"5"), (b"grpc-message", b"not found")]
    peer.server.send_headers(sid, headers, end_stream=True)
    assert [describe(e) for e in peer.to_client()] == [(ResponseReceived, headers, True, sid)]
    assert sid not in peer.client.streams


def test_stream_reset_by_server(peer: Peer) -> None:
    """h2's RST_STREAM reaches us as StreamReset with its code; the stream is gone."""
    sid = peer.request()
    peer.server.send_headers(sid, RESPONSE)
    peer.server.reset_stream(sid, error_code=7)
    events = peer.to_client()
    assert [describe(e) for e in events] == [
        (ResponseReceived, RESPONSE, False, sid),
        (StreamReset, 7, sid),
    ]
    assert sid not in peer.client.streams


def test_our_reset_reaches_server(peer: Peer) -> None:
    """Our reset_stream reaches h2 as StreamReset with our code; the stream leaves ``streams``."""
    sid = peer.request()
    peer.client.reset_stream(sid, 8)
    assert sid not in peer.client.streams
    [event] = peer.to_server()
    assert isinstance(event, h2.events.StreamReset)
    assert (event.stream_id, event.error_code, event.remote_reset) == (sid, 8, True)


def test_ping_both_directions(peer: Peer) -> None:
    """h2's PING is answered (we queue the ACK, no event); our PING comes back as
    PingAckReceived with our payload."""
    peer.server.ping(b"12345678")
    assert peer.to_client() == []
    [ack] = peer.to_server()
    assert isinstance(ack, h2.events.PingAckReceived)
    assert ack.ping_data == b"12345678"
    peer.client.ping(b"abcdefgh")
    assert [type(e) for e in peer.to_server()] == [h2.events.PingReceived]
    assert [describe(e) for e in peer.to_client()] == [(PingAckReceived, b"abcdefgh")]


def test_goaway_from_server(peer: Peer) -> None:
    """h2's GOAWAY: ConnectionTerminated with its last stream id and code; no new stream after."""
    peer.request()
    peer.request()
    peer.server.close_connection(error_code=2, last_stream_id=1)
    assert [describe(e) for e in peer.to_client()] == [(ConnectionTerminated, 2, 1)]
    with pytest.raises(StreamUnavailable):
        peer.client.send_headers(peer.client.get_next_available_stream_id(), REQUEST)
    # stream 1, which the server processes, still gets its answer (h2 is closed: by hand)
    assert [describe(e) for e in peer.client.receive_data(frame(HEADERS, END_HEADERS, 1, b"\x88"))] == [
        (ResponseReceived, [(b":status", b"200")], False, 1)
    ]


def test_our_goaway_reaches_server(peer: Peer) -> None:
    """Our close_connection reaches h2 as ConnectionTerminated (code, last stream 0); nothing
    more is parsed on our side."""
    peer.request()
    peer.client.close_connection(0)
    [event] = peer.to_server()
    assert isinstance(event, h2.events.ConnectionTerminated)
    assert (event.error_code, event.last_stream_id) == (0, 0)
    assert peer.client.receive_data(frame(HEADERS, END_HEADERS, 1, b"\x88")) == []
    with pytest.raises(StreamUnavailable):
        peer.client.send_headers(3, REQUEST)


def _call_headers(i: int) -> list[tuple[bytes, bytes]]:
    """Call ``i``'s request headers: varying timeout, metadata names and values of varying
    lengths (past 127 bytes, the length's one-byte limit), a static-table name and a static exact
    match, 14 values new per call (4,200 in all: the per-connection encode cache fills and
    restarts)."""
    headers = list(REQUEST)
    if i % 3:
        headers.append((b"grpc-timeout", f"{i * 7 % 1000}m".encode()))
    headers.append((b"x-request-id", f"req-{i}".encode()))
    headers.append((b"x-" + b"k" * (i % 150), b"v" * (i * 13 % 260)))
    headers.append((b"x-same", b"same"))
    headers.append((b"accept-encoding", b"gzip, deflate" if i % 2 else f"enc-{i % 5}".encode()))
    headers += [(f"x-u{j}".encode(), f"{i}".encode()) for j in range(14)]
    return headers


def test_many_calls_on_one_connection(peer: Peer) -> None:
    """300 calls on one connection, the header list varying per call: h2 decodes every request
    header list exactly as sent (the encode cache never gives stale bytes), and our decoder
    follows h2's dynamic-table-indexed responses (repeated, new and evicting fields) across all
    of them."""
    client, server = peer.client, peer.server
    for i in range(300):
        sent = _call_headers(i)
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, sent)
        client.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
        received = peer.to_server()
        assert isinstance(received[0], h2.events.RequestReceived)
        assert received[0].headers == sent, f"call {i}"
        response = [*RESPONSE, (b"x-resp", f"{i % 7}".encode()), (b"x-big", b"z" * (500 + i % 5))]
        trailers = [(b"grpc-status", b"0"), (b"grpc-message", f"done {i % 13}".encode())]
        server.send_headers(sid, response)
        server.send_data(sid, b"\x00\x00\x00\x00\x00")
        server.send_headers(sid, trailers, end_stream=True)
        server.acknowledge_received_data(5, sid)
        events = peer.to_client()
        assert [describe(e) for e in events] == [
            (ResponseReceived, response, False, sid),
            (DataReceived, b"\x00" * 5, 5, sid),
            (TrailersReceived, trailers, sid),
        ], f"call {i}"
        client.acknowledge_received_data(5, sid)
    assert client.streams == {}
    assert server.open_inbound_streams == 0


# -- flow control ---------------------------------------------------------------------------------


def test_inbound_stream_window_and_acknowledgements() -> None:
    """The server may send exactly our stream window (65,536) on a stream and no more until we
    acknowledge; a stream WINDOW_UPDATE is queued once half the window is consumed, and h2's
    window for the stream grows by it."""
    peer = Peer(stream_window=65_536)
    peer.settle()
    peer.client.increment_flow_control_window(1_000_000)  # the connection window is not the limit
    sid = peer.request()
    server = peer.server
    server.send_headers(sid, RESPONSE)
    assert server.local_flow_control_window(sid) == 65_536
    for _ in range(4):
        server.send_data(sid, b"x" * 16_384)
    assert server.local_flow_control_window(sid) == 0
    with pytest.raises(h2.exceptions.FlowControlError):
        server.send_data(sid, b"x")
    events = peer.to_client()
    assert sum(e.flow_controlled_length for e in events if isinstance(e, DataReceived)) == 65_536
    peer.client.acknowledge_received_data(32_767, sid)
    assert window_updates(peer.client.data_to_send()) == []  # below half the stream window
    peer.client.acknowledge_received_data(1, sid)
    first = peer.client.data_to_send()
    assert window_updates(first) == [(sid, 32_768)]
    peer.client.acknowledge_received_data(32_768, sid)
    updates = [
        e
        for e in server.receive_data(first + peer.client.data_to_send())
        if isinstance(e, h2.events.WindowUpdated)
    ]
    assert [(e.stream_id, e.delta) for e in updates] == [(sid, 32_768), (sid, 32_768)]
    assert server.local_flow_control_window(sid) == 65_536


def test_inbound_connection_window_and_increment() -> None:
    """The connection window (65,535 until increment_flow_control_window grows it) bounds the
    server across streams; acknowledged bytes come back as connection WINDOW_UPDATEs once half a
    window is due, and h2 sees the exact window."""
    peer = Peer(stream_window=65_536)
    peer.settle()
    server = peer.server
    first, second = peer.request(), peer.request()
    server.send_headers(first, RESPONSE)
    server.send_headers(second, RESPONSE)
    server.send_data(first, b"x" * 16_384)
    server.send_data(first, b"x" * 16_384)
    server.send_data(second, b"y" * 16_384)
    server.send_data(second, b"y" * 16_383)
    assert server.outbound_flow_control_window == 0
    peer.to_client()
    client = peer.client
    sent = b""

    def take() -> list[tuple[int, int]]:
        nonlocal sent
        out = client.data_to_send()
        sent += out
        return window_updates(out)

    client.acknowledge_received_data(16_384, first)
    assert take() == []
    client.acknowledge_received_data(16_384, second)  # 32,768 >= 65,535 // 2
    assert take() == [(0, 32_768)]
    client.acknowledge_received_data(16_384, first)  # and stream 1: 32,768 of 65,536
    assert take() == [(first, 32_768)]
    client.acknowledge_received_data(16_383, second)
    assert take() == [(0, 32_767)]
    client.increment_flow_control_window(100_000)
    assert take() == [(0, 100_000)]
    updates = [e for e in server.receive_data(sent) if isinstance(e, h2.events.WindowUpdated)]
    assert [(e.stream_id, e.delta) for e in updates] == [
        (0, 32_768),
        (first, 32_768),
        (0, 32_767),
        (0, 100_000),
    ]
    assert server.outbound_flow_control_window == 165_535
    assert server.local_flow_control_window(first) == 65_536
    assert server.local_flow_control_window(second) == 32_769
    with pytest.raises(ValueError):
        peer.client.increment_flow_control_window(0)
    with pytest.raises(ValueError):
        peer.client.increment_flow_control_window(2**31)


def test_outbound_body_beyond_the_peer_window(peer: Peer) -> None:
    """A request body larger than h2's windows: local_flow_control_window stops it at 65,535;
    h2's WINDOW_UPDATEs come as WindowUpdated and the rest may go; h2 gets the whole body."""
    client, server = peer.client, peer.server
    body = bytes(range(256)) * 400  # 102,400 bytes
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, REQUEST)
    sent = 0
    while (n := min(client.local_flow_control_window(sid), client.max_outbound_frame_size)) > 0:
        client.send_data(sid, body[sent : sent + n])
        sent += n
    assert sent == 65_535
    with pytest.raises(StreamUnavailable):
        client.send_data(sid, b"x")
    received = b"".join(e.data for e in peer.to_server() if isinstance(e, h2.events.DataReceived))
    assert received == body[:sent]
    server.increment_flow_control_window(50_000)
    server.increment_flow_control_window(40_000, stream_id=sid)
    events = peer.to_client()
    assert [type(e) for e in events] == [WindowUpdated, WindowUpdated]
    assert client.local_flow_control_window(sid) == 40_000
    while sent < len(body):
        n = min(client.local_flow_control_window(sid), client.max_outbound_frame_size, len(body) - sent)
        assert n > 0
        client.send_data(sid, body[sent : sent + n], end_stream=sent + n == len(body))
        sent += n
    events = peer.to_server()
    received += b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert received == body
    assert isinstance(events[-1], h2.events.StreamEnded)


def test_initial_window_size_change_moves_open_streams(peer: Peer) -> None:
    """The server's SETTINGS_INITIAL_WINDOW_SIZE moves an open stream's send window by the delta
    (up, then down below zero: nothing may be sent), and a new stream starts at the new value."""
    client, server = peer.client, peer.server
    server.increment_flow_control_window(1_000_000)  # the connection window is not the limit
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, REQUEST)
    client.send_data(sid, b"x" * 1_000)
    peer.settle()
    assert client.local_flow_control_window(sid) == 64_535
    server.update_settings({Codes.INITIAL_WINDOW_SIZE: 100_000})
    assert [type(e) for e in peer.to_client()] == [RemoteSettingsChanged]
    assert client.local_flow_control_window(sid) == 99_000
    assert [type(e) for e in peer.to_server()] == [h2.events.SettingsAcknowledged]
    server.update_settings({Codes.INITIAL_WINDOW_SIZE: 500})
    peer.to_client()
    assert client.local_flow_control_window(sid) == -500
    with pytest.raises(StreamUnavailable):
        client.send_data(sid, b"x")
    peer.to_server()
    other = client.get_next_available_stream_id()
    client.send_headers(other, REQUEST)
    assert client.local_flow_control_window(other) == 500
    client.send_data(other, b"y" * 500, end_stream=True)
    events = peer.to_server()
    assert [type(e) for e in events] == [
        h2.events.RequestReceived,
        h2.events.DataReceived,
        h2.events.StreamEnded,
    ]


def test_max_frame_size_follows_the_server(peer: Peer) -> None:
    """The server's SETTINGS_MAX_FRAME_SIZE becomes max_outbound_frame_size: a 20,000-byte DATA
    frame, refused before, then goes in one frame and h2 accepts it."""
    client, server = peer.client, peer.server
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, REQUEST)
    assert client.max_outbound_frame_size == 16_384
    with pytest.raises(StreamUnavailable):
        client.send_data(sid, b"z" * 20_000)
    server.update_settings({Codes.MAX_FRAME_SIZE: 32_768})
    peer.to_client()
    peer.to_server()  # our ACK (h2 raises its own frame limit per receive_data call, after an ACK)
    assert client.max_outbound_frame_size == 32_768
    client.send_data(sid, b"z" * 20_000, end_stream=True)
    data = client.data_to_send()
    assert [len(p) for t, _, _, p in parse(data) if t == DATA] == [20_000]
    events = peer.server.receive_data(data)
    assert [(type(e), len(getattr(e, "data", b""))) for e in events][-2:] == [
        (h2.events.DataReceived, 20_000),
        (h2.events.StreamEnded, 0),
    ]


def test_header_table_size_reduction_is_signalled(peer: Peer) -> None:
    """When the server lowers SETTINGS_HEADER_TABLE_SIZE below the 4,096 bytes our encoder's
    table may use, the next request's header block starts with a dynamic table size update to
    the new size (RFC 7541 4.2: decoders such as nghttp2's require it), once; h2 decodes both."""
    client = peer.client
    peer.server.update_settings({Codes.HEADER_TABLE_SIZE: 100})
    peer.to_client()
    peer.to_server()
    blocks = []
    for _ in range(2):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, REQUEST, end_stream=True)
        data = client.data_to_send()
        blocks += [p for t, _, _, p in parse(data) if t == HEADERS]
        received = peer.server.receive_data(data)
        assert received[0].headers == REQUEST
    plain = b"".join(h2_client.encode_header(*f) for f in REQUEST)
    assert blocks == [bytes((0x3F, 100 - 31)) + plain, plain]
    peer.server.update_settings({Codes.HEADER_TABLE_SIZE: 4_096})  # up again: nothing to signal
    peer.to_client()
    client.send_headers(client.get_next_available_stream_id(), REQUEST, end_stream=True)
    assert [p for t, _, _, p in parse(client.data_to_send()) if t == HEADERS] == [plain]


# -- large header blocks --------------------------------------------------------------------------


def test_large_request_headers_use_continuation(peer: Peer) -> None:
    """A request header list larger than the peer's frame size goes as HEADERS (END_STREAM, no
    END_HEADERS) and CONTINUATION frames (END_HEADERS on the last); h2 decodes it whole."""
    headers = [*REQUEST, (b"x-big", b"v" * 40_000), (b"x-after", b"1")]
    peer.client.send_headers(1, headers, end_stream=True)
    data = peer.client.data_to_send()
    assert [(t, f) for t, f, _, _ in parse(data)] == [
        (HEADERS, END_STREAM),
        (CONTINUATION, 0),
        (CONTINUATION, END_HEADERS),
    ]
    assert all(len(p) <= 16_384 for _, _, _, p in parse(data))
    events = peer.server.receive_data(data)
    assert [type(e) for e in events] == [h2.events.RequestReceived, h2.events.StreamEnded]
    assert events[0].headers == headers


def _chunks(data: bytes, seed: int) -> list[bytes]:
    """``data`` cut at random places (1 to 97 bytes a piece)."""
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, 97)
        out.append(data[pos : pos + n])
        pos += n
    return out


def test_response_header_block_in_continuations() -> None:
    """Response headers and trailers the server splits into HEADERS + CONTINUATION frames, fed
    in chunks of arbitrary size, are decoded whole, DATA between them accepted, and the trailers'
    END_STREAM (on their HEADERS frame) ends the stream."""
    conn, encoder = opened()
    headers = [(b":status", b"200"), (b"x-big", b"q" * 30_000), (b"x-small", b"s")]
    block = encoder.encode(headers)
    parts = [block[:10_000], block[10_000:20_000], block[20_000:]]
    wire = (
        frame(HEADERS, 0, 3, parts[0])
        + frame(CONTINUATION, 0, 3, parts[1])
        + frame(CONTINUATION, END_HEADERS, 3, parts[2])
        + frame(DATA, 0, 3, b"abc")
    )
    trailers = [(b"grpc-status", b"0"), (b"grpc-message", b"m" * 20_000)]
    block = encoder.encode(trailers)
    wire += frame(HEADERS, END_STREAM, 3, block[:16_000]) + frame(
        CONTINUATION, END_HEADERS, 3, block[16_000:]
    )
    events = []
    for chunk in _chunks(wire, seed=1):
        events += conn.receive_data(bytearray(chunk))  # (trio may hand over a bytearray)
    assert [describe(e) for e in events] == [
        (ResponseReceived, headers, False, 3),
        (DataReceived, b"abc", 3, 3),
        (TrailersReceived, trailers, 3),  # END_STREAM came on the HEADERS frame
    ]
    assert 3 not in conn.streams


def _assert_violation(conn: ClientConnection, wire: bytes, code: int) -> None:
    """``wire`` raises ProtocolViolation with ``code``, a GOAWAY with that code is queued, and
    the connection parses nothing more."""
    with pytest.raises(ProtocolViolation) as caught:
        conn.receive_data(wire)
    assert caught.value.code == code, caught.value
    frames = parse(conn.data_to_send())
    assert frames[-1] == (GOAWAY, 0, 0, u32(0) + u32(code))
    assert conn.closed
    assert conn.receive_data(frame(PING, 0, 0, b"8 bytes!")) == []
    assert conn.data_to_send() == b""  # no PING ACK: nothing was parsed


def test_continuation_flood_is_refused() -> None:
    """CONTINUATION frames piling a header block above max_header_list: ENHANCE_YOUR_CALM, before
    the block is decoded."""
    conn, _ = opened()
    wire = frame(HEADERS, 0, 3, b"\x00" * 16_384) + frame(CONTINUATION, 0, 3, b"\x00" * 16_384) * 4
    _assert_violation(conn, wire, ENHANCE_YOUR_CALM)


def test_empty_continuation_flood_is_refused() -> None:
    """Empty CONTINUATION frames without END_HEADERS also count against max_header_list (each
    frame's 9-byte header): an endless run of them cannot grow the pending block forever."""
    conn, _ = opened(max_header_list=1_000)
    wire = frame(HEADERS, 0, 3, b"") + frame(CONTINUATION, 0, 3) * 200
    _assert_violation(conn, wire, ENHANCE_YOUR_CALM)


# -- byte splitting -------------------------------------------------------------------------------


def _transcript_client() -> ClientConnection:
    conn = ClientConnection(stream_window=65_536)
    conn.initiate_connection()
    for sid in (1, 3, 5):
        conn.send_headers(sid, REQUEST, end_stream=True)
    return conn


def test_one_byte_at_a_time_gives_the_same_events() -> None:
    """A whole server transcript (preface SETTINGS, responses, padded DATA, trailers, a reset,
    a trailers-only response, a PING, a WINDOW_UPDATE, a SETTINGS change, a split header block,
    GOAWAY) fed one byte at a time gives the same events and the same answers as fed at once."""
    whole = _transcript_client()
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    server.receive_data(whole.data_to_send())
    server.send_headers(1, RESPONSE)
    server.send_headers(3, [*RESPONSE, (b"x-big", b"b" * 40_000)])  # h2 splits it (CONTINUATION)
    server.send_data(1, b"one" * 100, pad_length=7)
    server.send_data(3, b"three")
    server.ping(b"pingpong")
    server.increment_flow_control_window(1_234)
    server.update_settings({Codes.MAX_CONCURRENT_STREAMS: 7, Codes.INITIAL_WINDOW_SIZE: 70_000})
    server.send_headers(1, TRAILERS, end_stream=True)
    server.reset_stream(3, error_code=2)
    server.send_headers(5, [*RESPONSE, (b"grpc-status", b"13")], end_stream=True)
    server.close_connection(error_code=0, last_stream_id=5)
    transcript = server.data_to_send()
    assert any(t == CONTINUATION for t, _, _, _ in parse(PREFACE + transcript))

    at_once = [describe(e) for e in whole.receive_data(transcript)]
    answers = whole.data_to_send()  # SETTINGS and PING acknowledgements
    split = _transcript_client()
    split.data_to_send()  # the preface and requests (the server saw whole's)
    byte_events = []
    for i in range(len(transcript)):
        byte_events += [describe(e) for e in split.receive_data(transcript[i : i + 1])]
    assert byte_events == at_once
    assert split.data_to_send() == answers
    assert [t for t, _, _, _ in parse(answers)] == [SETTINGS, PING, SETTINGS]
    assert [d[0] for d in at_once].count(DataReceived) == 2
    assert (ConnectionTerminated, 0, 5) in at_once


# -- protocol violations --------------------------------------------------------------------------

VIOLATIONS: list[tuple[str, dict[str, Any], Callable[[hpack.Encoder], bytes], int]] = [
    ("frame above 16384", {}, lambda e: frame(DATA, 0, 1, b"x" * 16_385), FRAME_SIZE_ERROR),
    (
        "DATA beyond the connection window",
        {"stream_window": 2**20},
        lambda e: frame(DATA, 0, 1, b"x" * 16_384) * 4,
        FLOW_CONTROL_ERROR,
    ),
    ("DATA on stream 0", {}, lambda e: frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    ("DATA on an even stream", {}, lambda e: frame(DATA, 0, 2, b"x"), PROTOCOL_ERROR),
    ("DATA on an idle stream", {}, lambda e: frame(DATA, 0, 5, b"x"), PROTOCOL_ERROR),
    ("HEADERS on stream 0", {}, lambda e: frame(HEADERS, END_HEADERS, 0, e.encode(RESPONSE)), PROTOCOL_ERROR),
    ("HEADERS on an even stream", {}, lambda e: frame(HEADERS, END_HEADERS, 2, b"\x88"), PROTOCOL_ERROR),
    ("HEADERS on an idle stream", {}, lambda e: frame(HEADERS, END_HEADERS, 7, b"\x88"), PROTOCOL_ERROR),
    ("PUSH_PROMISE", {}, lambda e: frame(PUSH_PROMISE, END_HEADERS, 1, u32(2) + b"\x82"), PROTOCOL_ERROR),
    (
        "CONTINUATION without HEADERS",
        {},
        lambda e: frame(CONTINUATION, END_HEADERS, 3, b"\x88"),
        PROTOCOL_ERROR,
    ),
    (
        "header block interrupted by another frame",
        {},
        lambda e: frame(HEADERS, 0, 3, b"\x88") + frame(PING, 0, 0, b"12345678"),
        PROTOCOL_ERROR,
    ),
    (
        "CONTINUATION on another stream",
        {},
        lambda e: frame(HEADERS, 0, 3, b"\x88") + frame(CONTINUATION, END_HEADERS, 1, b""),
        PROTOCOL_ERROR,
    ),
    (
        "WINDOW_UPDATE of 0 on the connection",
        {},
        lambda e: frame(WINDOW_UPDATE, 0, 0, u32(0)),
        PROTOCOL_ERROR,
    ),
    (
        "connection WINDOW_UPDATE above 2^31-1",
        {},
        lambda e: frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 1 - 65_535 + 1)),
        FLOW_CONTROL_ERROR,
    ),
    (
        "WINDOW_UPDATE of the wrong size",
        {},
        lambda e: frame(WINDOW_UPDATE, 0, 0, b"\x00\x01"),
        FRAME_SIZE_ERROR,
    ),
    ("SETTINGS of a bad length", {}, lambda e: frame(SETTINGS, 0, 0, b"\x00" * 5), FRAME_SIZE_ERROR),
    (
        "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1",
        {},
        lambda e: frame(SETTINGS, 0, 0, setting(4, 2**31)),
        FLOW_CONTROL_ERROR,
    ),
    (
        "SETTINGS_INITIAL_WINDOW_SIZE overflowing an open stream's window",
        {},
        lambda e: (
            frame(WINDOW_UPDATE, 0, 1, u32(2**31 - 1 - 65_535)) + frame(SETTINGS, 0, 0, setting(4, 65_536))
        ),
        FLOW_CONTROL_ERROR,
    ),
    (
        "SETTINGS_MAX_FRAME_SIZE below 16384",
        {},
        lambda e: frame(SETTINGS, 0, 0, setting(5, 16_383)),
        PROTOCOL_ERROR,
    ),
    (
        "SETTINGS_MAX_FRAME_SIZE above 2^24-1",
        {},
        lambda e: frame(SETTINGS, 0, 0, setting(5, 2**24)),
        PROTOCOL_ERROR,
    ),
    ("SETTINGS_ENABLE_PUSH 2", {}, lambda e: frame(SETTINGS, 0, 0, setting(2, 2)), PROTOCOL_ERROR),
    (
        "SETTINGS ACK with a payload",
        {},
        lambda e: frame(SETTINGS, h2_client.ACK, 0, setting(3, 1)),
        FRAME_SIZE_ERROR,
    ),
    ("SETTINGS on a stream", {}, lambda e: frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    ("PING of the wrong size", {}, lambda e: frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
    ("PING on a stream", {}, lambda e: frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR),
    (
        "RST_STREAM of the wrong size",
        {},
        lambda e: frame(RST_STREAM, 0, 1, b"\x00\x00\x08"),
        FRAME_SIZE_ERROR,
    ),
    ("RST_STREAM on an idle stream", {}, lambda e: frame(RST_STREAM, 0, 9, u32(8)), PROTOCOL_ERROR),
    ("RST_STREAM on stream 0", {}, lambda e: frame(RST_STREAM, 0, 0, u32(8)), PROTOCOL_ERROR),
    ("GOAWAY on a stream", {}, lambda e: frame(GOAWAY, 0, 1, u32(0) + u32(0)), PROTOCOL_ERROR),
    ("GOAWAY too short", {}, lambda e: frame(GOAWAY, 0, 0, u32(0)), FRAME_SIZE_ERROR),
    ("PRIORITY of the wrong size", {}, lambda e: frame(PRIORITY, 0, 1, b"\x00" * 4), FRAME_SIZE_ERROR),
    ("PRIORITY on stream 0", {}, lambda e: frame(PRIORITY, 0, 0, b"\x00" * 5), PROTOCOL_ERROR),
    (
        "undecodable HPACK: an index beyond both tables",
        {},
        lambda e: frame(HEADERS, END_HEADERS, 3, bytes((0x80 | 70,))),
        COMPRESSION_ERROR,
    ),
    (
        "undecodable HPACK: a truncated literal",
        {},
        lambda e: frame(HEADERS, END_HEADERS, 3, b"\x00\x05ab"),
        COMPRESSION_ERROR,
    ),
    (
        "decoded header list above max_header_list",
        {"max_header_list": 200},
        lambda e: frame(HEADERS, END_HEADERS, 3, e.encode([(b":status", b"200"), (b"x-big", b"b" * 300)])),
        ENHANCE_YOUR_CALM,
    ),
    ("DATA padding beyond the payload", {}, lambda e: frame(DATA, PADDED, 1, b"\x05abcd"), PROTOCOL_ERROR),
    ("DATA padding with no pad length", {}, lambda e: frame(DATA, PADDED, 1, b""), PROTOCOL_ERROR),
    (
        "HEADERS padding beyond the payload",
        {},
        lambda e: frame(HEADERS, END_HEADERS | PADDED, 3, b"\x09\x88"),
        PROTOCOL_ERROR,
    ),
    (
        "HEADERS too short for its priority",
        {},
        lambda e: frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 3, b"\x00\x00"),
        FRAME_SIZE_ERROR,
    ),
]


#: Stream errors (RFC 9113 5.4.2): (name, ClientConnection arguments, the broken frames, the
#: stream they break, the RST_STREAM code). Stream 1 is answered, stream 3 not (``opened``).
STREAM_ERRORS: list[tuple[str, dict[str, Any], Callable[[hpack.Encoder], bytes], int, int]] = [
    (
        "DATA beyond a stream window",
        {"stream_window": 1_000},
        lambda e: frame(DATA, 0, 1, b"x" * 1_001),
        1,
        FLOW_CONTROL_ERROR,
    ),
    (
        "DATA before response headers (RFC 9113 8.1.1)",
        {},
        lambda e: frame(DATA, 0, 3, b"x"),
        3,
        PROTOCOL_ERROR,
    ),
    (
        "trailers without END_STREAM (RFC 9113 8.1)",
        {},
        lambda e: frame(HEADERS, END_HEADERS, 1, e.encode(TRAILERS)),
        1,
        PROTOCOL_ERROR,
    ),
    (
        "WINDOW_UPDATE of 0 on a stream (RFC 9113 6.9)",
        {},
        lambda e: frame(WINDOW_UPDATE, 0, 1, u32(0)),
        1,
        PROTOCOL_ERROR,
    ),
    (
        "stream WINDOW_UPDATE above 2^31-1 (RFC 9113 6.9.1)",
        {},
        lambda e: frame(WINDOW_UPDATE, 0, 1, u32(2**31 - 1 - 65_535 + 1)),
        1,
        FLOW_CONTROL_ERROR,
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "build", "sid", "code"), [v[1:] for v in STREAM_ERRORS], ids=[v[0] for v in STREAM_ERRORS]
)
def test_stream_error_resets_that_stream_alone(
    kwargs: dict[str, Any], build: Callable[[hpack.Encoder], bytes], sid: int, code: int
) -> None:
    """A stream-level violation yields StreamBroken, queues RST_STREAM with its code (no
    GOAWAY) and forgets the stream; the connection and the other stream go on."""
    conn, encoder = opened(**kwargs)
    events = conn.receive_data(build(encoder))
    assert [(type(e), e.stream_id, e.error_code) for e in events if isinstance(e, StreamBroken)] == [
        (StreamBroken, sid, code)
    ]
    frames = parse(conn.data_to_send())
    assert (RST_STREAM, 0, sid, u32(code)) in frames and GOAWAY not in [t for t, _, _, _ in frames]
    assert not conn.closed and sid not in conn.streams
    other = 3 if sid == 1 else 1
    if other == 3:
        conn.receive_data(frame(HEADERS, END_HEADERS, 3, encoder.encode(RESPONSE)))
    assert [describe(e) for e in conn.receive_data(frame(DATA, 0, other, b"go on"))] == [
        (DataReceived, b"go on", 5, other)
    ]
    assert conn.receive_data(frame(PING, 0, 0, b"8 bytes!")) == []
    assert parse(conn.data_to_send())[-1] == (PING, h2_client.ACK, 0, b"8 bytes!")


def test_first_frame_must_be_settings() -> None:
    """RFC 9113 3.4: the server's preface is a SETTINGS frame; anything else first (here a PING,
    or a SETTINGS acknowledgement) is a connection error."""
    for first in (frame(PING, 0, 0, b"8 bytes!"), frame(SETTINGS, h2_client.ACK, 0)):
        conn = ClientConnection()
        conn.initiate_connection()
        conn.data_to_send()
        _assert_violation(conn, first, PROTOCOL_ERROR)


def test_enable_push_from_a_server_is_a_connection_error() -> None:
    """RFC 9113 6.5.2: a client treats SETTINGS_ENABLE_PUSH = 1 as a connection error; 0 is fine."""
    conn = ClientConnection()
    conn.initiate_connection()
    assert [type(e) for e in conn.receive_data(frame(SETTINGS, 0, 0, setting(2, 0)))] == [
        RemoteSettingsChanged
    ]
    other = ClientConnection()
    other.initiate_connection()
    other.data_to_send()
    _assert_violation(other, frame(SETTINGS, 0, 0, setting(2, 1)), PROTOCOL_ERROR)


def test_our_settings_apply_once_acknowledged() -> None:
    """Until the peer acknowledges our SETTINGS it may use the protocol's default window (65,535)
    for our streams: a smaller window of ours is not a violation then; from its acknowledgement on
    the stream's window is ours (what was received before counts against it)."""
    conn = ClientConnection(stream_window=1_000)
    conn.initiate_connection()
    conn.receive_data(frame(SETTINGS, 0, 0))
    conn.send_headers(1, REQUEST, end_stream=True)
    encoder = hpack.Encoder()
    events = conn.receive_data(
        frame(HEADERS, END_HEADERS, 1, encoder.encode(RESPONSE)) + frame(DATA, 0, 1, b"x" * 5_000)
    )
    assert [type(e) for e in events] == [ResponseReceived, DataReceived]
    assert conn.streams[1].recv_window == 65_535 - 5_000
    assert conn.receive_data(frame(SETTINGS, h2_client.ACK, 0)) == []
    assert conn.streams[1].recv_window == 1_000 - 5_000  # negative: no more DATA until updates
    [broken] = conn.receive_data(frame(DATA, 0, 1, b"y"))
    assert isinstance(broken, StreamBroken) and broken.error_code == FLOW_CONTROL_ERROR


def test_events_before_a_violation_are_handed_over() -> None:
    """What one read parsed before a connection error comes with the ProtocolViolation."""
    conn, _ = opened()
    wire = frame(DATA, 0, 1, b"ok") + frame(DATA, 0, 0, b"x")
    with pytest.raises(ProtocolViolation) as caught:
        conn.receive_data(wire)
    assert [describe(e) for e in caught.value.events] == [(DataReceived, b"ok", 2, 1)]


def test_a_stream_ended_while_its_request_is_being_sent_is_reset() -> None:
    """RFC 9113 8.1: a server may answer before the request is whole; the client then closes the
    stream with RST_STREAM(NO_ERROR) (here after trailers, after a trailers-only response, and
    after DATA with END_STREAM), so the server does not keep counting it."""
    for answer in ("trailers", "trailers-only", "data-end"):
        conn = ClientConnection()
        conn.initiate_connection()
        conn.receive_data(frame(SETTINGS, 0, 0))
        conn.send_headers(1, REQUEST)  # no END_STREAM: the body is still to come
        conn.data_to_send()
        encoder = hpack.Encoder()
        if answer == "trailers":
            wire = frame(HEADERS, END_HEADERS, 1, encoder.encode(RESPONSE))
            wire += frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode(TRAILERS))
        elif answer == "trailers-only":
            wire = frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode([*RESPONSE, *TRAILERS]))
        else:
            wire = frame(HEADERS, END_HEADERS, 1, encoder.encode(RESPONSE)) + frame(DATA, END_STREAM, 1, b"")
        conn.receive_data(wire)
        assert 1 not in conn.streams
        assert [f for f in parse(conn.data_to_send()) if f[0] == RST_STREAM] == [
            (RST_STREAM, 0, 1, u32(0))
        ], answer
    # a request already sent whole gets no RST_STREAM
    conn, encoder = opened()
    conn.receive_data(frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode(TRAILERS)))
    assert [f for f in parse(conn.data_to_send()) if f[0] == RST_STREAM] == []


def test_request_headers_over_the_peers_limit_are_refused() -> None:
    """A request header list over the peer's SETTINGS_MAX_HEADER_LIST_SIZE (counted as RFC 9113
    6.5.2 does: name + value + 32 per field) raises HeadersTooLarge; no stream is opened."""
    size = sum(len(n) + len(v) + 32 for n, v in REQUEST)
    conn = ClientConnection()
    conn.initiate_connection()
    conn.receive_data(frame(SETTINGS, 0, 0, setting(6, size)))
    conn.data_to_send()
    conn.send_headers(1, REQUEST)  # exactly at the limit
    with pytest.raises(HeadersTooLarge):
        conn.send_headers(3, [*REQUEST, (b"x", b"")])
    assert list(conn.streams) == [1] and conn.get_next_available_stream_id() == 3
    assert [t for t, _, _, _ in parse(conn.data_to_send())] == [HEADERS]


@pytest.mark.parametrize(
    ("kwargs", "build", "code"), [v[1:] for v in VIOLATIONS], ids=[v[0] for v in VIOLATIONS]
)
def test_protocol_violation(
    kwargs: dict[str, Any], build: Callable[[hpack.Encoder], bytes], code: int
) -> None:
    """Each broken frame raises ProtocolViolation with its HTTP/2 error code, queues a GOAWAY
    with that code, and leaves a connection that parses nothing more."""
    conn, encoder = opened(**kwargs)
    _assert_violation(conn, build(encoder), code)


def test_violation_mid_transcript_keeps_earlier_answers() -> None:
    """Frames before the violating one in the same read are applied (a PING is answered), and
    the GOAWAY follows their answers."""
    conn, _ = opened()
    with pytest.raises(ProtocolViolation):
        conn.receive_data(frame(PING, 0, 0, b"abcdefgh") + frame(DATA, 0, 0, b"x"))
    assert [(t, f) for t, f, _, _ in parse(conn.data_to_send())] == [(PING, h2_client.ACK), (GOAWAY, 0)]


# -- tolerated ------------------------------------------------------------------------------------


def test_frames_on_a_reset_stream_are_tolerated() -> None:
    """After our RST_STREAM, the server's DATA still in flight is dropped but credited to the
    connection window (a connection WINDOW_UPDATE, none for the stream), and its HEADERS are still
    decoded: a later block referring to the dynamic-table entry the dropped block inserted
    decodes correctly."""
    conn, encoder = opened()
    conn.reset_stream(1, 8)
    assert [t for t, _, _, _ in parse(conn.data_to_send())] == [RST_STREAM]
    events = conn.receive_data(frame(DATA, 0, 1, b"x" * 16_384))
    assert events == []
    assert window_updates(conn.data_to_send()) == []
    events = conn.receive_data(frame(DATA, PADDED, 1, b"\x02" + b"x" * 16_381 + b"\x00\x00"))
    assert events == []
    assert window_updates(conn.data_to_send()) == [(0, 32_768)]  # 65,535 // 2 reached
    added = [(b"x-added", b"by the dropped block")]
    assert conn.receive_data(frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode(added))) == []
    block = encoder.encode([(b":status", b"200"), *added])
    assert block == bytes((0x88, 0x80 | 62))  # :status 200 static, then the dynamic entry
    assert [describe(e) for e in conn.receive_data(frame(HEADERS, END_HEADERS, 3, block))] == [
        (ResponseReceived, [(b":status", b"200"), *added], False, 3)
    ]
    assert conn.receive_data(frame(RST_STREAM, 0, 1, u32(0)) + frame(WINDOW_UPDATE, 0, 1, u32(10))) == []
    assert not conn.closed


def test_frames_on_an_ended_stream_are_tolerated() -> None:
    """DATA after the trailers ended a stream is dropped and credited to the connection."""
    conn, encoder = opened()
    [event] = conn.receive_data(frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode(TRAILERS)))
    assert isinstance(event, TrailersReceived)
    assert conn.receive_data(frame(DATA, END_STREAM, 1, b"y" * 16_384) * 2) == []
    assert window_updates(conn.data_to_send()) == [(0, 32_768)]


def test_priority_and_unknown_frames_are_ignored() -> None:
    """PRIORITY frames (on an open and an idle stream) and frames of unknown types (on the
    connection and a stream) make no events and no error; the streams go on (a HEADERS frame
    with padding and priority fields is read past both)."""
    conn, _ = opened()
    wire = (
        frame(PRIORITY, 0, 1, b"\x00\x00\x00\x00\x10")
        + frame(PRIORITY, 0, 99, b"\x00\x00\x00\x01\x10")
        + frame(0x20, 0xFF, 0, b"whatever")
        + frame(0xFA, 0, 1, b"")
        + frame(DATA, 0, 1, b"ok")
        # padded, with priority fields: pad length, 5 priority bytes, the block, the padding
        + frame(
            HEADERS,
            END_HEADERS | PADDED | PRIORITY_FLAG,
            3,
            b"\x03" + b"\x00\x00\x00\x01\x10" + b"\x88" + b"\x00" * 3,
        )
    )
    assert [describe(e) for e in conn.receive_data(wire)] == [
        (DataReceived, b"ok", 2, 1),
        (ResponseReceived, [(b":status", b"200")], False, 3),
    ]
    assert not conn.closed


def test_informational_response_before_the_real_one() -> None:
    """A 1xx head comes as InformationalResponseReceived; the 200 after it is the response
    (DATA then accepted); DATA between the two is a stream error (RFC 9113 8.1.1)."""
    conn, encoder = opened()
    wire = frame(HEADERS, END_HEADERS, 3, encoder.encode([(b":status", b"100")]))
    wire += frame(HEADERS, END_HEADERS, 3, encoder.encode(RESPONSE)) + frame(DATA, 0, 3, b"m")
    assert [describe(e) for e in conn.receive_data(wire)] == [
        (InformationalResponseReceived, [(b":status", b"100")], 3),
        (ResponseReceived, RESPONSE, False, 3),
        (DataReceived, b"m", 1, 3),
    ]
    other, encoder = opened()
    other.receive_data(frame(HEADERS, END_HEADERS, 3, encoder.encode([(b":status", b"103")])))
    [broken] = other.receive_data(frame(DATA, 0, 3, b"m"))
    assert isinstance(broken, StreamBroken) and (broken.stream_id, broken.error_code) == (3, PROTOCOL_ERROR)
    assert not other.closed


def test_data_with_end_stream_and_no_trailers() -> None:
    """DATA with END_STREAM ends the stream without trailers: DataReceived, then StreamEnded."""
    conn, _ = opened()
    assert [describe(e) for e in conn.receive_data(frame(DATA, END_STREAM, 1, b"z"))] == [
        (DataReceived, b"z", 1, 1),
        (StreamEnded, 1),
    ]
    assert 1 not in conn.streams


# -- local misuse ---------------------------------------------------------------------------------


def test_stream_ids_run_out() -> None:
    """Stream 2^31-1 is the last: it may be opened, then no id is left (StreamUnavailable)."""
    conn, _ = opened()
    conn.highest_outbound_stream_id = 2**31 - 3
    assert conn.get_next_available_stream_id() == 2**31 - 1
    conn.send_headers(2**31 - 1, REQUEST)
    with pytest.raises(StreamUnavailable):
        conn.get_next_available_stream_id()
    with pytest.raises(StreamUnavailable):
        conn.send_headers(2**31 + 1, REQUEST)


def test_wrong_next_stream_id() -> None:
    """send_headers takes only the next stream id."""
    conn, _ = opened()
    for sid in (3, 4, 7):
        with pytest.raises(StreamUnavailable):
            conn.send_headers(sid, REQUEST)
    conn.send_headers(5, REQUEST)


def test_peer_max_concurrent_streams(peer: Peer) -> None:
    """No more open streams than the server's MAX_CONCURRENT_STREAMS; a slot frees when a stream
    ends."""
    peer.server.update_settings({Codes.MAX_CONCURRENT_STREAMS: 2})
    [changed] = peer.to_client()
    assert isinstance(changed, RemoteSettingsChanged) and changed.max_concurrent_streams == 2
    peer.to_server()
    first = peer.request()
    peer.request()
    with pytest.raises(StreamUnavailable):
        peer.client.send_headers(peer.client.get_next_available_stream_id(), REQUEST)
    peer.server.send_headers(first, [*RESPONSE, (b"grpc-status", b"0")], end_stream=True)
    peer.to_client()
    peer.request()
    assert len(peer.client.streams) == 2


def test_send_data_misuse(peer: Peer) -> None:
    """send_data beyond the window or frame size, on a stream ended by us, on a stream never
    opened: StreamUnavailable, nothing queued."""
    client = peer.client
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, REQUEST)
    client.data_to_send()
    with pytest.raises(StreamUnavailable):
        client.send_data(sid, b"x" * 16_385)  # above the frame size (the window is 65,535)
    for _ in range(3):
        client.send_data(sid, b"x" * 16_384)
    with pytest.raises(StreamUnavailable):
        client.send_data(sid, b"x" * 16_384)  # 16,383 left in the window
    client.send_data(sid, b"x" * 16_383, end_stream=True)
    client.data_to_send()
    with pytest.raises(StreamUnavailable):
        client.send_data(sid, b"")
    with pytest.raises(StreamUnavailable):
        client.local_flow_control_window(sid)
    with pytest.raises(StreamUnavailable):
        client.send_data(99, b"x")
    assert client.data_to_send() == b""


def test_reset_stream_is_idempotent() -> None:
    """reset_stream of a stream not open (never opened, already reset, ended by the server)
    queues nothing."""
    conn, encoder = opened()
    conn.reset_stream(3)
    conn.data_to_send()
    conn.receive_data(frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode(TRAILERS)))
    for sid in (1, 3, 5):
        conn.reset_stream(sid)
    assert conn.data_to_send() == b""


def test_argument_checks() -> None:
    """Bad local arguments are ValueErrors: a PING not of 8 bytes, a window out of range."""
    conn = ClientConnection()
    with pytest.raises(ValueError):
        conn.ping(b"short")
    with pytest.raises(ValueError):
        ClientConnection(stream_window=2**31)
    with pytest.raises(ValueError):
        ClientConnection(stream_window=-1)


# -- request header encoding ----------------------------------------------------------------------


def _decode(block: bytes) -> list[tuple[bytes, bytes]]:
    decoder = hpack.Decoder()
    headers = decoder.decode(block, raw=True)
    assert len(decoder.header_table.dynamic_entries) == 0  # never indexed into the peer's table
    return [tuple(h) for h in headers]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "value", "encoded"),
    [
        (b":method", b"POST", b"\x83"),  # static exact match (index 3)
        (b"te", b"trailers", b"\x00\x02te\x08trailers"),  # not in the static table
        (b":path", b"/openengine.v1.Engine/Generate", b"\x04\x1e/openengine.v1.Engine/Generate"),
        (b"user-agent", b"x" * 200, b"\x0f\x2b\x7f\x49" + b"x" * 200),  # index 58 > 15, length 200 > 127
        (b"x-new", b"v", b"\x00\x05x-new\x01v"),
        (b"", b"", b"\x00\x00\x00"),
    ],
)
def test_encode_header(name: bytes, value: bytes, encoded: bytes) -> None:
    """encode_header: a static exact match as one index byte, a static name with a literal value
    (4-bit index prefix, continued when above 15), a new name as two literals; never Huffman,
    never indexed; hpack decodes each back."""
    block = h2_client.encode_header(name, value)
    assert block == encoded
    assert _decode(block) == [(name, value)]


STATIC_NAMES = sorted({name for name, _ in hpack.table.HeaderTable.STATIC_TABLE})


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.binary(max_size=300), st.sampled_from(STATIC_NAMES)), st.binary(max_size=300)),
        max_size=8,
    )
)
def test_encode_header_decodes_for_any_bytes(fields: list[tuple[bytes, bytes]]) -> None:
    """Any byte names (static-table names among them) and values, encoded one after another,
    decode back exactly with hpack."""
    assert _decode(b"".join(h2_client.encode_header(n, v) for n, v in fields)) == fields


@given(st.lists(st.sampled_from(list(hpack.table.HeaderTable.STATIC_TABLE)), max_size=10))
def test_encode_header_static_fields(fields: list[tuple[bytes, bytes]]) -> None:
    """Static-table fields (exact matches) are one index byte each and decode back."""
    blocks = [h2_client.encode_header(n, v) for n, v in fields]
    assert all(len(b) == 1 for b in blocks)
    assert _decode(b"".join(blocks)) == fields


def test_request_headers_through_client_decode() -> None:
    """send_headers' HEADERS payload is the encode_header of each field in order (also for a
    field seen before: the cache returns the same bytes)."""
    conn, _ = opened()
    headers = [*REQUEST, (b"x-a", b"1"), (b"x-a", b"1"), (b"x-b", b"\xff\x00")]
    for sid in (5, 7):
        conn.send_headers(sid, headers)
        [(ftype, flags, got_sid, payload)] = parse(conn.data_to_send())
        assert (ftype, flags, got_sid) == (HEADERS, END_HEADERS, sid)
        assert payload == b"".join(h2_client.encode_header(*f) for f in headers)
        assert _decode(payload) == headers


# -- an engine sending anything -------------------------------------------------------------------

_fuzz_frame = st.builds(
    frame,
    st.sampled_from(
        [DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE]
    )
    | st.sampled_from([CONTINUATION, 0x0A, 0xFF]),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 5, 0x7FFFFFFF, 0x80000001]),
    st.binary(max_size=64)
    | st.sampled_from([u32(0), u32(1), u32(2**31 - 1), setting(4, 2**31), setting(5, 1), b"\x00" * 8]),
)


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(_fuzz_frame, max_size=12), cut=st.integers(1, 40))
def test_whatever_the_engine_sends_the_client_answers_with_events_or_a_violation(
    frames: list[bytes], cut: int
) -> None:
    """Any sequence of frames (valid headers around arbitrary payloads, flags and stream ids,
    fed in pieces) gives events or raises ProtocolViolation (a GOAWAY queued, the connection
    done) — never another exception, which the transport would log as a defect with a
    traceback; after a violation nothing more is parsed."""
    conn, _ = opened()
    wire = b"".join(frames)
    violated = False
    for start in range(0, len(wire), cut):
        try:
            events = conn.receive_data(wire[start : start + cut])
        except ProtocolViolation as err:
            violated = True
            assert [t for t, _, _, _ in parse(conn.data_to_send())][-1] == GOAWAY, err
            continue
        if violated:
            assert events == []
    assert violated == conn.closed

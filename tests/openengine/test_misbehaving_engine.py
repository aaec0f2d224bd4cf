"""The engine client against engines that break HTTP/2, over real loopback connections: errors
are scoped as RFC 9113 says.

The engine is the ``h2`` library as a server on a trio socket; where a test needs what h2 will
not send (DATA before the response headers, trailers without END_STREAM, a zero WINDOW_UPDATE,
SETTINGS_ENABLE_PUSH = 1, a first frame other than SETTINGS) it writes those frames itself, next
to what h2 sends. A stream error (a malformed response, a stream-level violation) resets that
stream alone, and the other calls on the connection go on; a connection error closes the
connection (GOAWAY) and the next call opens a new one; events that came before a violation in
the same read still count; a call the engine ends while our request is still held by flow
control is closed (RST_STREAM), so the engine stops counting it; request headers over the
engine's SETTINGS_MAX_HEADER_LIST_SIZE are refused before they are sent.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from sidecar.openengine.engine_errors import EngineProtocolError, EngineStatusError
from sidecar.openengine.transport.http2 import (
    DATA,
    END_HEADERS,
    HEADERS,
    PING,
    PROTOCOL_ERROR,
    SETTINGS,
    WINDOW_UPDATE,
    encode_header,
)
from tests.openengine.fake_grpc_engine import tokens
from tests.polling import eventually

RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc+proto")]
OK_TRAILERS = [(b"grpc-status", b"0")]
STREAMS = 12


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block h2's decoder (and its dynamic table) accepts from anyone: literals
    without indexing."""
    return b"".join(encode_header(n, v) for n, v in headers)


def framed(event: pb.GenerateResponse) -> bytes:
    data = bytes(event)
    return b"\x00" + len(data).to_bytes(4, "big") + data


#: A well-formed answer's messages: one token, then the finish (no request id: the stream rules
#: accept its absence). Two events for the caller.
ANSWER = b"".join(framed(e) for e in tokens("", 1))
FIRST = framed(tokens("", 1)[0])


def request(rid: str, prompt: str = "hi") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt=prompt)


@dataclass
class Conn:
    """One connection as the engine sees it: h2's state, the raw frames a test adds, what the
    client did."""

    h2: h2.connection.H2Connection
    stream: trio.SocketStream
    requests: dict[int, str] = field(default_factory=dict)  # stream id -> :path
    resets: dict[int, int] = field(default_factory=dict)  # stream id -> the client's RST_STREAM code
    goaway: int | None = None  # the client's GOAWAY error code
    raw: list[bytes] = field(default_factory=list)

    async def flush(self) -> None:
        data = self.h2.data_to_send() + b"".join(self.raw)
        self.raw.clear()
        if data:
            await self.stream.send_all(data)


Handler = Callable[[Conn, int], None]


@dataclass
class Engine:
    address: str
    conns: list[Conn]


@asynccontextmanager
async def scripted_engine(
    answer: Handler,
    *,
    settings: dict[int, int] | None = None,
    preface: Callable[[Conn], bytes | None] | None = None,
    batch: int = 1,
) -> AsyncIterator[Engine]:
    """A loopback HTTP/2 engine: ``answer(conn, stream_id)`` once ``batch`` requests are in
    (in order of arrival), ``preface`` may replace the connection's first bytes."""
    conns: list[Conn] = []

    async def serve(stream: trio.SocketStream) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = Conn(h2.connection.H2Connection(config), stream)
        conns.append(conn)
        if settings:  # what the engine's first SETTINGS frame says
            conn.h2.local_settings = h2.settings.Settings(client=False, initial_values=settings)
        conn.h2.initiate_connection()
        first = preface(conn) if preface is not None else None
        if first is not None:
            conn.h2.data_to_send()  # h2's own preface is not sent
            await stream.send_all(first)
        else:
            await conn.flush()
        waiting: list[int] = []
        try:
            while data := await stream.receive_some(65536):
                for event in conn.h2.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        headers = dict(event.headers)
                        conn.requests[event.stream_id] = headers[b":path"].decode()
                        waiting.append(event.stream_id)
                    elif isinstance(event, h2.events.StreamReset):
                        conn.resets[event.stream_id] = event.error_code
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        conn.goaway = event.error_code
                if len(waiting) >= batch:
                    for sid in waiting:
                        answer(conn, sid)
                    waiting.clear()
                await conn.flush()
        except (trio.BrokenResourceError, h2.exceptions.ProtocolError):
            pass

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        yield Engine(f"127.0.0.1:{listener.socket.getsockname()[1]}", conns)
        nursery.cancel_scope.cancel()


def answer_well(conn: Conn, sid: int) -> None:
    conn.h2.send_headers(sid, RESPONSE)
    conn.h2.send_data(sid, ANSWER)
    conn.h2.send_headers(sid, OK_TRAILERS, end_stream=True)


def poison(kind: str, target: int) -> Handler:
    """Answer every stream well but the ``target``-th one (1-based), which gets ``kind``."""
    count = 0

    def answer(conn: Conn, sid: int) -> None:
        nonlocal count
        count += 1
        if count != target:
            answer_well(conn, sid)
        elif kind == "data-before-headers":  # RFC 9113 8.1.1: a malformed response
            conn.raw.append(frame(DATA, 0, sid, FIRST))
        elif kind == "trailers-without-end-stream":  # RFC 9113 8.1
            conn.h2.send_headers(sid, RESPONSE)
            conn.h2.send_data(sid, FIRST)
            conn.raw.append(frame(HEADERS, END_HEADERS, sid, block(OK_TRAILERS)))
        elif kind == "zero-window-update":  # RFC 9113 6.9: a stream error
            conn.h2.send_headers(sid, RESPONSE)
            conn.raw.append(frame(WINDOW_UPDATE, 0, sid, (0).to_bytes(4, "big")))

    return answer


async def run_calls(client: EngineClient, n: int) -> dict[str, BaseException | int]:
    """``n`` Generate calls at once; each one's token count, or its error."""
    results: dict[str, BaseException | int] = {}

    async def one(i: int) -> None:
        try:
            async with client.generate(request(f"c{i}")) as stream:
                results[f"c{i}"] = len([e async for e in stream])
        except Exception as err:
            results[f"c{i}"] = err

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize("kind", ["data-before-headers", "trailers-without-end-stream", "zero-window-update"])
async def test_a_stream_error_fails_that_stream_alone(kind: str) -> None:
    """Of 12 streams on one connection one is broken: it alone fails (typed, retryable) and is
    reset with PROTOCOL_ERROR; the other 11 complete on the same connection."""
    with trio.fail_after(20):
        async with (
            scripted_engine(poison(kind, 5), batch=STREAMS) as engine,
            open_engine_client(engine.address, generate_channels=1) as client,
        ):
            results = await run_calls(client, STREAMS)
            (conn,) = engine.conns
            await eventually(lambda: len(conn.resets) == 1)
            assert conn.goaway is None  # the connection was never closed
    failed = {rid: r for rid, r in results.items() if isinstance(r, BaseException)}
    assert len(failed) == 1, results
    (err,) = failed.values()
    assert isinstance(err, EngineProtocolError) and err.retryable and "broke HTTP/2" in str(err), err
    assert sorted(r for r in results.values() if not isinstance(r, BaseException)) == [2] * (STREAMS - 1)
    assert list(conn.resets.values()) == [PROTOCOL_ERROR]


async def test_a_call_ended_while_its_request_waits_for_window_is_closed() -> None:
    """The engine answers (trailers-only) before it let our request body through (a 1 KiB
    window for a 64 KiB prompt): the call fails with the engine's status, and the stream is
    closed with RST_STREAM — without it the engine kept counting the stream as open."""

    def refuse(conn: Conn, sid: int) -> None:
        if sid > 1:
            answer_well(conn, sid)
            return
        conn.h2.send_headers(
            sid, [*RESPONSE, (b"grpc-status", b"14"), (b"grpc-message", b"busy")], end_stream=True
        )

    with trio.fail_after(20):
        async with (
            scripted_engine(refuse, settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1024}) as engine,
            open_engine_client(engine.address, generate_channels=1) as client,
        ):
            with pytest.raises(EngineStatusError) as caught:
                async with client.generate(request("big", prompt="x" * 65_536)) as stream:
                    async for _ in stream:
                        pass
            assert caught.value.status == "UNAVAILABLE"
            (conn,) = engine.conns
            await eventually(lambda: bool(conn.resets))
            assert conn.h2.open_inbound_streams == 0
            # the connection serves the next call
            async with client.generate(request("next")) as stream:
                assert len([e async for e in stream]) == 2


async def test_request_headers_over_the_engines_limit_are_refused_before_sending() -> None:
    """A call whose headers exceed the engine's SETTINGS_MAX_HEADER_LIST_SIZE fails alone,
    typed and not retryable, and nothing of it reaches the engine (whose decoder would have
    closed the connection, failing every call on it)."""
    limit = 600
    with trio.fail_after(20):
        async with (
            scripted_engine(
                answer_well, settings={h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limit}
            ) as engine,
            open_engine_client(engine.address, generate_channels=1) as client,
        ):
            results = await run_calls(client, STREAMS)
            assert all(r == 2 for r in results.values()), results
            with pytest.raises(EngineStatusError) as caught:
                async with client.generate(request("big"), metadata={"x-big": "v" * limit}) as stream:
                    async for _ in stream:
                        pass
            assert caught.value.status == "INVALID_ARGUMENT" and not caught.value.retryable
            assert "SETTINGS_MAX_HEADER_LIST_SIZE" in str(caught.value)
            (conn,) = engine.conns
            assert len(conn.requests) == STREAMS and conn.goaway is None
            results = await run_calls(client, STREAMS)
            assert all(r == 2 for r in results.values()), results


@pytest.mark.parametrize("fault", ["enable-push", "first-frame-not-settings"])
async def test_a_connection_error_closes_the_connection_and_the_next_call_reconnects(fault: str) -> None:
    """RFC 9113 6.5.2 (SETTINGS_ENABLE_PUSH = 1 from a server) and 3.4 (the server's first
    frame must be SETTINGS) are connection errors: the connection is closed with GOAWAY
    PROTOCOL_ERROR before any call is sent on it, and the call goes to a new connection."""

    def preface(conn: Conn) -> bytes | None:
        if len(preface_seen) >= 1:
            return None  # the second connection behaves
        preface_seen.append(conn)
        if fault == "enable-push":
            return frame(SETTINGS, 0, 0, struct.pack(">HI", 2, 1))
        return frame(PING, 0, 0, b"8 bytes!")

    preface_seen: list[Conn] = []
    with trio.fail_after(20):
        async with (
            scripted_engine(answer_well, preface=preface) as engine,
            open_engine_client(engine.address, generate_channels=1) as client,
        ):
            async with client.generate(request("r")) as stream:
                assert len([e async for e in stream]) == 2
            first, second = engine.conns
            await eventually(lambda: first.goaway is not None)
            assert first.goaway == PROTOCOL_ERROR and first.requests == {}
            assert list(second.requests.values()) == ["/openengine.v1.Inference/Generate"]


async def test_events_before_a_connection_error_in_the_same_read_still_count() -> None:
    """The engine's last frames for a call (its messages and OK trailers) and a frame that
    breaks the connection arrive in one read: the call completes with its messages; only then is
    the connection closed."""

    def answer(conn: Conn, sid: int) -> None:
        answer_well(conn, sid)
        conn.raw.append(frame(DATA, 0, 0, b"x"))  # DATA on stream 0: a connection error

    with trio.fail_after(20):
        async with (
            scripted_engine(answer) as engine,
            open_engine_client(engine.address, generate_channels=1) as client,
        ):
            async with client.generate(request("r")) as stream:
                assert len([e async for e in stream]) == 2
            (conn,) = engine.conns
            await eventually(lambda: conn.goaway is not None)
            assert conn.goaway == PROTOCOL_ERROR

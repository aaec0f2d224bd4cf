"""When an engine connection's frames leave (``EngineConnection``'s writer): a new call's
HEADERS + DATA at once when the writer is idle — on the wire before the caller's next
checkpoint — and the calls started after it in the same scheduler pass together, in the
writer's one send. A raw socket pair stands in for the engine (the bytes are read as frames)."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from sidecar import socket_io
from sidecar.openengine.transport import connection
from sidecar.openengine.transport.connection import EngineConnection

HEADERS = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/openengine.v1.Inference/Generate"),
    (b":authority", b"engine"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
]
DATA, HEADERS_FRAME, RST_STREAM = 0x0, 0x1, 0x3
SETTINGS = bytes(9)[:3] + b"\x04" + bytes(5)  # an empty SETTINGS frame: the engine's preface
END_STREAM = 0x1


def frames(data: bytes) -> list[tuple[int, int, int]]:
    """(type, flags, stream id) of each frame in ``data``."""
    out = []
    while data:
        length = int.from_bytes(data[:3], "big")
        kind, flags, sid = struct.unpack(">BBI", data[3:9])
        out.append((kind, flags, sid & 0x7FFFFFFF))
        data = data[9 + length :]
    return out


@asynccontextmanager
async def idle_connection() -> AsyncIterator[tuple[EngineConnection, socket.socket]]:
    """A running connection that has exchanged SETTINGS with the engine and sent everything
    since: its writer waits idle."""
    ours, engine = socket.socketpair()
    engine.setblocking(False)
    conn = EngineConnection(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
    with engine, trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(conn.run)
            engine.send(SETTINGS)
            await conn.settings_seen.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert engine.recv(1 << 16).startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            yield conn, engine
            conn.close()


async def test_a_new_call_leaves_at_once_when_the_writer_is_idle() -> None:
    async with idle_connection() as (conn, engine):
        call = conn.start_call(HEADERS, b"request")
        # no checkpoint since: the frames were written by start_call itself
        assert frames(engine.recv(1 << 16)) == [
            (HEADERS_FRAME, 0x4, call.id),  # END_HEADERS
            (DATA, END_STREAM, call.id),
        ]


async def test_calls_started_after_it_in_the_same_pass_leave_in_one_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writes: list[bytes] = []

    def counted(target: trio.abc.Stream, data: bytes | memoryview) -> int:
        writes.append(bytes(data))
        return real(target, data)

    real = socket_io.write_now
    monkeypatch.setattr(connection, "write_now", counted)
    async with idle_connection() as (conn, engine):
        writes.clear()
        first, second, third = (conn.start_call(HEADERS, b"request") for _ in range(3))
        assert [frames(w) for w in writes] == [[(HEADERS_FRAME, 0x4, first.id), (DATA, END_STREAM, first.id)]]
        await trio.testing.wait_all_tasks_blocked()
        assert [{sid for _, _, sid in frames(w)} for w in writes[1:]] == [{second.id, third.id}]
        assert {sid for _, _, sid in frames(engine.recv(1 << 16))} == {first.id, second.id, third.id}


async def test_a_cancelled_call_is_reset_at_once_when_the_writer_is_idle() -> None:
    """The RST_STREAM is on the wire before the caller's next checkpoint: before the Abort the
    lifecycle then sends on another connection (docs/LIFECYCLE.md, rule 2)."""
    async with idle_connection() as (conn, engine):
        call = conn.start_call(HEADERS, b"request")
        engine.recv(1 << 16)
        await trio.testing.wait_all_tasks_blocked()
        call.cancel()
        assert frames(engine.recv(1 << 16)) == [(RST_STREAM, 0, call.id)]

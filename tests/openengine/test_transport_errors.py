"""What an engine's HTTP/2 connection says, mapped to the client's typed errors.

A scripted HTTP/2 server (the ``h2`` library on trio, over loopback) answers each Generate the
way a test chooses — a non-gRPC HTTP status, a wrong content type, a stream ended without
trailers, a trailers-only status with a percent-encoded message, a reset stream, a GOAWAY — and
each transport must raise the same error class with the same gRPC status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineStatusError, EngineUnavailable

Answer = Callable[[h2.connection.H2Connection, int], None]
GRPC = [(b":status", b"200"), (b"content-type", b"application/grpc+proto")]


@asynccontextmanager
async def scripted_engine(answer: Answer) -> AsyncIterator[str]:
    """A loopback HTTP/2 server calling ``answer(conn, stream_id)`` for every request."""

    async def serve(stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        while data := await stream.receive_some(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    answer(conn, event.stream_id)
            await stream.send_all(conn.data_to_send())

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        yield f"127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


def http_status(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.send_headers(sid, [(b":status", b"503")], end_stream=True)


def wrong_content_type(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/html")], end_stream=True)


def no_trailers(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.send_headers(sid, GRPC)
    conn.send_data(sid, b"", end_stream=True)


def trailers_only(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.send_headers(
        sid, [*GRPC, (b"grpc-status", b"8"), (b"grpc-message", b"busy%20%E2%9C%93")], end_stream=True
    )


def reset(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.send_headers(sid, GRPC)
    conn.reset_stream(sid, 2)


def goaway(conn: h2.connection.H2Connection, sid: int) -> None:
    conn.close_connection(last_stream_id=0)


CASES: dict[str, tuple[Answer, type[Exception], str | None, str]] = {
    "http-503": (http_status, EngineStatusError, "UNAVAILABLE", "Received :status = '503'"),
    "content-type": (wrong_content_type, EngineStatusError, "UNKNOWN", "Invalid content-type: 'text/html'"),
    "no-trailers": (no_trailers, EngineStatusError, "UNKNOWN", "Missing grpc-status header"),
    "trailers-only": (trailers_only, EngineStatusError, "RESOURCE_EXHAUSTED", "busy ✓"),
    "reset": (reset, EngineUnavailable, None, "connection lost"),
    "goaway": (goaway, EngineUnavailable, None, "connection lost"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_typed_error_for_what_the_engine_says(case: str) -> None:
    answer, kind, status, text = CASES[case]
    with trio.fail_after(10):
        async with (
            scripted_engine(answer) as address,
            open_engine_client(address) as client,
        ):
            with pytest.raises(kind) as caught:
                async with client.generate(pb.GenerateRequest(request_id="r", prompt="hi")) as stream:
                    async for _ in stream:
                        raise AssertionError("no event was sent")
    err: Any = caught.value
    if status is not None:
        assert err.status == status and err.message == text, (err.status, err.message)
    else:
        assert text in str(err), err


async def test_a_failure_inside_a_connection_closes_only_that_connection(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception while a connection handles a frame fails its calls
    (EngineUnavailable) and closes it; it does not reach the client's nursery (which would end
    every stream and the client itself)."""
    from sidecar.openengine.transport import connection
    from tests.openengine.fake_grpc_engine import tokens

    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 1)
    handle = connection.EngineConnection._on_trailers

    def broken(self: Any, event: Any) -> None:
        raise RuntimeError("a bug")

    with trio.fail_after(10):
        async with open_engine_client(server.address, generate_channels=1) as client:
            monkeypatch.setattr(connection.EngineConnection, "_on_trailers", broken)
            with pytest.raises(EngineUnavailable):
                async with client.generate(pb.GenerateRequest(request_id="r1", prompt="hi")) as stream:
                    async for _ in stream:
                        pass
            monkeypatch.setattr(connection.EngineConnection, "_on_trailers", handle)
            async with client.generate(pb.GenerateRequest(request_id="r2", prompt="hi")) as stream:
                assert len([e async for e in stream]) == 2

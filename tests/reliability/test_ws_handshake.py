"""The WebSocket listener closes connections that never complete their handshake: a client
that connects and stays silent, one that sends half a request (slowloris), a plaintext client
on the TLS port. In-process: ``NorthPlane`` on loopback with a short handshake timeout."""

from __future__ import annotations

import ssl
from typing import Any

import pytest
import trio
import trustme

from sidecar.north.ws_server import NorthPlane, WsConfig

TIMEOUT = 0.5


class NoHost:
    """The plane's core: never reached by these connections."""

    def admit(self, *a: Any) -> Any:
        raise AssertionError("unexpected admit")

    async def run_stream(self, *a: Any) -> Any:
        raise AssertionError("unexpected stream")

    async def call(self, *a: Any) -> Any:
        raise AssertionError("unexpected call")


async def _closed_within(port: int, send: bytes, limit: float) -> float:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    t0 = trio.current_time()
    if send:
        await stream.send_all(send)
    with trio.fail_after(limit):
        while True:
            try:
                if not await stream.receive_some(4096):
                    break
            except trio.BrokenResourceError:
                break
    await stream.aclose()
    return trio.current_time() - t0


@pytest.mark.parametrize("tls", [False, True])
async def test_unfinished_handshakes_are_closed(tls: bool) -> None:
    context = None
    if tls:
        ca = trustme.CA()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
    plane = NorthPlane(NoHost(), WsConfig(handshake_timeout=TIMEOUT), ssl_context=context)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(plane.serve, "127.0.0.1", 0)
        for send in (b"", b"GET /v1/ws HTTP/1.1\r\nHost: x\r\n"):  # silent; half a request
            took = await _closed_within(port, send, TIMEOUT + 2)
            assert took >= TIMEOUT - 0.1, took
        if tls:  # a whole plaintext request on the TLS port: never a handshake either
            request = (
                b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            await _closed_within(port, request, TIMEOUT + 2)
        assert plane.connections == set()
        nursery.cancel_scope.cancel()

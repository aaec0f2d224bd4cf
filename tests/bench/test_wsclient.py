"""The lean WebSocket client against trio-websocket's server (the sidecar's)."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from sidecar.bench.wsclient import OP_BINARY, OP_TEXT, WsClient, WsError


async def echo(request: WebSocketRequest) -> None:
    if request.path != "/v1/ws?x=1":
        await request.reject(404)
        return
    ws = await request.accept()
    try:
        while True:
            msg = await ws.get_message()
            if msg == "close me":
                await ws.aclose(4000, "asked")
                return
            await ws.send_message(msg)
            if isinstance(msg, bytes) and len(msg) > 1000:  # large: also send it fragmented-free twice
                await ws.send_message(msg)
    except ConnectionClosed:
        pass


async def test_round_trips_and_close_handshake() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_websocket, echo, "127.0.0.1", 0, None))
            url = f"ws://127.0.0.1:{server.port}/v1/ws?x=1"
            client = await WsClient.connect(url)
            got: list[tuple[int, bytes]] = []
            big = bytes(range(256)) * 400
            async with trio.open_nursery() as inner:
                inner.start_soon(client.run, lambda op, data: got.append((op, data)))
                await client.send(b"\x00\x01binary")
                await client.send("text ✓")
                await client.send(big)
                await client.send("close me")
            assert got == [
                (OP_BINARY, b"\x00\x01binary"),
                (OP_TEXT, "text ✓".encode()),
                (OP_BINARY, big),
                (OP_BINARY, big),
            ]
            assert client.close_code == 4000 and client.closed
            with pytest.raises(WsError):
                await client.send(b"after close")
            nursery.cancel_scope.cancel()


async def test_client_initiated_close_and_refused_handshake() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_websocket, echo, "127.0.0.1", 0, None))
            with pytest.raises(WsError, match="404"):
                await WsClient.connect(f"ws://127.0.0.1:{server.port}/elsewhere")
            client = await WsClient.connect(f"ws://127.0.0.1:{server.port}/v1/ws?x=1")
            async with trio.open_nursery() as inner:
                inner.start_soon(client.run, lambda op, data: None)
                await client.close(1000)  # run() returns once the server answers the close
            assert client.close_code == 1000
            nursery.cancel_scope.cancel()

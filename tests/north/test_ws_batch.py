"""Batched WebSocket writes: separate messages, in order, one write; a fallback without internals."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, open_websocket, serve_websocket

from sidecar.north.ws_batch import send_batch, supported


async def test_batch_arrives_as_separate_messages_in_order() -> None:
    frames: list[str | bytes] = [f"text-{i}" if i % 3 else f"bin-{i}".encode() for i in range(300)]
    writes = 0
    batch_writes: list[int] = []

    async def handler(request: WebSocketRequest) -> None:
        nonlocal writes
        ws = await request.accept()
        assert supported(ws)
        original = ws._stream.send_all

        async def counting_send_all(data: Any) -> None:
            nonlocal writes
            writes += 1
            await original(data)

        ws._stream.send_all = counting_send_all
        await send_batch(ws, frames)
        batch_writes.append(writes)
        await ws.get_message()  # keep the connection until the client is done

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            async with open_websocket("127.0.0.1", server.port, "/", use_ssl=False) as client:
                got = [await client.get_message() for _ in frames]
                await client.send_message("done")
            nursery.cancel_scope.cancel()
    assert got == frames
    assert batch_writes == [1]


class _PlainWs:
    """A connection object without trio-websocket's internals."""

    def __init__(self) -> None:
        self.sent: list[str | bytes] = []

    async def send_message(self, message: str | bytes) -> None:
        self.sent.append(message)


async def test_fallback_sends_one_by_one() -> None:
    ws = _PlainWs()
    assert not supported(ws)  # type: ignore[arg-type]
    await send_batch(ws, ["a", b"b"])  # type: ignore[arg-type]
    assert ws.sent == ["a", b"b"]


async def test_closed_connection_raises_connection_closed() -> None:
    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.aclose()
        with pytest.raises(ConnectionClosed):
            await send_batch(ws, ["late"])

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            async with open_websocket("127.0.0.1", server.port, "/", use_ssl=False) as client:
                with pytest.raises(ConnectionClosed):
                    await client.get_message()
            nursery.cancel_scope.cancel()

"""Batched WebSocket writes: separate messages, in order, one write per bounded chunk; a
fallback without internals; an interrupted write lets the close frame through."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import (
    ConnectionClosed,
    WebSocketRequest,
    open_websocket,
    serve_websocket,
    wrap_client_stream,
)

from sidecar.north import ws_batch
from sidecar.north.ws_batch import BatchWriter, send_batch, supported


def _count_writes_now(monkeypatch: pytest.MonkeyPatch, record: Any) -> None:
    """Also count the writes the kernel takes at once (``ws_batch.write_now``, no socket send)."""
    original = ws_batch.write_now

    def counting(target: Any, data: Any) -> int:
        n = original(target, data)
        if n:
            record(n)
        return n

    monkeypatch.setattr(ws_batch, "write_now", counting)


async def test_batch_arrives_as_separate_messages_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    frames: list[str | bytes] = [f"text-{i}" if i % 3 else f"bin-{i}".encode() for i in range(300)]
    writes = 0
    batch_writes: list[int] = []

    def one_write(n: int) -> None:
        nonlocal writes
        writes += 1

    _count_writes_now(monkeypatch, one_write)

    async def handler(request: WebSocketRequest) -> None:
        nonlocal writes
        ws = await request.accept()
        assert supported(ws)
        original = ws._stream.socket.send

        async def counting_send(data: Any) -> int:
            nonlocal writes
            writes += 1
            n: int = await original(data)
            return n

        ws._stream.socket = _SendSpy(ws._stream.socket, counting_send)
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


async def test_writes_are_bounded_and_frame_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch bigger than ``max_write`` goes out in several writes, each ending on a frame
    boundary (the client still gets every message, in order)."""
    frames: list[str | bytes] = [json.dumps({"i": i, "pad": "x" * 500}) for i in range(100)]
    sizes: list[int] = []
    _count_writes_now(monkeypatch, sizes.append)

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        sock = ws._stream.socket
        original = sock.send

        async def counting_send(data: Any) -> int:
            n: int = await original(data)
            sizes.append(n)
            return n

        ws._stream.socket = _SendSpy(sock, counting_send)
        await BatchWriter(ws, max_write=8192).send(frames)
        await ws.get_message()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            async with open_websocket("127.0.0.1", server.port, "/", use_ssl=False) as client:
                got = [await client.get_message() for _ in frames]
                await client.send_message("done")
            nursery.cancel_scope.cancel()
    assert got == frames
    frame_bytes = 2 + 2 + 500 + len(json.dumps({"i": 0, "pad": ""}))  # ~ one frame on the wire
    assert len(sizes) >= 100 * frame_bytes // 8192
    assert all(n <= 8192 for n in sizes), sizes


class _SendSpy:
    """A trio socket whose ``send`` is replaced (everything else delegated)."""

    def __init__(self, sock: Any, send: Any) -> None:
        self._sock = sock
        self.send = send

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


async def test_interrupt_puts_the_close_frame_right_behind_the_kernel_buffers() -> None:
    """A client that stopped reading, a big batch blocked in its write: ``interrupt`` + close
    1008. Once the client reads again it gets what the kernel buffers held (a prefix of the
    batch, in order), then the close frame — not the rest of the write in progress."""
    frames: list[str | bytes] = [json.dumps({"i": i, "pad": "x" * 1000}) for i in range(400)]
    per_write = ws_batch.MAX_WRITE // (len(frames[0]) + 4)  # frames in one uninterrupted write
    outcome: list[str] = []
    blocked = trio.Event()

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        ws._stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        writer = BatchWriter(ws)

        async def write() -> None:
            try:
                await writer.send(frames)
                outcome.append("all sent")
            except ConnectionClosed:
                outcome.append("closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.testing.wait_all_tasks_blocked()  # the client does not read: stuck
            blocked.set()
            writer.interrupt()
            await ws.aclose(1008, "stalled")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", server.port))
            async with trio.open_nursery() as client_nursery:
                client = await wrap_client_stream(
                    client_nursery, trio.SocketStream(sock), "127.0.0.1", "/", message_queue_size=1
                )
                await blocked.wait()
                got = []
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        got.append(await client.get_message())
                client_nursery.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    assert outcome == ["closed"]
    assert closed.value.reason is not None and closed.value.reason.code == 1008
    assert got == frames[: len(got)]
    # the kernel buffers (~16 KiB here) hold a dozen frames; an uninterrupted write, 64
    assert len(got) <= per_write // 2, f"{len(got)} frames before the close frame"


async def test_interrupted_writer_sends_nothing_more() -> None:
    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        writer = BatchWriter(ws)
        await writer.send(["before"])
        writer.interrupt()
        with pytest.raises(ConnectionClosed):
            await writer.send(["after"])
        await ws.aclose(1008, "stalled")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            async with open_websocket("127.0.0.1", server.port, "/", use_ssl=False) as client:
                assert await client.get_message() == "before"
                with pytest.raises(ConnectionClosed) as closed:
                    await client.get_message()
                assert closed.value.reason is not None and closed.value.reason.code == 1008
            nursery.cancel_scope.cancel()

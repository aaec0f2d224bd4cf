"""The trio-websocket adapter in-process: client faults get their close frame, nothing a
connection does stops the listener. (The internals it relies on: test_trio_websocket_internals.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, WebSocketRequest

from sidecar.north import ws_adapter
from sidecar.north._trio_websocket_internals import SidecarWebSocket
from tests.fuzz.mutate import OP_PING, OP_TEXT, Frame, ws_frame
from tests.fuzz.rawws import NO_CLOSE_FRAME, Closed, RawWs

Handler = Callable[[WebSocketRequest], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler, **kw: Any) -> AsyncIterator[str]:
    """``ws_adapter.serve`` on loopback: yields its ws:// URL."""
    opts: dict[str, Any] = {"max_message_size": 1024, "message_queue_size": 4, "handshake_timeout": 5.0}
    opts.update(kw)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: ws_adapter.serve(
                lambda request, peer: handler(request), "127.0.0.1", 0, None, **opts, task_status=task_status
            )
        )
        yield f"ws://127.0.0.1:{port}/v1/ws"
        nursery.cancel_scope.cancel()


async def echo(request: WebSocketRequest) -> None:
    ws = await request.accept()
    while True:
        try:
            await ws.send_message(await ws.get_message())
        except ConnectionClosed:
            return


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


async def _close_code(ws: RawWs) -> int:
    try:
        while True:
            await ws.next()
    except Closed as closed:
        return closed.code


async def _echo_works(url: str) -> None:
    ws = await RawWs.connect(url)
    await ws.send_text("ping?")
    assert await ws.next() == "ping?"
    await ws.aclose()


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (ws_frame(OP_TEXT, b'"\xff"'), 1007),
        (ws_frame(0x3, b"x"), 1002),
        (ws_frame(OP_TEXT, b"{}", rsv=2), 1002),
        (ws_frame(OP_TEXT, b"{}", masked=False), 1002),
        (ws_frame(OP_PING, b"p", fin=False), 1002),
        (ws_frame(0x2, b"x" * 1025), 1009),
    ],
    ids=["invalid-utf8", "reserved-opcode", "rsv", "unmasked", "fragmented-ping", "too-big"],
)
async def test_fault_gets_close_frame_handler_sees_closed_listener_serves_on(raw: bytes, code: int) -> None:
    closed: list[Any] = []

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            while True:
                await ws.get_message()
        except ConnectionClosed as exc:
            closed.append(exc.reason)

    with trio.fail_after(10):
        async with serving(handler) as url:
            ws = await RawWs.connect(url)
            await ws.send_text("fine")
            await ws.send(Frame(OP_TEXT, b"", "fault", raw=raw))
            await ws.send_text("after the fault: never a message")
            assert await _close_code(ws) == code
            # the server closed TCP after the close frame (lingering close) without waiting
            # for us to close: the next read is EOF, not a hang
            assert (await ws.stream.receive_some(4096)) == b""
            await ws.aclose()
    assert [r.code for r in closed] == [code]


async def test_a_failing_handler_closes_1011_and_the_listener_keeps_serving() -> None:
    calls = 0

    async def handler(request: WebSocketRequest) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await request.accept()
            raise RuntimeError("boom")
        await echo(request)

    with trio.fail_after(10):
        async with serving(handler) as url:
            ws = await RawWs.connect(url)
            assert await _close_code(ws) == 1011
            await ws.aclose()
            await _echo_works(url)


async def test_a_failing_reader_ends_only_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_ping(self: Any, event: Any) -> None:
        raise RuntimeError("reader bug")

    monkeypatch.setattr(SidecarWebSocket, "_handle_ping_event", broken_ping)
    with trio.fail_after(10):
        async with serving(echo) as url:
            ws = await RawWs.connect(url)
            await ws.send(Frame(OP_PING, b"p", "ping"))
            assert await _close_code(ws) == NO_CLOSE_FRAME
            await ws.aclose()
            await _echo_works(url)


async def test_silent_connection_is_closed_after_the_handshake_timeout() -> None:
    with trio.fail_after(10):
        async with serving(echo, handshake_timeout=0.2) as url:
            stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
            assert await stream.receive_some(100) == b""
            await stream.aclose()
            await _echo_works(url)


async def test_frames_read_with_the_fault_are_ignored_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """An oversized message, a ping and a message in one TCP segment: 1009, no pong after the
    close frame, nothing logged as an error."""
    with trio.fail_after(10):
        async with serving(echo) as url:
            ws = await RawWs.connect(url)
            raw = ws_frame(0x2, b"x" * 1025) + ws_frame(OP_PING, b"p") + ws_frame(OP_TEXT, b"late")
            await ws.send(Frame(OP_TEXT, b"", "fault", raw=raw))
            assert await _close_code(ws) == 1009
            await ws.aclose()
            await _echo_works(url)
    assert [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []

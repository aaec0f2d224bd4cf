"""The client's keepalive: a PING without a PONG only means "sidecar lost" when nothing else arrived.

The server here is wsproto over a trio TCP stream, written so that it never answers a PING (a
trio-websocket server always does): it stands for a sidecar whose PONG is stuck behind a
backlog of events on a busy connection (seen in CI: a real vLLM engine, four long streams and a
CPU-starved test process — the client declared a working sidecar lost), and, when it stops
writing, for a frozen one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    Request,
    TextMessage,
)

from sidecar.client import SidecarConnectionError, open_sidecar
from sidecar.north import codec
from sidecar.north.codec import GenerateCommand
from sidecar.openengine import pb

INTERVAL, TIMEOUT = 0.2, 0.5


@dataclass
class PonglessSidecar:
    """Answers a ``generate`` with ``ticks`` token events ``gap`` seconds apart, then (unless
    ``freeze``) ``end completed``; with ``freeze`` it goes silent instead, connection open."""

    ticks: int
    gap: float
    freeze: bool = False
    #: reads nothing after the handshake (a SIGSTOPped sidecar: no PONG, no close reply)
    frozen: bool = False
    #: set on the first PING; with ``wait_for`` set, no event is sent before it is set
    pinged: threading.Event = field(default_factory=threading.Event)
    wait_for: threading.Event | None = None
    port: int = 0
    pings: list[bytes] = field(default_factory=list)

    async def run(self, *, task_status: trio.TaskStatus[PonglessSidecar] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        parts: list[str | bytes] = []
        async with trio.open_nursery() as nursery:
            while data := await stream.receive_some(65536):
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        await stream.send_all(ws.send(AcceptConnection()))
                        if self.frozen:
                            await trio.sleep_forever()
                    elif isinstance(event, Ping):
                        self.pings.append(bytes(event.payload))  # and no PONG
                        self.pinged.set()
                    elif isinstance(event, CloseConnection):
                        await stream.send_all(ws.send(event.response()))
                        return
                    elif isinstance(event, Message):
                        parts.append(event.data)
                        if event.message_finished:
                            frame = "".join(parts) if isinstance(parts[0], str) else b"".join(parts)  # type: ignore[arg-type]
                            parts.clear()
                            cmd = codec.decode_frame(frame)
                            if isinstance(cmd, GenerateCommand):
                                nursery.start_soon(self._generate, stream, ws, cmd)
            nursery.cancel_scope.cancel()

    async def _generate(self, stream: trio.SocketStream, ws: WSConnection, cmd: GenerateCommand) -> None:
        events = codec.EventEncoder(cmd.stream, cmd.encoding)
        if self.wait_for is not None:
            await trio.to_thread.run_sync(self.wait_for.wait, abandon_on_cancel=True)
        for i in range(self.ticks):
            token = pb.TokenOutput(output_index=0, tokens=[pb.TokenInfo(token_id=i, token="t")], text="t")
            await send(stream, ws, events.encode(pb.GenerateResponse(request_id="r", token=token)))
            await trio.sleep(self.gap)
        if self.freeze:
            await trio.sleep_forever()
        await send(stream, ws, codec.encode(codec.end_message(cmd.stream, "completed", None), cmd.encoding))


async def send(stream: trio.SocketStream, ws: WSConnection, frame: str | bytes) -> None:
    event = TextMessage(data=frame) if isinstance(frame, str) else BytesMessage(data=frame)
    await stream.send_all(ws.send(event))


@asynccontextmanager
async def serving(server: PonglessSidecar) -> AsyncIterator[str]:
    """``server`` running for the block (its URL), stopped after."""
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        yield f"ws://127.0.0.1:{server.port}"
        nursery.cancel_scope.cancel()


@contextmanager
def serving_in_thread(server: PonglessSidecar) -> Iterator[str]:
    """``server`` on its own trio loop in another thread (it keeps writing while the test's
    loop is blocked), stopped after."""
    started = threading.Event()
    token: list[trio.lowlevel.TrioToken] = []
    scopes: list[trio.CancelScope] = []

    async def main() -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            token.append(trio.lowlevel.current_trio_token())
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield f"ws://127.0.0.1:{server.port}"
    finally:
        token[0].run_sync_soon(scopes[0].cancel)
        thread.join(10)


async def test_a_client_starved_past_the_ping_deadline_keeps_its_connection() -> None:
    """The client's own loop blocked past its PING's deadline (a CPU-starved client process)
    while the sidecar kept writing: the events wait unread in the socket when the keepalive
    wakes. The keepalive used to decide in that same pass, before the reader could count
    them, and declared a working sidecar lost; a confirming PING now gives the reader time."""
    stalling = threading.Event()
    server = PonglessSidecar(ticks=40, gap=0.02, wait_for=stalling)
    with serving_in_thread(server) as url, trio.fail_after(15):
        async with open_sidecar(url, keepalive_interval=INTERVAL, keepalive_timeout=TIMEOUT) as sc:
            async with sc.generate({"prompt": "x"}) as stream, trio.open_nursery() as nursery:

                async def starve() -> None:
                    await trio.to_thread.run_sync(server.pinged.wait, abandon_on_cancel=True)
                    stalling.set()  # the server writes its events from now on...
                    time.sleep(TIMEOUT + 0.5)  # noqa: ASYNC251 (this loop cannot run, past the deadline)

                nursery.start_soon(starve)
                events = [e async for e in stream]
        assert len(events) == 40 and stream.end is not None and stream.end.outcome == "completed"


async def test_events_arriving_keep_a_connection_alive_without_pongs() -> None:
    # 4 s of events every 50 ms: many PING intervals pass, no PONG ever comes.
    server = PonglessSidecar(ticks=80, gap=0.05)
    with trio.fail_after(15):
        async with serving(server) as url:
            async with open_sidecar(url, keepalive_interval=INTERVAL, keepalive_timeout=TIMEOUT) as sc:
                async with sc.generate({"prompt": "x"}) as stream:
                    events = [e async for e in stream]
            assert len(events) == 80 and stream.end is not None and stream.end.outcome == "completed"
            assert len(server.pings) >= 3  # the keepalive did ping, and went unanswered


async def test_a_silent_sidecar_without_pongs_is_lost_within_interval_plus_timeout() -> None:
    server = PonglessSidecar(ticks=2, gap=0.01, freeze=True)
    with trio.fail_after(15):
        async with serving(server) as url:
            async with open_sidecar(url, keepalive_interval=INTERVAL, keepalive_timeout=TIMEOUT) as sc:
                async with sc.generate({"prompt": "x"}) as stream:
                    with pytest.raises(SidecarConnectionError, match="no answer to a ping"):
                        start = None
                        async for _ in stream:
                            start = trio.current_time()
                assert start is not None
                # The last event, then at most one interval before the PING and its timeout (+ slack).
                assert trio.current_time() - start < INTERVAL + TIMEOUT + 2.0


async def test_leaving_the_block_of_a_frozen_sidecar_raises_nothing() -> None:
    """The close handshake cannot complete against a frozen sidecar: leaving the block waits at
    most ``cancel_timeout`` and raises nothing (it raised trio-websocket's DisconnectionTimeout,
    which took down a P/D coordinator's connection pool in CI)."""
    server = PonglessSidecar(ticks=0, gap=0, frozen=True)
    with trio.fail_after(15):
        async with serving(server) as url:
            start = trio.current_time()
            async with open_sidecar(
                url, keepalive_interval=INTERVAL, keepalive_timeout=TIMEOUT, cancel_timeout=0.5
            ):
                pass
            assert trio.current_time() - start < 0.5 + 2.0


async def test_an_error_in_the_block_survives_a_close_timeout() -> None:
    server = PonglessSidecar(ticks=0, gap=0, frozen=True)
    with trio.fail_after(15):
        async with serving(server) as url:
            with pytest.raises(KeyError, match="mine"):
                async with open_sidecar(url, keepalive_interval=0, cancel_timeout=0.5):
                    raise KeyError("mine")

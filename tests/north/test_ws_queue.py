"""The queue of frames for one client (``sidecar.north.ws_server.Connection.send``): bounded in
frames and in bytes, senders wait for room, and a client stalled past ``stall_timeout`` is
closed once, with one log line however many senders were waiting (issue 15)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import trio

from sidecar.core.lifecycle import ClientGone
from sidecar.north.peers import Peer
from sidecar.north.ws_server import Connection, WsConfig


class StuckSocket:
    """Stands in for the WebSocket and its batch writer: takes the first batch, then never
    finishes writing (a client that stopped reading)."""

    def __init__(self) -> None:
        self.written: list[Sequence[str | bytes]] = []
        self.closed_with: list[int] = []

    async def send(self, frames: Sequence[str | bytes]) -> None:
        self.written.append(frames)
        await trio.sleep_forever()

    def interrupt(self) -> None:
        pass

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed_with.append(code)


def connection(**config: Any) -> tuple[Connection, StuckSocket]:
    sock = StuckSocket()
    conn = Connection(sock, None, WsConfig(**config), peer=Peer("p", "10.0.0.1:5"))  # type: ignore[arg-type]
    conn.batch = sock  # type: ignore[assignment]
    return conn, sock


async def test_queued_bytes_stay_within_the_bound(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    conn, sock = connection(max_pending_bytes=10_000, out_buffer=256, stall_timeout=5.0)
    frame = "x" * 1000
    gone = 0
    peak = 0

    async def sender() -> None:
        nonlocal gone, peak
        try:
            while True:
                await conn.send(frame)
                peak = max(peak, conn._queued_bytes)
        except ClientGone:
            gone += 1

    with caplog.at_level(logging.WARNING, logger="sidecar.north.ws_server"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn._writer)
            for _ in range(30):
                nursery.start_soon(sender)
            await trio.sleep(1)
            assert conn._queued_bytes <= 10_000 and conn._waiting == 30
            await trio.sleep(10)  # past the stall timeout
            nursery.cancel_scope.cancel()
    assert peak <= 10_000
    assert gone == 30 and sock.closed_with == [1008]
    stalled = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalled) == 1 and "10.0.0.1:5" in stalled[0].getMessage()
    assert "30 senders waiting" in stalled[0].getMessage()


async def test_a_frame_larger_than_the_bound_goes_alone(autojump_clock: Any) -> None:
    conn, _ = connection(max_pending_bytes=1024, out_buffer=256, stall_timeout=5.0)
    await conn.send("y" * 50_000)  # nothing queued: it may go
    assert conn._queued_bytes == 50_000
    with trio.move_on_after(1):
        await conn.send("z")
        raise AssertionError("queued behind a full queue")


async def test_frames_are_bounded_too(autojump_clock: Any) -> None:
    conn, _ = connection(max_pending_bytes=1 << 20, out_buffer=4, stall_timeout=5.0)
    for _ in range(4):
        await conn.send("f")
    with trio.move_on_after(1):
        await conn.send("f")
        raise AssertionError("a fifth frame was queued")

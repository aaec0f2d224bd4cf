"""Calls whose request bytes cannot leave end within a second when the engine's connection is
then reset (streams once waited for ``--first-event-timeout`` there).

A scripted HTTP/2 engine (the ``h2`` library on a raw trio socket over loopback) accepts one
connection and stalls the client's writes in one of two ways:

- ``flow-control``: it reads everything but advertises a 1 KiB stream window and never sends a
  WINDOW_UPDATE, so each call's request body waits for window;
- ``socket``: it grants the largest windows, then never reads, with a small receive buffer: the
  requests fill the kernel's buffers and the client's own send buffer, so the connection's
  writes wait for the socket (a blocked ``send_all``);
- ``stream-limit``: it allows one stream and answers none,
  so the next calls wait for a stream slot.

Once every task is blocked (``trio.testing.wait_all_tasks_blocked``: nothing moves any more),
the engine closes its listener and resets the connection (SO_LINGER 0: RST). Every call must
end with :class:`EngineUnavailable` (retryable) within a second.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio
import trio.testing

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineUnavailable

CALLS = 8
#: ``flow-control``: a request body well over the stream window (and, together, over the
#: connection's 64 KiB default), so none can be sent whole.
SMALL_WINDOW, SMALL_PROMPT = 1024, 64 * 1024
#: ``socket``: together far more than loopback TCP buffers hold (the client's send buffer grows
#: to ``tcp_wmem``'s maximum, 4 MiB by default; the engine's is pinned at ~32 KiB).
BIG_PROMPT, ENGINE_RCVBUF = 2 * 1024 * 1024, 16 * 1024
MAX_WINDOW = 2**31 - 1


class StallingEngine:
    """One-connection HTTP/2 server stalling the client's writes (module doc); :meth:`reset` RSTs."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0  # streams opened by the client (counted unless the mode is ``socket``)
        self.requests_complete = 0  # request bodies received whole
        self.listener = trio.socket.socket()
        self.sock: trio.socket.SocketType | None = None
        self._reading = trio.CancelScope()
        self.reset_done = trio.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def unread(self) -> int:
        """Bytes the kernel holds for the engine that it has not read."""
        assert self.sock is not None
        raw = fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        count: int = struct.unpack("i", raw)[0]
        return count

    def reset(self) -> None:
        """Close the listener (new connections are refused) and reset the connection."""
        self._reading.cancel()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.mode == "socket":  # accepted sockets inherit it; set before listen() to take effect
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, ENGINE_RCVBUF)
        await self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        task_status.started()
        sock, _ = await self.listener.accept()
        self.sock = sock
        stream = trio.SocketStream(sock)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        codes = h2.settings.SettingCodes
        settings = {
            "flow-control": {codes.INITIAL_WINDOW_SIZE: SMALL_WINDOW},
            "socket": {codes.INITIAL_WINDOW_SIZE: MAX_WINDOW},
            "stream-limit": {codes.MAX_CONCURRENT_STREAMS: 1},
        }[self.mode]
        conn.local_settings = h2.settings.Settings(client=False, initial_values=settings)
        conn.initiate_connection()
        if self.mode == "socket":
            conn.increment_flow_control_window(MAX_WINDOW - 65_535)
        await stream.send_all(conn.data_to_send())
        with self._reading:
            if self.mode == "socket":
                await trio.sleep_forever()  # never reads
            while data := await stream.receive_some(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        self.requests += 1
                    elif isinstance(event, h2.events.StreamEnded):
                        self.requests_complete += 1
                # SETTINGS acknowledgements only: received data is never acknowledged (no WINDOW_UPDATE)
                await stream.send_all(conn.data_to_send())
        self.listener.close()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        self.reset_done.set()


@asynccontextmanager
async def stalling_engine(mode: str) -> AsyncIterator[StallingEngine]:
    engine = StallingEngine(mode)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve)
        yield engine
        nursery.cancel_scope.cancel()
    engine.listener.close()
    if engine.sock is not None:
        engine.sock.close()


async def reset_then_expect_every_call_ended(
    engine: StallingEngine, all_ended: trio.Event, ended: Callable[[], int]
) -> None:
    """Reset the connection; within a second, every one of the ``CALLS`` calls must have ended."""
    engine.reset()
    with trio.move_on_after(1):
        await engine.reset_done.wait()
        await all_ended.wait()
    assert engine.reset_done.is_set()
    assert ended() == CALLS, f"{CALLS - ended()} of {CALLS} calls still waiting 1 s after the reset"


@pytest.mark.parametrize("mode", ["flow-control", "socket"])
async def test_calls_waiting_to_send_end_when_the_connection_is_reset(aio_loop: Any, mode: str) -> None:
    prompt = "x" * (SMALL_PROMPT if mode == "flow-control" else BIG_PROMPT)
    outcomes: dict[int, BaseException | str] = {}
    all_ended = trio.Event()

    async def call(client: Any, i: int) -> None:
        try:
            async with client.generate(pb.GenerateRequest(request_id=f"r{i}", prompt=prompt)) as stream:
                async for _ in stream:
                    outcomes[i] = "an event arrived"
                    break
                else:
                    outcomes[i] = "ended without an error"
        except EngineUnavailable as err:
            outcomes[i] = err
        if len(outcomes) == CALLS:
            all_ended.set()

    with trio.fail_after(20):
        async with (
            stalling_engine(mode) as engine,
            open_engine_client(engine.address, generate_channels=1) as client,
            trio.open_nursery() as nursery,
        ):
            for i in range(CALLS):
                nursery.start_soon(call, client, i)
            await trio.testing.wait_all_tasks_blocked()
            # the stall the test is about: every call is open, none ended, requests are stuck
            assert outcomes == {} and client.generate_stream_count == CALLS
            if mode == "flow-control":
                assert (engine.requests, engine.requests_complete) == (CALLS, 0)
            else:
                assert 0 < engine.unread() < CALLS * BIG_PROMPT
            await reset_then_expect_every_call_ended(engine, all_ended, lambda: len(outcomes))
    assert all(isinstance(o, EngineUnavailable) for o in outcomes.values()), outcomes


async def test_control_calls_waiting_for_a_stream_slot_end_when_the_connection_is_reset(
    aio_loop: Any,
) -> None:
    outcomes: list[BaseException] = []
    all_ended = trio.Event()

    async def health(client: Any) -> None:
        with pytest.raises(EngineUnavailable) as caught:
            await client.health()
        outcomes.append(caught.value)
        if len(outcomes) == CALLS:
            all_ended.set()

    with trio.fail_after(20):
        async with (
            stalling_engine("stream-limit") as engine,
            open_engine_client(engine.address) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(health, client)
            await trio.testing.wait_all_tasks_blocked()  # connected, the engine's SETTINGS applied
            for _ in range(CALLS - 1):
                nursery.start_soon(health, client)
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == [] and engine.requests == 1  # the others wait for the one slot
            await reset_then_expect_every_call_ended(engine, all_ended, lambda: len(outcomes))

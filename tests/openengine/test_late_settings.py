"""Streams opened before the engine's first SETTINGS frame arrived (issue 22: the 90-minute soak
on a loaded box ended hundreds of streams ``rejected`` retryable in rounds without a fault).

A busy engine can send its connection preface later than the pool's ``SETTINGS_WAIT`` (2 s).
The pool then opened up to ``max_streams_per_channel`` (128) streams on the new connection, but
an h2-based engine (grpclib's server, as the simulated engine) enforces its 100 streams from
its first byte and treats the 101st as a *connection* error: GOAWAY, and every stream on the
connection ends ``EngineUnavailable``. Until the peer's SETTINGS are seen, a connection takes
at most the RFC 9113 recommended minimum, 100; the rest go to another connection.

A scripted HTTP/2 engine (``h2`` on a raw trio socket over loopback, its default local settings)
accepts connections, sends its preface ``DELAY`` seconds late, then reads and never answers.
"""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import trio
import trio.testing

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineClientError
from sidecar.openengine.transport.pool import SETTINGS_WAIT

DELAY = SETTINGS_WAIT + 1.0
CALLS = 128


class LateEngine:
    """HTTP/2 server whose preface comes ``DELAY`` s after accept; counts streams, records errors."""

    def __init__(self) -> None:
        self.listener = trio.socket.socket()
        self.streams = 0
        self.errors: list[str] = []
        self.settled = trio.Event()  # CALLS streams arrived, or the engine or a call failed

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                sock, _ = await self.listener.accept()
                nursery.start_soon(self._connection, trio.SocketStream(sock))

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep(DELAY)
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            await stream.send_all(conn.data_to_send())
            while data := await stream.receive_some(65536):
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError as err:
                    self.errors.append(f"{type(err).__name__}: {err}")
                    self.settled.set()
                    await stream.send_all(conn.data_to_send())  # the GOAWAY
                    return
                self.streams += sum(isinstance(e, h2.events.RequestReceived) for e in events)
                if self.streams >= CALLS:
                    self.settled.set()
                await stream.send_all(conn.data_to_send())


async def test_streams_before_the_engines_settings_stay_within_its_default_limit(aio_loop: Any) -> None:
    engine = LateEngine()
    failed: list[str] = []

    async def call(client: Any, i: int) -> None:
        try:
            async with client.generate(pb.GenerateRequest(request_id=f"r{i}", prompt="x")) as stream:
                async for _ in stream:
                    break
        except EngineClientError as err:
            failed.append(f"{type(err).__name__}: {err}")
            engine.settled.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            await outer.start(engine.serve)
            async with (
                open_engine_client(engine.address, generate_channels=1) as client,
                trio.open_nursery() as nursery,
            ):
                for i in range(CALLS):
                    nursery.start_soon(call, client, i)
                # every stream reaches the engine (which answers none, so none ends)
                await engine.settled.wait()
                assert (engine.errors, failed[:3], engine.streams) == ([], [], CALLS)
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()

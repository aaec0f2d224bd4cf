"""HTTP/2 PING liveness of engine connections (sidecar/openengine/channel_pool.py, ``Keepalive``).

A real grpclib server over loopback whose connection stops reading — what a hung process or a
black-holed path looks like from our side: the kernel takes our bytes, nothing comes back.
"""

from __future__ import annotations

from typing import Any

import trio
import trio_asyncio

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineUnavailable
from sidecar.openengine.transport.connection import PINGS_PER_SILENCE, Keepalive
from tests.openengine.fake_grpc_engine import Gate, RunningServer, tokens
from tests.polling import eventually

INTERVAL, TIMEOUT = 0.2, 0.3


def stalled(server: RunningServer) -> Gate:
    """Every Generate sends one token, waits (alive, silent) at the returned gate, then finishes."""
    gate = Gate()

    def script(r: Any, md: Any) -> list[Any]:
        first, finish = tokens(r.request_id, 1)
        return [first, gate, finish]

    server.engine.streams["Generate"] = script
    return gate


def request(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, model="m", prompt="hi")


async def pause_server_reading(server: RunningServer, paused: bool) -> None:
    async def flip() -> None:
        for transport in server.transports:
            if not transport.is_closing():
                (transport.pause_reading if paused else transport.resume_reading)()

    await trio_asyncio.aio_as_trio(flip)()


def liveness_of(client: Any) -> Any:
    """What counts the PINGs of the client's one Generate connection (``_pings``)."""
    (conn,) = client._generate.connections()
    return conn


async def test_a_peer_that_stops_answering_is_closed_and_its_stream_fails(server: RunningServer) -> None:
    stalled(server)
    dead: list[int] = []
    keepalive = Keepalive(INTERVAL, TIMEOUT, lambda: dead.append(1))
    with trio.fail_after(10):
        async with open_engine_client(server.address, generate_channels=1, keepalive=keepalive) as client:
            async with client.generate(request("r1")) as stream:
                await stream.__anext__()  # the first token: the stream is open and healthy
                await pause_server_reading(server, True)  # the peer hangs
                t0 = trio.current_time()
                try:
                    async for _ in stream:
                        pass
                    raise AssertionError("the stream ended without an error")
                except EngineUnavailable as err:
                    assert "connection lost" in str(err)
                took = trio.current_time() - t0
            assert INTERVAL + TIMEOUT - 0.05 <= took < INTERVAL + TIMEOUT + 1.5, took
            assert dead == [1]
            await pause_server_reading(server, False)
            # reset, not closed: what was queued on the dead path is dropped, not delivered late
            await eventually(lambda: server.lost, timeout=5)
            assert isinstance(server.lost[0], ConnectionResetError), server.lost
            server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 2)
            async with client.generate(request("r2")) as again:  # a new connection serves
                assert len([e async for e in again]) == 3


async def test_a_live_silent_peer_gets_two_pings_and_keeps_its_stream(server: RunningServer) -> None:
    """A long prefill: the engine answers PINGs but sends no data. Two PINGs, then none until
    it sends data again (gRPC servers answer a third with GOAWAY too_many_pings); a probe
    sends one more whatever the count."""
    gate = stalled(server)
    dead: list[int] = []
    with trio.fail_after(10):
        async with open_engine_client(
            server.address,
            generate_channels=1,
            keepalive=Keepalive(INTERVAL, TIMEOUT, lambda: dead.append(1)),
        ) as client:
            async with client.generate(request("r1")) as stream:
                await stream.__anext__()
                liveness = liveness_of(client)
                await trio.sleep(8 * INTERVAL)  # silence long enough for many intervals
                assert liveness._pings == PINGS_PER_SILENCE and dead == []
                client.probe_liveness()
                await trio.sleep(2 * TIMEOUT)
                assert liveness._pings == PINGS_PER_SILENCE + 1 and dead == []

                async def open_gate() -> None:
                    gate.event.set()

                await trio_asyncio.aio_as_trio(open_gate)()
                assert len([e async for e in stream]) == 1  # the finish: the stream was never cut
            assert dead == []


async def test_without_keepalive_a_hung_peer_holds_the_stream(server: RunningServer) -> None:
    """The fault is real: with no keepalive nothing notices the peer stopped answering."""
    stalled(server)
    with trio.fail_after(10):
        async with open_engine_client(server.address, generate_channels=1) as client:
            async with client.generate(request("r1")) as stream:
                await stream.__anext__()
                await pause_server_reading(server, True)
                with trio.move_on_after(4 * (INTERVAL + TIMEOUT)) as waited:
                    await stream.__anext__()
                assert waited.cancelled_caught
            await pause_server_reading(server, False)

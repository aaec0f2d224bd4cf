"""The guard of sidecar/openengine/serving/_grpclib_internals.py: every grpclib / h2 internal the serving
side uses, exercised on real servers. A grpclib or h2 release that renames or reshapes one of
them fails here (and then only that module needs changing)."""

from __future__ import annotations

import grpclib.protocol
import pytest
import trio
import trio_asyncio

from sidecar.openengine.client import open_engine_client
from sidecar.openengine.serving import _grpclib_internals as internals
from sidecar.openengine.serving.grpc_server import open_server
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, RunningServer


def test_no_internal_is_missing() -> None:
    assert internals.missing_internals() == []


async def test_server_port_is_the_bound_ephemeral_port(aio_loop: trio_asyncio.TrioEventLoop) -> None:
    async def bound() -> int | None:
        async with open_server([], "127.0.0.1:0") as running:
            return running.address.port

    port = await trio_asyncio.aio_as_trio(bound)()
    assert port is not None and port > 0


async def test_servers_can_advertise_another_stream_limit(
    aio_loop: trio_asyncio.TrioEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpclib.protocol, "H2Connection", grpclib.protocol.H2Connection)  # undone after
    internals.advertise_max_concurrent_streams(1000)
    server = RunningServer(FakeGrpcEngine())
    await server.start()
    try:
        with trio.fail_after(10):
            async with open_engine_client(server.address) as client:
                await client.health()
                (conn,) = client._control.connections()
                assert conn.peer_max_streams == 1000
    finally:
        await server.stop()

"""Shared fixtures.

``OPENENGINE_SIDECAR_ENGINE_TRANSPORT=grpclib`` runs the whole session on the grpclib Generate
transport: the sidecars the tests start read it as ``run --engine-transport``, and the engine
clients the tests open in-process take it as their default.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import trio_asyncio

from sidecar.openengine import client as engine_client
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, RunningServer

#: The run's Generate transport (module doc).
TRANSPORT = os.environ.get("OPENENGINE_SIDECAR_ENGINE_TRANSPORT") or engine_client.DEFAULT_TRANSPORT
if TRANSPORT not in engine_client.TRANSPORTS:
    raise pytest.UsageError(
        f"OPENENGINE_SIDECAR_ENGINE_TRANSPORT={TRANSPORT!r}: not one of {engine_client.TRANSPORTS}"
    )
engine_client.DEFAULT_TRANSPORT = TRANSPORT


@pytest.fixture(params=engine_client.TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each Generate transport in turn (``open_engine_client(..., transport=transport)``)."""
    value: str = request.param
    return value


@pytest.fixture
async def aio_loop() -> AsyncIterator[trio_asyncio.TrioEventLoop]:
    """A trio-asyncio loop for tests that touch grpclib through the OpenEngine layer."""
    async with trio_asyncio.open_loop() as loop:
        yield loop


@pytest.fixture
async def server(aio_loop: trio_asyncio.TrioEventLoop) -> AsyncIterator[RunningServer]:
    """The scriptable fake engine (tests/openengine/fake_grpc_engine.py) on loopback gRPC."""
    srv = RunningServer(FakeGrpcEngine())
    await srv.start()
    yield srv
    await srv.stop()

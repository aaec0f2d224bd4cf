"""Shared fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio_asyncio

from tests.openengine.fake_grpc_engine import FakeGrpcEngine, RunningServer


@pytest.fixture
async def aio_loop() -> AsyncIterator[trio_asyncio.TrioEventLoop]:
    """A trio-asyncio loop for tests that serve an engine in-process (grpclib is asyncio)."""
    async with trio_asyncio.open_loop() as loop:
        yield loop


@pytest.fixture
async def server(aio_loop: trio_asyncio.TrioEventLoop) -> AsyncIterator[RunningServer]:
    """The scriptable fake engine (tests/openengine/fake_grpc_engine.py) on loopback gRPC."""
    srv = RunningServer(FakeGrpcEngine())
    await srv.start()
    yield srv
    await srv.stop()

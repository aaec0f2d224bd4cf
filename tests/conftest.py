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


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``dynamo``, ``vllm`` or ``sglang`` needs that optional extra: skipped without it
    locally, failed under CI (tests.prereq), before any of its fixtures start."""
    if item.get_closest_marker("dynamo") is not None:
        from tests.dynamo.e2e import require_dynamo

        require_dynamo()
    if item.get_closest_marker("vllm") is not None:
        from tests.vllm.harness import require_vllm

        require_vllm()
    if item.get_closest_marker("sglang") is not None:
        from tests.sglang.harness import require_sglang

        require_sglang()

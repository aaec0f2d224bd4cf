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


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``dynamo`` or ``vllm`` needs that optional extra: skipped without it
    locally, failed under CI (tests.prereq), before any of its fixtures start."""
    if item.get_closest_marker("dynamo") is not None:
        from tests.dynamo.e2e import require_dynamo

        require_dynamo()
    if item.get_closest_marker("vllm") is not None:
        from tests.vllm.harness import require_vllm

        require_vllm()

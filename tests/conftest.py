"""Shared fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio_asyncio


@pytest.fixture
async def aio_loop() -> AsyncIterator[trio_asyncio.TrioEventLoop]:
    """A trio-asyncio loop for tests that touch grpclib through the OpenEngine layer."""
    async with trio_asyncio.open_loop() as loop:
        yield loop

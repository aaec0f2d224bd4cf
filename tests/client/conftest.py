"""Fixtures: a scripted fake sidecar on 127.0.0.1, port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from tests.client.fake_sidecar import FakeSidecar


@pytest.fixture
async def fake(nursery: trio.Nursery) -> AsyncIterator[FakeSidecar]:
    server: FakeSidecar = await nursery.start(FakeSidecar().run)
    yield server

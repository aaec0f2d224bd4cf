"""Fixtures of the Dynamo end-to-end tests: a deployment on a real etcd (tcp requests, zmq
events: ``run --dynamo``'s defaults). Tests of other planes open their own
(``tests.dynamo.planes.deployment``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.dynamo.planes import Deployment, deployment


@pytest.fixture
async def etcd_deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    async with deployment(tmp_path) as dep:
        yield dep

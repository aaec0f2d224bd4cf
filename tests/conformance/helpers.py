"""Shared helpers of the conformance-suite tests (trio side; need the ``aio_loop`` fixture)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from sidecar.conformance.context import SuiteOptions
from sidecar.conformance.model import Status
from sidecar.conformance.runner import Report, run_suite
from sidecar.mock.faults import parse_faults
from tests.mock_engines import InProcessEngine, mock_engine_in_process

#: A conformant simulated engine: it frees a request whose client left (the mock's default
#: ``hold`` is the leak ``cancel.close-frees`` exists to catch) and takes 1 ms per token so
#: long requests stay running while a check acts on them.
CONFORMANT: dict[str, Any] = {"orphans": "release", "token_delay_ms": 1.0}


@asynccontextmanager
async def mock(
    flavor: str = "vllm", role: str = "aggregated", faults: tuple[str, ...] = (), **fields: Any
) -> AsyncIterator[InProcessEngine]:
    """An in-process simulated engine, conformant unless ``faults`` / ``fields`` say otherwise."""
    cfg = {**CONFORMANT, **fields}
    async with mock_engine_in_process(
        flavor=flavor, role=role, faults=parse_faults(faults, role=role), **cfg
    ) as engine:
        yield engine


async def suite(timeout: float = 60.0, **options: Any) -> Report:
    """Run the suite (destructive checks included unless told otherwise)."""
    options.setdefault("destructive", True)
    with trio.fail_after(timeout):
        return await run_suite(SuiteOptions(**options))


def ids(report: Report, status: Status) -> list[str]:
    return [r.check.id for r in report.results if r.status == status]


def explain(report: Report) -> str:
    """Failures and skips with reasons, for assertion messages."""
    return "\n".join(
        f"{r.status} {r.check.id}: {r.reason} {r.details[:3]}"
        for r in report.results
        if r.status != Status.PASS
    )

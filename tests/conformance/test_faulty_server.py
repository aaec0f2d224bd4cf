"""Purpose-built faulty engines: what the simulated engines cannot be made to do.

The aggregated mock never fails an accepted request on its own, so ``generate.nothing-after-error``
is shown failing against a small scripted server (and against the SGLang prefill mock in
test_faults.py). The raw streams the suite reads are checked here too: events before a
non-OK status are kept, an ``EngineError`` is an event, not an exception.
"""

from __future__ import annotations

from typing import Any

import trio

from sidecar.conformance.model import Status
from sidecar.conformance.streams import kind
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineStatusError

from .faulty_server import MODEL, error, faulty_engine, token, usage
from .helpers import explain, ids, suite


def _finished(request: pb.GenerateRequest) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request.request_id,
        finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH),
        usage=usage(),
    )


async def test_event_after_engine_error_fails_the_check(aio_loop: Any) -> None:
    async with faulty_engine(lambda r: ([token(r), error(r), token(r)], None)) as address:
        report = await suite(engine=address, only=("generate",))
    assert "generate.nothing-after-error" in ids(report, Status.FAIL), explain(report)
    result = next(r for r in report.results if r.check.id == "generate.nothing-after-error")
    assert "sent after EngineError" in result.reason


async def test_status_after_engine_error_fails_the_check(aio_loop: Any) -> None:
    """After its EngineError the call must close OK, not with a non-OK status."""
    async with faulty_engine(lambda r: ([token(r), error(r)], "INTERNAL")) as address:
        report = await suite(engine=address, only=("generate.nothing-after-error",))
    assert ids(report, Status.FAIL) == ["generate.nothing-after-error"], explain(report)
    assert "must close OK" in report.results[0].reason


async def test_well_behaved_failures_pass(aio_loop: Any) -> None:
    async with faulty_engine(lambda r: ([token(r), error(r)], None)) as address:
        report = await suite(engine=address, only=("generate.nothing-after-error", "generate.usage-final"))
    assert ids(report, Status.PASS) == ["generate.nothing-after-error", "generate.usage-final"], explain(
        report
    )


async def test_raw_stream_shows_everything(aio_loop: Any) -> None:
    async with (
        faulty_engine(lambda r: ([token(r), error(r), token(r), _finished(r)], "UNAVAILABLE")) as address,
        open_engine_client(address) as client,
    ):
        request = pb.GenerateRequest(request_id="raw-1", model=MODEL, prompt="hi")
        seen: list[str] = []
        with trio.fail_after(10):
            async with client.generate(request, checked=False) as stream:
                try:
                    async for event in stream:
                        seen.append(kind(event))
                except EngineStatusError as err:
                    seen.append(f"status {err.status}")
    assert seen == ["token", "error", "token", "finished", "status UNAVAILABLE"]

"""The suite blames the right check (issue 16, finding 7).

- a Generate stream that loses its connection before its terminal event fails the
  ``generate.*`` checks that judge it (never skipped, never passed);
- once an engine is unreachable the run stops with "engine lost during <check>" and later
  checks are reported not run, instead of failing for a cause that is not theirs;
- a KV sequence gap is ``kv.sequence``'s finding wherever in the run it happened (from the
  first batch: earlier checks, a warm-up, another kv check's window), not ``kv.rank``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.conformance.context import Context, SuiteOptions
from sidecar.conformance.corpus import Corpus
from sidecar.conformance.model import Status
from sidecar.conformance.runner import all_checks, run_check
from sidecar.conformance.streams import StreamRecord
from sidecar.openengine import pb
from tests.mock_engines import run_mock_engine

from .helpers import CONFORMANT, explain, ids, mock, suite


def _token(i: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id="r", token=pb.TokenOutput(output_index=0, tokens=[pb.TokenInfo(token_id=1000 + i)])
    )


@pytest.mark.parametrize(
    "check_id",
    ["generate.output-index", "generate.one-finish", "generate.usage-final", "generate.max-tokens"],
)
async def test_a_stream_lost_before_its_terminal_fails_the_check_judging_it(check_id: str) -> None:
    request = pb.GenerateRequest(request_id="r", prompt="p", stopping=pb.StoppingOptions(max_tokens=8))
    lost = StreamRecord(
        "basic", request, [_token(i) for i in range(3)], end="transport", error="Connection lost"
    )
    ctx = Context(SuiteOptions(engine="x"))
    ctx.cache["corpus"] = Corpus("aggregated", [lost])
    check = next(c for c in all_checks() if c.id == check_id)
    result = await run_check(ctx, check)
    assert result.status == Status.FAIL, result
    assert "connection was lost after 3 event(s) with no terminal event" in result.reason


@pytest.mark.parametrize("after", [3, 10])
async def test_engine_lost_stops_the_run_at_the_check_that_lost_it(
    tmp_path: Path, aio_loop: Any, after: int
) -> None:
    """crash-after=3 kills the engine during the first stream, crash-after=10 during a later one;
    either way the check building the stream corpus reports it and nothing after is blamed."""
    fields = {k.replace("_", "-"): v for k, v in CONFORMANT.items()}
    async with run_mock_engine(tmp_path, faults=[f"crash-after={after}"], **fields) as engine:
        report = await suite(engine=engine.address)
        await engine.wait()
    failed = ids(report, Status.FAIL)
    assert failed == ["generate.output-index"], explain(report)
    lost = next(r for r in report.results if r.check.id == "generate.output-index")
    assert lost.reason.startswith("engine lost during generate.output-index: --engine")
    assert any("connection was lost" in d for d in lost.details), lost.details
    assert report.engine_lost is not None and report.engine_lost.startswith("generate.output-index")
    after_it = report.results[[r.check.id for r in report.results].index("generate.output-index") + 1 :]
    assert after_it and all(
        r.status == Status.SKIP and r.reason == "not run: engine lost during generate.output-index"
        for r in after_it
    )
    assert len(report.results) == len(all_checks())


async def test_kv_gap_before_the_kv_checks_is_found_by_kv_sequence(aio_loop: Any, tmp_path: Path) -> None:
    """Batch 1 goes missing while the generate checks run, long before kv.sequence."""
    async with mock("vllm", "aggregated", ("kv-gap=1",)) as engine:
        report = await suite(engine=engine.address, lora_path=str(tmp_path), destructive=False)
    assert ids(report, Status.FAIL) == ["kv.sequence"], explain(report)
    result = next(r for r in report.results if r.check.id == "kv.sequence")
    assert result.reason == "rank 0: batch 0 followed by 2 (1 missing)"


@pytest.mark.parametrize(("flavor", "gap"), [("vllm", 6), ("vllm", 8), ("trtllm", 4), ("trtllm", 8)])
async def test_kv_gap_in_another_kv_checks_window_is_kv_sequence_s(
    aio_loop: Any, flavor: str, gap: int
) -> None:
    """With ``--only kv`` the batch goes missing while kv.rank or kv.resume watch (a warm-up,
    their stores); they judge rank attribution and resumption only, kv.sequence reports the gap."""
    async with mock(flavor, "aggregated", (f"kv-gap={gap}",), dp_size=2 if flavor == "vllm" else 1) as engine:
        report = await suite(engine=engine.address, only=("kv",))
    assert ids(report, Status.FAIL) == ["kv.sequence"], explain(report)
    result = next(r for r in report.results if r.check.id == "kv.sequence")
    assert "followed by" in result.reason or "stored last did not arrive" in result.reason

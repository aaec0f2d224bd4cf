"""Every simulated engine flavour and role passes the whole suite, P/D pairs included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.conformance.model import Status
from sidecar.mock.config import FLAVORS, ROLES

from .helpers import explain, ids, mock, suite

#: Checks an aggregated engine must actually pass (not skip): everything but the error
#: stream (no portable way to make an aggregated engine fail an accepted request) and P/D.
AGGREGATED_SKIPS = ["generate.nothing-after-error", "pd.handoff"]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_every_flavour_and_role_passes(aio_loop: Any, tmp_path: Path, flavor: str, role: str) -> None:
    dp = 2 if role == "aggregated" else 1
    async with mock(flavor, role, dp_size=dp, aliases=("conformance-alias",)) as engine:
        report = await suite(engine=engine.address, lora_path=str(tmp_path))
    assert not report.failed, explain(report)
    assert ids(report, Status.FAIL) == []
    skips = ids(report, Status.SKIP)
    if role == "aggregated":
        assert skips == AGGREGATED_SKIPS, explain(report)
    for r in report.results:
        if r.status == Status.SKIP:
            assert r.reason, f"{r.check.id} skipped without a reason"


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_pd_pairs_pass(aio_loop: Any, flavor: str) -> None:
    async with (
        mock(flavor, "prefill", kv_events="none") as pre,
        mock(flavor, "decode", kv_events="none") as dec,
    ):
        report = await suite(
            engine=pre.address, prefill=pre.address, decode=dec.address, only=("pd", "generate")
        )
    assert not report.failed, explain(report)
    passed = ids(report, Status.PASS)
    assert "pd.handoff" in passed
    # The consumed KV session offered to decode again (context-first) or the aborted
    # bootstrap prefill (SGLang) gives the error-stream check something to judge.
    assert "generate.nothing-after-error" in passed, explain(report)


async def test_decode_alone_skips_what_needs_a_session(aio_loop: Any) -> None:
    async with mock("vllm", "decode") as engine:
        report = await suite(engine=engine.address, only=("generate", "cancel.close-frees"))
    assert ids(report, Status.PASS) == []
    assert all("session" in r.reason or "EngineError" in r.reason for r in report.results), explain(report)


async def test_drain_checks_skip_unless_destructive(aio_loop: Any) -> None:
    async with mock() as engine:
        report = await suite(engine=engine.address, only=("drain",), destructive=False)
        assert ids(report, Status.SKIP) == ["drain.progress", "drain.deadline-zero", "drain.rejects-new"]
        assert all("--destructive" in r.reason for r in report.results)
        assert not engine.engine.draining  # the engine was left serving


async def test_capabilities_not_advertised_skip(aio_loop: Any) -> None:
    """No LoRA: the disabled answer is checked, the lifecycle skipped. No KV events: KV checks skip."""
    async with mock("vllm", enable_lora=False, kv_events="none") as engine:
        report = await suite(engine=engine.address, only=("lora", "kv", "discovery.kv-sources-routable"))
    assert ids(report, Status.PASS) == ["lora.errors"], explain(report)
    reasons = {r.check.id: r.reason for r in report.results}
    assert reasons["lora.errors"] == "LoRA disabled: status FAILED_PRECONDITION"
    assert "supports_lora" in reasons["lora.lifecycle"]
    assert "no KV event sources" in reasons["discovery.kv-sources-routable"]
    kv = ("kv.sequence", "kv.rank", "kv.resume", "kv.well-formed")
    assert all("no KV events" in reasons[k] for k in kv), explain(report)

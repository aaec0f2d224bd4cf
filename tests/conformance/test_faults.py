"""Every check can fail: a fault switch of the simulated engine makes exactly that check fail.

Each case runs the check's whole group (the checks closest to it, which share its
scenarios) against an engine with one fault, and asserts the failed set is exactly the
target. ``CONFORMANCE_FULL_SWEEP=1`` runs the whole suite for every case instead (about
a minute on two cores) to show no check elsewhere trips over the fault either — except for a
fault that breaks every accepted stream (:data:`BREAKS_EVERY_STREAM`): the checks that need
a stream to run on (cancellation, drain) fail under it too, so it runs its group only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sidecar.conformance.model import Status
from sidecar.conformance.runner import all_checks

from .helpers import explain, ids, mock, suite

FULL = os.environ.get("CONFORMANCE_FULL_SWEEP") == "1"

#: Faults after which no accepted stream of more than a few tokens ends well.
BREAKS_EVERY_STREAM = frozenset({"status-after=3", "undecodable-event"})

# (target check, flavour, role, faults, engine fields)
CASES: list[tuple[str, str, str, tuple[str, ...], dict[str, Any]]] = [
    ("discovery.revision", "vllm", "aggregated", ("wrong-revision",), {}),
    ("discovery.revision", "trtllm", "aggregated", ("wrong-min-client",), {}),
    ("discovery.release", "vllm", "aggregated", ("wrong-release",), {}),
    ("discovery.presence", "sglang", "aggregated", ("zero-presence",), {}),
    ("discovery.model-names", "vllm", "aggregated", ("phantom-alias",), {"aliases": ("qwen",)}),
    ("discovery.unknown-model", "vllm", "aggregated", ("any-model",), {}),
    ("discovery.kv-sources-routable", "vllm", "aggregated", ("kv-wildcard-source",), {}),
    ("discovery.kv-sources-ranks", "sglang", "aggregated", ("kv-missing-rank",), {"dp_size": 2}),
    ("discovery.connector-role", "vllm", "prefill", ("no-connector",), {}),
    ("generate.output-index", "vllm", "aggregated", ("no-output-index",), {}),
    ("generate.one-finish", "vllm", "aggregated", ("skip-finish",), {}),
    ("generate.nothing-after-finish", "trtllm", "aggregated", ("token-after-finish",), {}),
    ("generate.nothing-after-error", "sglang", "prefill", ("event-after-error",), {}),
    ("generate.usage-final", "vllm", "aggregated", ("no-usage",), {}),
    ("generate.usage-final", "sglang", "aggregated", ("early-usage",), {}),
    ("generate.prompt-once", "vllm", "aggregated", ("prompt-twice",), {}),
    ("generate.stop-match", "vllm", "aggregated", ("no-stop-match",), {}),
    ("generate.max-tokens", "trtllm", "aggregated", ("ignore-max-tokens",), {}),
    ("generate.output-index", "trtllm", "aggregated", ("output-index-range",), {}),
    ("generate.request-id", "vllm", "aggregated", ("wrong-request-id",), {}),
    ("generate.one-event", "sglang", "aggregated", ("empty-event",), {}),
    ("generate.closes-ok", "vllm", "aggregated", ("status-after=3",), {}),
    ("generate.closes-ok", "sglang", "aggregated", ("hold-after-terminal=1",), {}),
    ("generate.wire-format", "vllm", "aggregated", ("undecodable-event",), {}),
    ("errors.invalid-request", "vllm", "aggregated", ("late-invalid",), {}),
    ("errors.metadata-malformed", "vllm", "aggregated", ("lenient-metadata",), {}),
    ("errors.metadata-repeated", "sglang", "aggregated", ("repeated-metadata",), {}),
    ("errors.role-mismatch", "vllm", "aggregated", ("late-role-mismatch",), {}),
    ("errors.role-mismatch", "trtllm", "decode", ("late-role-mismatch",), {}),
    ("cancel.close-frees", "vllm", "aggregated", (), {"orphans": "hold"}),
    ("cancel.abort-running", "vllm", "aggregated", ("ignore-abort",), {"max_output_tokens": 300}),
    ("cancel.abort-finished", "vllm", "aggregated", ("abort-finished-aborted",), {}),
    ("cancel.abort-twice", "sglang", "aggregated", ("abort-twice-error",), {}),
    ("cancel.abort-no-target", "vllm", "aggregated", ("abort-no-target-found",), {}),
    ("cancel.abort-unknown", "trtllm", "aggregated", ("abort-unknown-aborted",), {}),
    ("lora.errors", "vllm", "aggregated", ("lora-lenient",), {}),
    ("lora.lifecycle", "vllm", "aggregated", ("lora-not-idempotent",), {}),
    ("kv.sequence", "vllm", "aggregated", ("kv-gap=3",), {}),
    ("kv.sequence", "trtllm", "aggregated", ("kv-publisher-restart=3",), {}),
    ("kv.rank", "sglang", "aggregated", ("kv-wrong-rank",), {"dp_size": 2}),
    ("kv.rank", "trtllm", "aggregated", ("kv-wrong-rank",), {}),
    ("kv.resume", "vllm", "aggregated", ("kv-replay-skip",), {}),
    ("kv.resume", "trtllm", "aggregated", ("kv-replay-skip",), {}),
    ("kv.well-formed", "trtllm", "aggregated", ("kv-empty-response",), {}),
    ("kv.well-formed", "trtllm", "aggregated", ("kv-event-after-error",), {}),
    ("kv.well-formed", "trtllm", "aggregated", ("kv-undecodable",), {}),
    ("kv.well-formed", "vllm", "aggregated", ("kv-undecodable",), {}),
    ("drain.progress", "vllm", "aggregated", ("drain-early-complete",), {}),
    ("drain.deadline-zero", "vllm", "aggregated", ("drain-ignores-deadline",), {"max_output_tokens": 300}),
    ("drain.rejects-new", "sglang", "aggregated", ("drain-keeps-accepting",), {}),
    ("drain.progress", "trtllm", "aggregated", ("drain-event-after-complete",), {}),
    ("drain.progress", "sglang", "aggregated", ("drain-empty-event",), {}),
    ("drain.progress", "trtllm", "aggregated", ("drain-no-complete",), {}),
]


def test_every_check_has_a_failing_case() -> None:
    """A check no fault can make fail is a defect (pd.handoff: test_pd_handoff_fails)."""
    covered = {c[0] for c in CASES} | {"pd.handoff"}
    assert {c.id for c in all_checks()} - covered == set()


@pytest.mark.parametrize(
    ("target", "flavor", "role", "faults", "fields"),
    CASES,
    ids=[f"{c[0]}-{c[1]}-{'+'.join(c[3]) or 'fields'}" for c in CASES],
)
async def test_fault_fails_exactly_its_check(
    aio_loop: Any,
    tmp_path: Path,
    target: str,
    flavor: str,
    role: str,
    faults: tuple[str, ...],
    fields: dict[str, Any],
) -> None:
    full = FULL and not BREAKS_EVERY_STREAM.intersection(faults)
    only = () if full else (target.split(".")[0],)
    async with mock(flavor, role, faults, **fields) as engine:
        report = await suite(engine=engine.address, only=only, lora_path=str(tmp_path))
    assert ids(report, Status.FAIL) == [target], explain(report)
    result = next(r for r in report.results if r.check.id == target)
    assert result.reason, "a failure names what broke the rule"


async def test_pd_handoff_fails(aio_loop: Any) -> None:
    """A decode engine that fails its accepted requests breaks the round trip."""
    async with mock("vllm", "prefill") as pre, mock("vllm", "decode", ("error-after=1",)) as dec:
        report = await suite(engine=pre.address, prefill=pre.address, decode=dec.address)
    assert ids(report, Status.FAIL) == ["pd.handoff"], explain(report)
    result = next(r for r in report.results if r.check.id == "pd.handoff")
    assert "INTERNAL" in " ".join(result.details)


async def test_pd_handoff_fails_on_a_session_a_decode_sidecar_refuses(aio_loop: Any) -> None:
    """The decode engine takes a session naming a DP rank it lacks; a sidecar in front of it would not."""
    async with (
        mock("vllm", "prefill", ("session-foreign-rank",), kv_events="none") as pre,
        mock("vllm", "decode", kv_events="none") as dec,
    ):
        report = await suite(engine=pre.address, prefill=pre.address, decode=dec.address, only=("pd",))
    assert ids(report, Status.FAIL) == ["pd.handoff"], explain(report)
    result = report.results[0]
    assert "a decode sidecar refuses" in result.reason and "dp_rank 1 is not a DP rank" in result.reason


async def test_no_drain_skips_the_drain_checks(aio_loop: Any) -> None:
    """An engine that does not implement Drain is not failed for it: the checks skip, saying why."""
    async with mock("vllm", "aggregated", ("no-drain",)) as engine:
        report = await suite(engine=engine.address, only=("drain",))
    assert ids(report, Status.SKIP) == ["drain.progress", "drain.deadline-zero", "drain.rejects-new"]
    assert all("UNIMPLEMENTED" in r.reason for r in report.results)

"""The suite against engines of every schema lineage (``mock-engine --schema``), role and release form.

A conformant engine of any of today's schemas passes: the revision and release checks
follow its numbering and release form, a Drain-less schema skips the drain checks, a
schema without ``handoff_profile`` is not failed for an empty one that derives, and the
P/D round trip works on each (SGLang without client bootstrap: context-first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.conformance.model import Status

from .helpers import explain, ids, mock, suite

SCHEMAS = ("a66ff6f", "4def7c5", "31be5db")
FORMS = ("source", "bsr")
#: P/D flavour per schema: client bootstrap where the schema has it, SGLang's context-first
#: fallback where it does not.
PD_FLAVOR = {"a66ff6f": "trtllm", "4def7c5": "sglang", "31be5db": "sglang"}
DRAINLESS = {"4def7c5", "31be5db"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("schema", SCHEMAS)
async def test_aggregated_engine_of_each_lineage_passes(
    aio_loop: Any, tmp_path: Path, schema: str, form: str
) -> None:
    """The whole suite on the source-commit release; discovery only on the BSR one (the
    release form changes nothing else)."""
    only = () if form == "source" else ("discovery",)
    async with mock("vllm", "aggregated", schema=schema, release_form=form) as engine:
        report = await suite(engine=engine.address, lora_path=str(tmp_path), only=only)
    assert ids(report, Status.FAIL) == [], explain(report)
    release = next(r for r in report.results if r.check.id == "discovery.release")
    assert ("known release" in release.reason) is (form == "source"), release.reason
    assert ("BSR commit" in release.reason) is (form == "bsr"), release.reason
    drain = [r for r in report.results if r.check.group == "drain"]
    if schema in DRAINLESS and form == "source":
        assert drain and all(r.status == Status.SKIP and "UNIMPLEMENTED" in r.reason for r in drain)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("schema", SCHEMAS)
async def test_pd_pair_of_each_lineage_passes(aio_loop: Any, schema: str, form: str) -> None:
    flavor = PD_FLAVOR[schema]
    fields = {"schema": schema, "release_form": form, "kv_events": "none"}
    async with mock(flavor, "prefill", **fields) as pre, mock(flavor, "decode", **fields) as dec:
        report = await suite(
            engine=pre.address, prefill=pre.address, decode=dec.address, only=("discovery", "pd", "generate")
        )
    assert ids(report, Status.FAIL) == [], explain(report)
    assert "pd.handoff" in ids(report, Status.PASS), explain(report)
    handoff = next(r for r in report.results if r.check.id == "pd.handoff")
    bootstrap = flavor == "sglang" and schema != "4def7c5"
    assert handoff.reason.startswith("bootstrap" if bootstrap else "context-first"), handoff.reason
    role = next(r for r in report.results if r.check.id == "discovery.connector-role")
    if schema == "4def7c5":
        assert "has no handoff_profile: derived sglang.bootstrap.v1" in role.reason, role.reason


async def test_missing_profile_is_a_failure_where_the_schema_defines_it(aio_loop: Any) -> None:
    """31be5db defines handoff_profile: an engine claiming that release with the field empty fails."""
    async with mock("vllm", "decode", schema="4def7c5", kv_events="none") as engine:
        legacy = await suite(engine=engine.address, only=("discovery.connector-role",))
    assert ids(legacy, Status.PASS) == ["discovery.connector-role"], explain(legacy)
    claims_31be5db = ("wrong-release=31be5dbeaaf5737a008abe9d29f0c07f3e80a4ef",)
    async with mock("vllm", "decode", claims_31be5db, schema="4def7c5", kv_events="none") as engine:
        report = await suite(engine=engine.address, only=("discovery.connector-role",))
    assert ids(report, Status.FAIL) == ["discovery.connector-role"], explain(report)
    assert "although schema 31be5db defines it" in report.results[0].reason

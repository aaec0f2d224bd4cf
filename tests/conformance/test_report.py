"""The summary table, the live progress lines and the JSON report (I/O-free)."""

from __future__ import annotations

import io
import json

from sidecar.conformance.context import SuiteOptions
from sidecar.conformance.model import Check, CheckResult, Status
from sidecar.conformance.progress import LineProgress
from sidecar.conformance.report import format_check_list, format_table
from sidecar.conformance.runner import Report, all_checks


async def _noop(ctx: object) -> None:
    return None


def _report() -> Report:
    a = Check("discovery.release", "schema_release is immutable", "ref#x", _noop)
    b = Check("generate.usage-final", "Usage only on the final event " * 5, "ref#y", _noop)
    c = Check("pd.handoff", "round trip", "ref#z", _noop)
    report = Report(SuiteOptions(engine="127.0.0.1:1"), started_at="now", duration=1.25)
    report.engines["engine"] = {
        "engine_name": "vllm",
        "engine_version": "1",
        "role": "aggregated",
        "address": "a:1",
    }
    report.results = [
        CheckResult(a, Status.PASS, "commit abc", duration=0.01),
        CheckResult(
            b, Status.FAIL, "stream 'basic': Usage on a non-final event", [f"detail {i}" for i in range(9)]
        ),
        CheckResult(c, Status.SKIP, "needs both --prefill and --decode"),
    ]
    return report


def test_table_shows_rule_result_and_reason() -> None:
    text = format_table(_report(), width=80)
    lines = text.splitlines()
    assert lines[0].split() == ["RESULT", "CHECK", "RULE"]
    assert any(line.startswith("pass    discovery.release") for line in lines)
    assert any(line.startswith("FAIL    generate.usage-final") for line in lines)
    assert "↳ stream 'basic': Usage on a non-final event" in text
    assert "↳ needs both --prefill and --decode" in text
    assert "detail 5" in text and "detail 6" not in text and "3 more (see the JSON report)" in text
    assert "commit abc" not in text  # pass notes live in the JSON report
    assert all(len(line) <= 80 for line in lines[:-1])
    assert lines[-1].startswith(
        "FAILED: 3 checks against vllm 1 (aggregated) at a:1: 1 passed, 1 failed, 1 skipped"
    )


def test_json_report() -> None:
    data = json.loads(json.dumps(_report().to_json()))
    assert data["summary"] == {"total": 3, "pass": 1, "fail": 1, "skip": 1, "ok": False, "engine_lost": None}
    assert data["options"]["engine"] == "127.0.0.1:1"
    check = data["checks"][1]
    assert check["id"] == "generate.usage-final" and check["status"] == "fail" and len(check["details"]) == 9
    assert check["rule"].startswith("Usage only") and check["ref"] == "ref#y"
    assert data["checks"][0]["reason"] == "commit abc"


def test_progress_plain_and_tty() -> None:
    report = _report()
    out = io.StringIO()
    plain = LineProgress(out, tty=False)
    for i, r in enumerate(report.results):
        plain.started(i, 3, r.check)
        plain.finished(i, 3, r)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[1/3] pass  discovery.release (10 ms)")
    assert lines[1].startswith("[2/3] FAIL  generate.usage-final") and "non-final" in lines[1]
    assert lines[2].endswith("skip  pd.handoff (0 ms): needs both --prefill and --decode")
    assert "\x1b" not in out.getvalue()
    tty_out = io.StringIO()
    tty = LineProgress(tty_out, tty=True)
    tty.started(0, 3, report.results[0].check)
    assert tty_out.getvalue().endswith("discovery.release …") and "\n" not in tty_out.getvalue()
    tty.finished(0, 3, report.results[0])
    assert tty_out.getvalue().count("\r\x1b[2K") == 2 and tty_out.getvalue().endswith("\n")


def test_check_list_names_every_check() -> None:
    text = format_check_list(all_checks())
    for c in all_checks():
        assert c.id in text
    assert "[destructive]" in text

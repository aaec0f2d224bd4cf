"""The human-readable summary of a run (the JSON form is :meth:`Report.to_json`)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

from sidecar.conformance.model import Check, Status
from sidecar.conformance.runner import Report

__all__ = ["format_check_list", "format_summary", "format_table"]

_LABEL = {Status.PASS: "pass", Status.FAIL: "FAIL", Status.SKIP: "skip"}
MAX_DETAILS = 6


def format_table(report: Report, *, width: int = 100) -> str:
    """One row per check: result, id, the rule it enforces; reasons and evidence below."""
    if not report.results:
        return "no checks ran"
    id_w = max(len(r.check.id) for r in report.results)
    rule_w = max(30, width - id_w - 9)
    lines = [f"{'RESULT':<6}  {'CHECK':<{id_w}}  RULE"]
    indent = " " * (6 + 2 + id_w + 2)
    for r in report.results:
        rule = textwrap.wrap(r.check.rule, rule_w) or [""]
        lines.append(f"{_LABEL[r.status]:<6}  {r.check.id:<{id_w}}  {rule[0]}")
        lines.extend(indent + more for more in rule[1:])
        if r.status != Status.PASS and r.reason:
            lines.extend(_wrapped(f"↳ {r.reason}", indent, rule_w))
        if r.status == Status.FAIL:
            for d in r.details[:MAX_DETAILS]:
                if d != r.reason:
                    lines.extend(_wrapped(f"  · {d}", indent, rule_w))
            if len(r.details) > MAX_DETAILS:
                lines.append(f"{indent}  · … {len(r.details) - MAX_DETAILS} more (see the JSON report)")
    lines.append("")
    lines.append(format_summary(report))
    return "\n".join(lines)


def _wrapped(text: str, indent: str, width: int) -> Iterable[str]:
    return [indent + part for part in textwrap.wrap(text, width, subsequent_indent="    ")]


def format_summary(report: Report) -> str:
    engine = report.engines.get("engine") or report.engines.get("prefill") or {}
    target = (
        f" against {engine.get('engine_name', '?')} {engine.get('engine_version', '')} "
        f"({engine.get('role', '?')}) at {engine.get('address', '?')}"
        if engine
        else ""
    )
    verdict = "FAILED" if report.failed else "OK"
    n = len(report.results)
    lost = f"; stopped: engine lost during {report.engine_lost}" if report.engine_lost else ""
    return (
        f"{verdict}: {n} check{'' if n == 1 else 's'}{target}: {report.count(Status.PASS)} passed, "
        f"{report.count(Status.FAIL)} failed, {report.count(Status.SKIP)} skipped in {report.duration:.1f} s"
        f"{lost}"
    )


def format_check_list(checks: Iterable[Check], *, width: int = 100) -> str:
    """``--list``: every check id with its rule."""
    checks = list(checks)
    id_w = max((len(c.id) for c in checks), default=10)
    out = []
    for c in checks:
        rule = textwrap.wrap(c.rule + (" [destructive]" if c.destructive else ""), max(30, width - id_w - 2))
        out.append(f"{c.id:<{id_w}}  {rule[0]}")
        out.extend(" " * (id_w + 2) + more for more in rule[1:])
    return "\n".join(out)

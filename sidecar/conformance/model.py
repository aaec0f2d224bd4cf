"""Checks, their results, and which checks a run selects (I/O-free).

A check is an ``async def fn(ctx) -> str | None`` registered with :func:`check`. It
passes by returning (optionally a one-line note), fails by raising :class:`Fail`, and
skips by raising :class:`Skip`, each with a one-line reason (plus optional detail
lines). Any other exception is a failure too (the runner reports its type and text).
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECKS",
    "Check",
    "CheckResult",
    "Fail",
    "Skip",
    "Status",
    "check",
    "require",
    "select_checks",
]

CheckFunc = Callable[[Any], Awaitable[str | None]]


class Status(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


class Skip(Exception):
    """The check does not apply to this engine (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Fail(Exception):
    """The engine broke the check's rule: ``reason`` is one line, ``details`` the evidence."""

    def __init__(self, reason: str, details: Iterable[str] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = list(details)


def require(condition: object, reason: str, details: Iterable[str] = ()) -> None:
    """Raise :class:`Fail` unless ``condition`` holds."""
    if not condition:
        raise Fail(reason, details)


@dataclass(frozen=True)
class Check:
    """One registered check. ``rule`` is the OpenEngine rule it enforces, ``ref`` where
    that rule is written (a URL of a section of the schema's api.md at the release we build from: :func:`sidecar.openengine.releases.spec_url`)."""

    id: str
    rule: str
    ref: str
    func: CheckFunc
    destructive: bool = False
    timeout: float = 30.0

    @property
    def group(self) -> str:
        return self.id.split(".", 1)[0]


@dataclass
class CheckResult:
    """The outcome of one check."""

    check: Check
    status: Status
    reason: str = ""
    details: list[str] = field(default_factory=list)
    duration: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.check.id,
            "group": self.check.group,
            "rule": self.check.rule,
            "ref": self.check.ref,
            "status": str(self.status),
            "reason": self.reason,
            "details": list(self.details),
            "duration_s": round(self.duration, 3),
            "destructive": self.check.destructive,
        }


#: Every registered check, in registration (= run) order.
CHECKS: list[Check] = []


def check(
    id: str, *, rule: str, ref: str, destructive: bool = False, timeout: float = 30.0
) -> Callable[[CheckFunc], CheckFunc]:
    """Register the decorated coroutine function as check ``id`` (``group.name``)."""

    def register(func: CheckFunc) -> CheckFunc:
        if any(c.id == id for c in CHECKS):
            raise ValueError(f"check {id!r} registered twice")
        CHECKS.append(Check(id, rule, ref, func, destructive, timeout))
        return func

    return register


def _matches(check_id: str, pattern: str) -> bool:
    """A glob on the id (``generate.*``); a bare group or id also matches (``generate``)."""
    pattern = pattern.strip()
    if not pattern:
        return False
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(check_id, pattern)
    return check_id == pattern or check_id.startswith(pattern + ".")


def _patterns(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        out.extend(p.strip() for p in value.split(",") if p.strip())
    return out


def select_checks(checks: Sequence[Check], only: Iterable[str] = (), skip: Iterable[str] = ()) -> list[Check]:
    """The checks ``--only`` keeps (all when empty) minus those ``--skip`` names.

    Patterns are globs on the check id or a group / id prefix, comma-separated or repeated.
    Raises ``ValueError`` for an ``--only`` pattern that matches no check (a typo would
    otherwise pass silently).
    """
    only_p, skip_p = _patterns(only), _patterns(skip)
    for p in only_p:
        if not any(_matches(c.id, p) for c in checks):
            raise ValueError(f"--only {p!r} matches no check (see --list)")
    return [
        c
        for c in checks
        if (not only_p or any(_matches(c.id, p) for p in only_p))
        and not any(_matches(c.id, p) for p in skip_p)
    ]

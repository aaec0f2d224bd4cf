"""Check registry, selection (--only / --skip) and the runner's handling of outcomes (I/O-free)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from sidecar.conformance.context import Context, SuiteOptions
from sidecar.conformance.model import Check, Fail, Skip, Status, select_checks
from sidecar.conformance.runner import GROUP_ORDER, all_checks, run_check
from sidecar.openengine.engine_errors import EngineUnavailable
from sidecar.openengine.releases import spec_url


def test_checks_are_registered_in_group_order() -> None:
    checks = all_checks()
    assert len({c.id for c in checks}) == len(checks)
    groups = [c.group for c in checks]
    assert groups == sorted(groups, key=GROUP_ORDER.index)
    assert groups[-1] == "drain", "the destructive checks run last"
    assert all(c.destructive for c in checks if c.group == "drain")
    assert not any(c.destructive for c in checks if c.group != "drain")
    for c in checks:
        assert c.rule and c.ref.startswith(spec_url() + "#"), c.id


def test_selection_patterns() -> None:
    checks = all_checks()
    every = [c.id for c in checks]
    assert [c.id for c in select_checks(checks)] == every
    gen = [c.id for c in select_checks(checks, only=["generate"])]
    assert gen and all(i.startswith("generate.") for i in gen)
    assert [c.id for c in select_checks(checks, only=["generate.*"])] == gen
    both = [c.id for c in select_checks(checks, only=["kv.rank,discovery.release"])]
    assert both == ["discovery.release", "kv.rank"]  # run order, not argument order
    some = [c.id for c in select_checks(checks, only=["cancel"], skip=["cancel.abort-*", "cancel.close*"])]
    assert some == []
    assert "drain.progress" not in [c.id for c in select_checks(checks, skip=["drain"])]
    assert [c.id for c in select_checks(checks, only=["kv"], skip=["kv.rank"])] == [
        "kv.resume",
        "kv.sequence",  # judges every batch of the run
        "kv.well-formed",  # last of its group: judges every subscription of the run
    ]
    with pytest.raises(ValueError, match="matches no check"):
        select_checks(checks, only=["genrate"])
    # "gen" is neither an id nor a group: no prefix matching inside names
    with pytest.raises(ValueError):
        select_checks(checks, only=["gen"])


def _check(func: Any, timeout: float = 5.0) -> Check:
    return Check("unit.check", "a rule", "ref#x", func, timeout=timeout)


async def test_run_check_outcomes() -> None:
    ctx = Context(SuiteOptions())

    async def passes(ctx: Context) -> str:
        return "note"

    async def skips(ctx: Context) -> None:
        raise Skip("not here")

    async def fails(ctx: Context) -> None:
        raise Fail("broken", ["a", "b"])

    async def lost(ctx: Context) -> None:
        raise EngineUnavailable("gone")

    async def buggy(ctx: Context) -> None:
        raise KeyError("x")

    async def slow(ctx: Context) -> None:
        await trio.sleep_forever()

    async def grouped(ctx: Context) -> None:
        raise ExceptionGroup("g", [Fail("inside a nursery")])

    r = await run_check(ctx, _check(passes))
    assert (r.status, r.reason) == (Status.PASS, "note")
    r = await run_check(ctx, _check(skips))
    assert (r.status, r.reason) == (Status.SKIP, "not here")
    r = await run_check(ctx, _check(fails))
    assert (r.status, r.reason, r.details) == (Status.FAIL, "broken", ["a", "b"])
    r = await run_check(ctx, _check(lost))
    assert r.status == Status.FAIL and "EngineUnavailable" in r.reason
    r = await run_check(ctx, _check(buggy))
    assert r.status == Status.FAIL and "KeyError" in r.reason
    r = await run_check(ctx, _check(slow, timeout=0.05))
    assert r.status == Status.FAIL and "did not finish within 0.05 s" in r.reason
    r = await run_check(ctx, _check(grouped))
    assert (r.status, r.reason) == (Status.FAIL, "inside a nursery")
    assert r.to_json()["status"] == "fail" and r.to_json()["id"] == "unit.check"


async def test_context_without_an_engine_skips() -> None:
    ctx = Context(SuiteOptions())
    with pytest.raises(Skip, match="--prefill"):
        ctx.client("prefill")


class _SlowLoad:
    """Context.busy answers: each poll takes ``took[i]`` seconds and answers ``counts[i]``."""

    def __init__(self, took: list[float], counts: list[int | None]) -> None:
        self.took, self.counts, self.polls = took, counts, 0

    async def __call__(self, which: str = "engine") -> int | None:
        i = min(self.polls, len(self.counts) - 1)
        self.polls += 1
        await trio.sleep(self.took[min(i, len(self.took) - 1)])
        return self.counts[i]


async def test_wait_busy_is_judged_by_answers_not_by_a_stalled_clock(autojump_clock: Any) -> None:
    """A poll under way at the deadline (a host that stalled the observer) may still answer:
    the request is counted; an engine that answered 'not busy' to the end is not."""
    ctx = Context(SuiteOptions())
    stalled = _SlowLoad(took=[12.0, 0.01], counts=[1])  # the first answer comes after 12 s
    ctx.busy = stalled  # type: ignore[method-assign]
    assert await ctx.wait_busy(0, 10.0)
    assert stalled.polls == 1
    idle = _SlowLoad(took=[0.5], counts=[0])
    ctx.busy = idle  # type: ignore[method-assign]
    start = trio.current_time()
    assert not await ctx.wait_busy(0, 10.0)
    assert 10.0 <= trio.current_time() - start < 11.0
    silent = _SlowLoad(took=[0.5], counts=[None])  # GetLoad never answers: bounded by 2x
    ctx.busy = silent  # type: ignore[method-assign]
    start = trio.current_time()
    assert not await ctx.wait_busy(0, 10.0)
    assert trio.current_time() - start == pytest.approx(20.0, abs=0.6)

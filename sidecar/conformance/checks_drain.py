"""Drain (destructive: only with ``--destructive``, and always last).

``drain.progress`` and ``drain.deadline-zero`` drain without ``stop_accepting_new_requests``
so the engine keeps serving; ``drain.rejects-new`` stops it accepting for good (it runs
last of all). An engine that answers ``UNIMPLEMENTED`` skips every drain check.
"""

from __future__ import annotations

import betterproto2
import trio

from sidecar.conformance import streams as rules
from sidecar.conformance.checks_cancel import (
    ANSWER_WITHIN,
    END_WITHIN,
    bootstrap_session,
    hold_running,
    ran_to_completion,
    running_request,
)
from sidecar.conformance.context import Context, describe_status
from sidecar.conformance.model import Fail, Skip, check, require
from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineClientError, EngineStatusError, EngineUnavailable
from sidecar.openengine.releases import spec_url

LIFECYCLE = spec_url("health-abort-and-drain")
DRAIN_WITHIN = 5.0
IMMEDIATE = 2.0
PEEK = 0.3


class DrainStream:
    """One raw Drain call, read event by event."""

    def __init__(self, stream: object) -> None:
        self._stream = stream
        self.events: list[pb.DrainResponse] = []
        self.end = ""  # ok | status NAME | transport
        self.status = ""

    async def next(self) -> pb.DrainResponse | None:
        if self.end:
            return None
        try:
            event: pb.DrainResponse = await self._stream.__anext__()  # type: ignore[attr-defined]
        except StopAsyncIteration:
            self.end = "ok"
            return None
        except EngineStatusError as err:
            self.end, self.status = "status", err.status
            return None
        except (EngineUnavailable, EngineClientError):
            self.end = "transport"
            return None
        self.events.append(event)
        return event

    def states(self) -> list[str]:
        out = []
        for e in self.events:
            name, value = betterproto2.which_one_of(e, "event")
            if name == "state" and isinstance(value, int):
                out.append(pb.DrainState(value).name or str(value))
            else:
                out.append("error" if name == "error" else "none")
        return out

    def check_skip(self) -> None:
        if self.end == "status" and self.status == "UNIMPLEMENTED" and not self.events:
            raise Skip("the engine does not implement Drain (UNIMPLEMENTED)")


def _needs_destructive(ctx: Context) -> None:
    if not ctx.options.destructive:
        raise Skip(
            "destructive: pass --destructive to run the drain checks (the engine stops accepting work)"
        )


def _sequence_problems(drain: DrainStream) -> list[str]:
    """STARTED first, only progress before COMPLETE, COMPLETE (or one EngineError) last, then close OK."""
    states = drain.states()
    problems = []
    if not states:
        return [f"the Drain call sent no event (ended {drain.end} {drain.status})"]
    if states[0] != "STARTED":
        problems.append(f"first drain event is {states[0]}, not STARTED")
    for i, s in enumerate(states[:-1]):
        if s in ("COMPLETE", "error"):
            problems.append(f"drain event #{i + 2} ({states[i + 1]}) follows the terminal {s}")
            break
        if s not in ("STARTED", "IN_PROGRESS"):
            problems.append(f"drain event #{i + 1} is {s}, not a progress state")
    if states[-1] not in ("COMPLETE", "error"):
        problems.append(f"the drain stream ended after {states[-1]} without COMPLETE")
    if drain.end != "ok":
        problems.append(f"the Drain call ended with {drain.end} {drain.status}".strip())
    return problems


@check(
    "drain.progress",
    rule="Drain streams STARTED first, then only progress (IN_PROGRESS) until COMPLETE, which comes only "
    "once in-flight work ended (no deadline); nothing follows it and the call closes OK",
    ref=LIFECYCLE,
    destructive=True,
)
async def progress(ctx: Context) -> str | None:
    _needs_destructive(ctx)
    client = ctx.client()
    problems: list[str] = []
    async with open_background_nursery() as nursery:
        live, release = await nursery.start(hold_running, ctx, "drain-progress")
        request = pb.DrainRequest(stop_accepting_new_requests=False)
        async with client.drain(request, checked=False) as stream:
            drain = DrainStream(stream)
            with trio.move_on_after(ANSWER_WITHIN):  # seeing STARTED: an observer's tolerance
                await drain.next()
            drain.check_skip()
            require(drain.events, f"no drain event within {ANSWER_WITHIN:g} s of Drain")
            with trio.move_on_after(PEEK):  # nothing terminal may come while work is in flight
                while (event := await drain.next()) is not None and event.state != pb.DrainState.COMPLETE:
                    pass
            early = [s for s in drain.states() if s in ("COMPLETE", "error")]
            if early:
                problems.append(f"Drain sent {early[0]} while a request was still running")
            # End the request: Abort, and close the stream too should Abort not end it.
            await ctx.abort(request_id=live.record.request.request_id)
            await live.rest(END_WITHIN / 2)
            release.set()
            with trio.move_on_after(DRAIN_WITHIN):
                while await drain.next() is not None:
                    pass
    problems += _sequence_problems(drain)
    last = drain.events[-1] if drain.events else None
    if last is not None and last.state == pb.DrainState.COMPLETE and last.in_flight_requests and not early:
        problems.append(f"COMPLETE without a deadline reports {last.in_flight_requests} request(s) in flight")
    require(not problems, problems[0] if problems else "", problems)
    return " → ".join(drain.states())


@check(
    "drain.deadline-zero",
    rule="Drain with deadline_ms 0 (and abort_after_deadline) is immediate: in-flight work ends and "
    "COMPLETE arrives at once",
    ref=LIFECYCLE,
    destructive=True,
)
async def deadline_zero(ctx: Context) -> str | None:
    _needs_destructive(ctx)
    client = ctx.client()
    async with running_request(ctx, "drain-zero") as (live, _baseline):
        request = pb.DrainRequest(stop_accepting_new_requests=False, deadline_ms=0, abort_after_deadline=True)
        start = trio.current_time()
        async with client.drain(request, checked=False) as stream, open_background_nursery() as nursery:
            drain = DrainStream(stream)
            nursery.start_soon(live.rest, ANSWER_WITHIN + IMMEDIATE + END_WITHIN)
            # "at once" counts from the engine's first answer (STARTED): seeing that one is an
            # observer's tolerance, as in drain.progress (a stalled host delays both ends)
            with trio.move_on_after(ANSWER_WITHIN) as window:
                while (event := await drain.next()) is not None:
                    window.deadline = min(window.deadline, trio.current_time() + IMMEDIATE)
                    if event.state == pb.DrainState.COMPLETE or event.error is not None:
                        break
            took = trio.current_time() - start
            drain.check_skip()
            done = "COMPLETE" in drain.states()
    problems = []
    if not drain.events:
        problems.append(f"no drain event within {ANSWER_WITHIN:g} s of a Drain with deadline_ms 0")
    elif not done:
        problems.append(
            f"no COMPLETE within {IMMEDIATE:g} s of STARTED with deadline_ms 0 ({drain.states()})"
        )
    if live.record.end != "ok" or rules.terminal_position(live.record) is None:
        problems.append(f"the in-flight request did not end with a terminal: {live.record.summary()}")
    elif (why := ran_to_completion(live.record)) is not None:
        problems.append(f"the in-flight request was not cut off at the deadline: {why}")
    require(not problems, problems[0] if problems else "", problems)
    return f"COMPLETE after {took * 1000:.0f} ms; request {describe_status(live.record)}"


@check(
    "drain.rejects-new",
    rule="once a Drain stops accepting new requests, new work is refused before acceptance (UNAVAILABLE, "
    "or one EngineError DRAINING) and Health reports DRAINING",
    ref=LIFECYCLE,
    destructive=True,
)
async def rejects_new(ctx: Context) -> str | None:
    _needs_destructive(ctx)
    client = ctx.client()
    request = pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=0, abort_after_deadline=True)
    async with client.drain(request, checked=False) as stream:
        drain = DrainStream(stream)
        with trio.move_on_after(DRAIN_WITHIN):
            while (event := await drain.next()) is not None:
                if event.state == pb.DrainState.COMPLETE or event.error is not None:
                    break
        drain.check_skip()
        if not drain.events:
            raise Fail(f"no drain event within {DRAIN_WITHIN:g} s")
    problems = []
    note = "no new-work probe (a decode engine refuses session-less work anyway)"
    if await ctx.role() != pb.EngineRole.DECODE:
        req = await ctx.request("after-drain", max_tokens=1, session=await bootstrap_session(ctx))
        rec = await ctx.record(req, timeout=10.0)
        drained_error = (
            len(rec.events) == 1
            and rec.events[0].error is not None
            and rec.events[0].error.code == pb.ErrorCode.DRAINING
        )
        if not (rec.refused and rec.status == "UNAVAILABLE") and not drained_error:
            problems.append(
                f"a new request after the drain was not refused as draining: {describe_status(rec)}"
            )
        note = f"new work: {describe_status(rec)}"
    health = await client.health()
    if health.state != pb.HealthState.DRAINING:
        problems.append(f"Health reports {pb.HealthState(health.state).name}, not DRAINING")
    require(not problems, problems[0] if problems else "", problems)
    return note

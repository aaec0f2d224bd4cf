"""Cancellation and Abort: closing a stream frees the request; Abort's outcomes.

"Running" is judged from the engine's own ``GetLoad`` (running + queued requests), so run
the suite against an otherwise idle engine. A "long" request asks for many tokens with
``ignore_eos`` so it is still running when the check acts on it.

How long the suite waits to *see* a long request running — its first token (``START_WITHIN``),
then GetLoad counting it (``SEEN_WITHIN``) — is an observer's tolerance, not a rule: no
contract bounds time to first token, a big model's prefill or a loaded host (a machine that
stalls every process for seconds) can take a while. The rules' own bounds (freed within
``FREE_WITHIN``, ended within ``END_WITHIN`` of an Abort) are unchanged by it; an engine's first
answer to a call (Drain's STARTED) is awaited ``ANSWER_WITHIN`` (measured here: a GetLoad to the
vLLM adapter held up to 9.5 s while a long request ran on a loaded two-core host).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from sidecar.conformance import streams as rules
from sidecar.conformance.context import Context, LiveStream
from sidecar.conformance.model import Fail, Skip, check, require
from sidecar.conformance.streams import StreamRecord
from sidecar.openengine import pb
from sidecar.openengine.releases import spec_url

LIFECYCLE = spec_url("health-abort-and-drain")
FREE_WITHIN = 1.0
SETTLE = 0.2
END_WITHIN = 3.0
START_WITHIN = 15.0
SEEN_WITHIN = 10.0
#: How long the first answer to a call (Drain's STARTED) is awaited: an observer's tolerance.
ANSWER_WITHIN = 30.0
#: How long a long request's baseline waits for a previous check's request to leave the engine.
LEAVE_WITHIN = 30.0
SUCCESS = ("ABORTED", "ALREADY_FINISHED")


async def bootstrap_session(ctx: Context) -> pb.KvSessionRef | None:
    """A bootstrap session for a client-bootstrap prefill (it then waits for a partner: running)."""
    if await ctx.role() != pb.EngineRole.PREFILL or not await ctx.uses_bootstrap():
        return None
    kv = await ctx.connector()
    assert kv is not None
    ep = next((e for e in kv.local_endpoints if e.host and e.port), None)
    if ep is None:
        raise Skip("client-bootstrap prefill engine advertises no local endpoint")
    return pb.KvSessionRef(
        handoff_profile=kv.handoff_profile,
        bootstrap=pb.KvBootstrap(endpoint=ep, room_id=secrets.randbits(62) | 1),
    )


async def hold_running(
    ctx: Context, label: str, *, task_status: trio.TaskStatus[tuple[LiveStream, trio.Event]]
) -> None:
    """A task that keeps a :func:`running_request` open until the event it reports is set."""
    release = trio.Event()
    async with running_request(ctx, label) as (live, _baseline):
        task_status.started((live, release))
        await release.wait()


@asynccontextmanager
async def running_request(ctx: Context, label: str) -> AsyncIterator[tuple[LiveStream, int]]:
    """Open a long request and yield once the engine shows it running: ``(stream, baseline)``.

    Skips when the engine cannot hold a request running on its own, does not report
    running requests, or never shows the request in them; fails when a long request does
    not start streaming tokens. Leaving the block closes the stream (HTTP/2 reset).
    """
    role = await ctx.role()
    session = await bootstrap_session(ctx)
    if role == pb.EngineRole.DECODE:
        raise Skip("decode engine: a request needs a KV session from a prefill")
    if role == pb.EngineRole.PREFILL and session is None:
        raise Skip("context-first prefill requests end at once: none can be held running")
    baseline = await ctx.busy()
    if baseline is None:
        raise Skip("GetLoad does not report running_requests")
    if baseline > 0:
        # the previous check's request may still be on its way out (an Abort being carried
        # out): a baseline counting it would hide the new request when it leaves
        # (bounded, and longer than SEEN_WITHIN: a loaded engine may take seconds to carry out
        # an Abort, and a request leaving while the new one is watched for hides the new one)
        _freed, _took, now = await _settled(ctx, 0, LEAVE_WITHIN)
        baseline = now if now is not None else baseline
    max_tokens = 1 if session is not None else await ctx.long_max_tokens()
    req = await ctx.request(label, max_tokens=max_tokens, ignore_eos=True, session=session)
    async with ctx.open(req, label=label) as live:
        if session is None:
            first = await live.until(("token", "finished", "error", "prefill_ready"), START_WITHIN)
            if first is None or rules.kind(first) != "token":
                raise Fail(
                    f"a long request did not start streaming tokens within {START_WITHIN:g} s: "
                    f"{live.record.summary()}"
                )
        if not await ctx.wait_busy(baseline, SEEN_WITHIN):
            raise Skip(
                f"the long request ({max_tokens} tokens) never showed in GetLoad running/queued "
                f"requests within {SEEN_WITHIN:g} s (an engine this fast may have finished it first; "
                f"running+queued {baseline} before it, {await ctx.busy()} now)"
            )
        yield live, baseline


async def _settled(ctx: Context, baseline: int, within: float) -> tuple[bool, float, int | None]:
    """Poll until running + queued is back to ``baseline``: (freed, seconds, last value).

    Judged by answers, as :meth:`Context.wait_busy`: a poll under way at the deadline may
    answer (bounded by ``ANSWER_WITHIN``); the seconds reported are those to the answer."""
    start = trio.current_time()
    now: int | None = None
    with trio.move_on_after(within + ANSWER_WITHIN):
        while True:
            now = await ctx.busy()
            if now is not None and now <= baseline:
                return True, trio.current_time() - start, now
            if trio.current_time() - start >= within:
                break
            await trio.sleep(0.02)
    return False, trio.current_time() - start, now


@check(
    "cancel.close-frees",
    rule="closing a Generate stream mid-flight frees the request on the engine: its running count "
    "drops back within 1 s and stays there (no further tokens)",
    ref=LIFECYCLE,
)
async def close_frees(ctx: Context) -> str | None:
    async with running_request(ctx, "close") as (live, baseline):
        pass  # leaving the block resets the HTTP/2 stream
    freed, took, now = await _settled(ctx, baseline, FREE_WITHIN)
    if not freed:
        await ctx.abort(request_id=live.record.request.request_id)  # don't leave it to later checks
        raise Fail(
            f"{FREE_WITHIN:g} s after the client closed the stream the engine still runs it "
            f"(running+queued {now}, was {baseline} before)"
        )
    await trio.sleep(SETTLE)
    later = await ctx.busy()
    require(later is not None and later <= baseline, f"the closed request came back (running+queued {later})")
    return f"freed after {took * 1000:.0f} ms"


def ran_to_completion(rec: StreamRecord) -> str | None:
    """Why ``rec`` looks like it ran its course (to ``max_tokens``, no CANCELLED finish), or None."""
    terminal = rules.terminal_position(rec)
    if terminal is None or rules.kind(rec.events[terminal]) != "finished":
        return None
    if any(e.finished is not None and e.finished.reason == pb.FinishReason.CANCELLED for e in rec.events):
        return None
    limit = rec.request.stopping.max_tokens if rec.request.stopping else None
    produced = max(rules.tokens_per_output(rec).values(), default=0)
    if limit is not None and produced >= limit:
        return f"the stream ran on to max_tokens ({produced} tokens)"
    return None


def _ended_by_abort(live: LiveStream) -> str | None:
    """Why the stream's end does not look like the Abort's doing (None if it does)."""
    rec = live.record
    if rec.end != "ok":
        return f"the aborted stream did not close OK: {rec.summary()}"
    if rules.terminal_position(rec) is None:
        return f"the aborted stream closed without a terminal event: {rec.summary()}"
    why = ran_to_completion(rec)
    return None if why is None else f"{why} after Abort answered ABORTED"


@check(
    "cancel.abort-running",
    rule="Abort{request_id} of a running request answers ABORTED and ends its stream with a terminal "
    "(GenerationFinished CANCELLED or EngineError), then the call closes OK",
    ref=LIFECYCLE,
)
async def abort_running(ctx: Context) -> str | None:
    async with running_request(ctx, "abort") as (live, _baseline):
        outcome = await ctx.abort(request_id=live.record.request.request_id)
        require(outcome in SUCCESS, f"Abort of a running request answered {outcome}")
        ended = await live.rest(END_WITHIN)
        require(ended, f"the stream did not end within {END_WITHIN:g} s of Abort ({live.record.summary()})")
        why = _ended_by_abort(live)
        require(why is None, why or "")
    return f"Abort answered {outcome}; {live.record.summary()}"


async def _completed(ctx: Context, label: str) -> tuple[str, pb.KvSessionRef | None]:
    """Run a short request to its terminal; returns (request id, KV session of a PrefillReady)."""
    mode = await ctx.standalone()
    if mode is None:
        raise Skip("this engine completes no request on its own (decode, or a prefill needing a bootstrap)")
    req = await ctx.request(label, max_tokens=1 if mode == "prefill" else 2)
    rec = await ctx.record(req, timeout=15.0)
    terminal = rules.terminal_position(rec)
    if terminal is None or rec.end != "ok" or rules.kind(rec.events[terminal]) == "error":
        raise Fail(f"a short request did not complete: {rec.summary()}")
    ready = rec.events[terminal].prefill_ready
    return req.request_id, ready.kv_session if ready is not None else None


@check(
    "cancel.abort-finished",
    rule="Abort of a request that already completed answers ALREADY_FINISHED or NOT_FOUND (a prefill "
    "whose KV session Abort released may answer ABORTED once)",
    ref=LIFECYCLE,
)
async def abort_finished(ctx: Context) -> str | None:
    rid, session = await _completed(ctx, "finished")
    first = await ctx.abort(request_id=rid)
    done = ("ALREADY_FINISHED", "status NOT_FOUND")
    if session is not None and first == "ABORTED":
        second = await ctx.abort(request_id=rid)
        require(
            second in done,
            f"after ABORTED released the prefill's KV session, a second Abort answered {second}",
        )
        return f"ABORTED (KV session released), then {second}"
    require(first in done, f"Abort of a completed request answered {first}")
    return first


@check(
    "cancel.abort-twice",
    rule="Abort is idempotent: a second Abort of the same request succeeds (ABORTED or ALREADY_FINISHED; "
    "NOT_FOUND once it is gone) and the stream still gets exactly one terminal",
    ref=LIFECYCLE,
)
async def abort_twice(ctx: Context) -> str | None:
    ok_second = (*SUCCESS, "status NOT_FOUND")
    role = await ctx.role()
    if role == pb.EngineRole.AGGREGATED or await bootstrap_session(ctx) is not None:
        async with running_request(ctx, "twice") as (live, _baseline):
            rid = live.record.request.request_id
            first = await ctx.abort(request_id=rid)
            second = await ctx.abort(request_id=rid)
            await live.rest(END_WITHIN)
        require(first in SUCCESS, f"the first Abort of a running request answered {first}")
        require(second in ok_second, f"a second Abort of the same request answered {second}")
        dupes = rules.finish_count_violations(live.record, prefill=role == pb.EngineRole.PREFILL)
        require(not dupes, dupes[0] if dupes else "", dupes)
        return f"{first}, then {second}"
    rid, _session = await _completed(ctx, "twice")
    first = await ctx.abort(request_id=rid)
    second = await ctx.abort(request_id=rid)
    done = ("ALREADY_FINISHED", "status NOT_FOUND")
    require(first in (*done, "ABORTED"), f"the first Abort of a completed request answered {first}")
    require(second in done, f"a second Abort of a completed request answered {second}")
    return f"{first}, then {second} (completed request)"


@check(
    "cancel.abort-no-target",
    rule="Abort with no target answers INVALID_ARGUMENT",
    ref=LIFECYCLE,
)
async def abort_no_target(ctx: Context) -> str | None:
    outcome = await ctx.abort()
    require(outcome == "status INVALID_ARGUMENT", f"Abort with no target answered {outcome}")
    return None


@check(
    "cancel.abort-unknown",
    rule="Abort naming a request the engine never saw answers NOT_FOUND",
    ref=LIFECYCLE,
)
async def abort_unknown(ctx: Context) -> str | None:
    outcome = await ctx.abort(request_id=ctx.new_id("never-sent"))
    require(outcome == "status NOT_FOUND", f"Abort of an unknown request id answered {outcome}")
    return None

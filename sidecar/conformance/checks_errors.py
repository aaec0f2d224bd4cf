"""Refusals before acceptance: invalid requests, ``openengine-*`` metadata, role mismatch.

Each must be a non-OK gRPC status with no response event (the schema's api.md, "Standard errors":
before acceptance → status, no events). Metadata checks first send a control request
(the same request without the bad metadata) and skip when even that is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.conformance.context import Context, describe_status
from sidecar.conformance.model import Skip, check, require
from sidecar.conformance.streams import StreamRecord
from sidecar.openengine import pb
from sidecar.openengine.releases import spec_url

ERRORS = spec_url("standard-errors")
METADATA = spec_url("grpc-request-metadata")
ROLES = spec_url("server-identity-deployment-capacity-and-engine-roles")

KEY_ROUTING = "openengine-routing-key"
KEY_RANK = "openengine-target-dp-rank"
KEY_PRIORITY = "openengine-priority"


def _refusal_problem(rec: StreamRecord, what: str, status: str | None = None) -> str | None:
    """Why ``rec`` is not a refusal before acceptance (with ``status`` when given), or None."""
    if rec.end == "status" and not rec.events:
        if status is not None and rec.status != status:
            return f"{what}: answered status {rec.status}, expected {status}"
        return None
    if rec.events:
        return f"{what}: accepted and answered with events ({describe_status(rec)}); expected a status, no events"
    return f"{what}: expected a non-OK status, got {describe_status(rec)}"


async def _plain(ctx: Context, label: str) -> pb.GenerateRequest:
    return await ctx.request(label, max_tokens=1)


async def _control(ctx: Context) -> None:
    """Skip unless a plain one-token request is accepted on this engine alone."""
    if await ctx.standalone() is None:
        raise Skip(
            "this engine accepts no request on its own (decode, or a prefill that needs a bootstrap partner)"
        )
    rec = await ctx.record(await _plain(ctx, "control"), timeout=15.0)
    if rec.refused:
        raise Skip(f"the control request (no bad metadata) was refused too: status {rec.status}")


@check(
    "errors.invalid-request",
    rule="an invalid request (no input, unknown model, num_sequences 0) is refused before acceptance: "
    "non-OK status, no events",
    ref=ERRORS,
)
async def invalid_request(ctx: Context) -> str | None:
    if await ctx.standalone() is None:
        raise Skip(
            "this engine refuses every request without a KV session or partner: an invalid request's "
            "refusal would prove nothing"
        )
    cases: list[tuple[str, pb.GenerateRequest]] = []
    no_input = pb.GenerateRequest(
        request_id=ctx.new_id("no-input"),
        model=await ctx.model(),
        stopping=pb.StoppingOptions(max_tokens=1),
    )
    cases.append(("request without prompt or token_ids", no_input))
    unknown = await _plain(ctx, "unknown-model")
    unknown.model = f"conformance-no-such-model-{ctx.run_id}"
    cases.append(("request for a model the engine does not serve", unknown))
    zero = await ctx.request("zero-outputs", max_tokens=1, num_sequences=0)
    cases.append(("num_sequences 0 (must be > 0 when present)", zero))
    problems = []
    for what, req in cases:
        rec = await ctx.record(req, timeout=15.0)
        if (why := _refusal_problem(rec, what)) is not None:
            problems.append(why)
    require(not problems, problems[0] if problems else "", problems)
    return f"{len(cases)} invalid requests refused"


async def _metadata_cases(ctx: Context, cases: Sequence[tuple[str, list[tuple[str, str]]]]) -> list[str]:
    problems = []
    for what, md in cases:
        rec = await ctx.record(await _plain(ctx, "metadata"), metadata=md, timeout=15.0)
        if (why := _refusal_problem(rec, what, "INVALID_ARGUMENT")) is not None:
            problems.append(why)
    return problems


async def _priority(ctx: Context) -> bool:
    gen = (await ctx.model_info()).generation
    return bool(gen is not None and gen.supports_priority)


@check(
    "errors.metadata-malformed",
    rule="a malformed openengine-* number (target DP rank not a uint32, priority not an int32) is "
    "refused with INVALID_ARGUMENT",
    ref=METADATA,
)
async def metadata_malformed(ctx: Context) -> str | None:
    await _control(ctx)
    cases = [
        (f"{KEY_RANK}: abc", [(KEY_RANK, "abc")]),
        (f"{KEY_RANK}: -1", [(KEY_RANK, "-1")]),
        (f"{KEY_RANK}: 4294967296 (above uint32)", [(KEY_RANK, "4294967296")]),
    ]
    if await _priority(ctx):
        cases += [
            (f"{KEY_PRIORITY}: high", [(KEY_PRIORITY, "high")]),
            (f"{KEY_PRIORITY}: 2147483648 (above int32)", [(KEY_PRIORITY, "2147483648")]),
        ]
    problems = await _metadata_cases(ctx, cases)
    require(not problems, problems[0] if problems else "", problems)
    return f"{len(cases)} malformed values refused"


@check(
    "errors.metadata-repeated",
    rule="an openengine-* key sent more than once is refused with INVALID_ARGUMENT",
    ref=METADATA,
)
async def metadata_repeated(ctx: Context) -> str | None:
    await _control(ctx)
    rank = str((await ctx.dp_ranks())[0])
    cases = [
        (f"{KEY_ROUTING} twice", [(KEY_ROUTING, "a"), (KEY_ROUTING, "b")]),
        (f"{KEY_RANK} twice", [(KEY_RANK, rank), (KEY_RANK, rank)]),
    ]
    if await _priority(ctx):
        cases.append((f"{KEY_PRIORITY} twice", [(KEY_PRIORITY, "1"), (KEY_PRIORITY, "1")]))
    problems = await _metadata_cases(ctx, cases)
    require(not problems, problems[0] if problems else "", problems)
    return f"{len(cases)} repeated keys refused"


def _bogus_session(kv: pb.KvConnectorInfo | None) -> pb.KvSessionRef:
    return pb.KvSessionRef(
        session_id="conformance-bogus-session",
        handoff_profile=(kv.handoff_profile if kv is not None else "") or "vllm.kv_transfer_params.v1",
        transfer_backend=kv.transfer_backend if kv is not None else "",
    )


@check(
    "errors.role-mismatch",
    rule="a request that does not fit the engine's role (a KV session to an aggregated engine, none to a "
    "decode engine or a client-bootstrap prefill) is refused before acceptance: non-OK status, no events",
    ref=ROLES,
)
async def role_mismatch(ctx: Context) -> str | None:
    role = await ctx.role()
    if role == pb.EngineRole.AGGREGATED:
        what = "aggregated engine given kv.session"
        req = await ctx.request("role", max_tokens=1, session=_bogus_session(None))
    elif role == pb.EngineRole.DECODE:
        what = "decode engine given no kv.session"
        req = await ctx.request("role", max_tokens=1)
    elif role == pb.EngineRole.PREFILL and await ctx.uses_bootstrap():
        what = "client-bootstrap prefill engine given no kv.session bootstrap"
        req = await ctx.request("role", max_tokens=1)
    else:
        raise Skip("a context-first prefill engine has no portable role mismatch to probe")
    rec = await ctx.record(req, timeout=15.0)
    why = _refusal_problem(rec, what)
    require(why is None, why or "")
    return f"{what}: status {rec.status}"

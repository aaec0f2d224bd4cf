"""Prefill/decode handoff round trip (needs ``--prefill`` and ``--decode``).

Context-first pairs (vLLM, TensorRT-LLM): the prefill runs with ``max_tokens`` 1 and ends
in ``PrefillReady{kv_session}``; the decode request carries that session unchanged.
Client-bootstrap pairs (SGLang): the suite creates a room, takes the endpoint from the
prefill's ``kv_connector.local_endpoints``, puts the same ``KvBootstrap`` on both requests
and sends them at once. Afterwards (context-first only) the consumed session is offered to
decode once more; that stream feeds ``generate.nothing-after-error``. A context-first
session is also judged as a decode sidecar judges it before its engine sees it: the
sidecar's own envelope check (``sidecar.core.handoff.check_decode_session``) against the
decode engine's card, discovered as the sidecar discovers it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sidecar.conformance import streams as rules
from sidecar.conformance.context import Context
from sidecar.conformance.model import Fail, Skip, check, require
from sidecar.conformance.streams import StreamRecord
from sidecar.core.discovery import discover
from sidecar.core.errors import DiscoveryError, Rejection, error_code_name
from sidecar.core.handoff import check_decode_session
from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineClientError
from sidecar.openengine.releases import spec_url

PD = spec_url("disaggregated-serving-and-kv-api")
PROMPT = "Prefill and decode must agree on every block of this prompt, " * 4
TIMEOUT = 30.0


@dataclass
class Handoff:
    mode: str
    prefill: StreamRecord | None = None
    decode: StreamRecord | None = None
    stale: StreamRecord | None = None
    problems: list[str] = field(default_factory=list)


async def _pair(ctx: Context) -> tuple[pb.KvConnectorInfo, pb.KvConnectorInfo]:
    if ctx.clients["prefill"] is None or ctx.clients["decode"] is None:
        raise Skip("needs both --prefill and --decode")
    pinfo, dinfo = await ctx.server_info("prefill"), await ctx.server_info("decode")
    if pinfo.engine_role != pb.EngineRole.PREFILL:
        raise Fail(f"the --prefill engine reports role {pb.EngineRole(pinfo.engine_role).name}")
    if dinfo.engine_role != pb.EngineRole.DECODE:
        raise Fail(f"the --decode engine reports role {pb.EngineRole(dinfo.engine_role).name}")
    pkv, dkv = pinfo.kv_connector, dinfo.kv_connector
    if pkv is None or dkv is None or not pkv.enabled or not dkv.enabled:
        raise Fail("both engines of a P/D pair must advertise an enabled kv_connector")
    if pkv.handoff_profile and dkv.handoff_profile and pkv.handoff_profile != dkv.handoff_profile:
        raise Fail(
            f"handoff profiles differ: prefill {pkv.handoff_profile!r}, decode {dkv.handoff_profile!r}"
        )
    return pkv, dkv


def _judge_decode(h: Handoff) -> None:
    rec = h.decode
    assert rec is not None
    if rec.end != "ok" or "error" in rec.kinds or not rec.kinds.count("token"):
        h.problems.append(f"decode did not generate from the handed-off KV: {rec.summary()} {rec.error}")
        for e in rec.events:
            if e.error is not None:
                h.problems.append(f"decode EngineError {pb.ErrorCode(e.error.code).name}: {e.error.message}")
    for rule in (
        rules.request_id_violations,
        rules.event_violations,
        rules.output_index_violations,
        rules.finish_count_violations,
        rules.after_finish_violations,
        rules.usage_violations,
        rules.prompt_once_violations,
        rules.max_tokens_violations,
        rules.close_violations,
        rules.wire_violations,
    ):
        h.problems += rule(rec)


def _judge_prefill(h: Handoff, pkv: pb.KvConnectorInfo) -> pb.KvSessionRef | None:
    rec = h.prefill
    assert rec is not None
    last = rec.events[-1] if rec.events else None
    ready = last.prefill_ready if last is not None else None
    h.problems += rules.finish_count_violations(rec, prefill=True) + rules.usage_violations(rec)
    for rule in (
        rules.request_id_violations,
        rules.event_violations,
        rules.output_index_violations,
        rules.after_finish_violations,
        rules.prompt_once_violations,
        rules.close_violations,
        rules.wire_violations,
    ):
        h.problems += rule(rec)
    if rec.end != "ok" or ready is None or ready.kv_session is None:
        h.problems.append(
            f"the prefill did not end with PrefillReady{{kv_session}}: {rec.summary()} {rec.error}"
        )
        return None
    session = ready.kv_session
    if pkv.handoff_profile and session.handoff_profile != pkv.handoff_profile:
        h.problems.append(
            f"PrefillReady's kv_session has handoff_profile {session.handoff_profile!r}; the prefill's "
            f"connector advertises {pkv.handoff_profile!r}"
        )
    return session


async def _refused_by_decode_sidecar(ctx: Context, session: pb.KvSessionRef) -> list[str]:
    """Why a sidecar in front of the decode engine would refuse ``session`` (empty: it takes it)."""
    try:
        card = await discover(ctx.client("decode"), strict=False)
    except (DiscoveryError, EngineClientError) as err:
        return [f"the decode engine cannot be discovered as a sidecar discovers it: {err}"]
    try:
        check_decode_session(session, card)
    except Rejection as rej:
        return [
            f"a decode sidecar refuses PrefillReady's kv_session before its engine sees it: "
            f"{error_code_name(rej.code)}: {rej.message}"
        ]
    return []


async def handoff(ctx: Context) -> Handoff:
    """The round trip, run once per suite run (shared by ``pd.handoff`` and ``generate.nothing-after-error``)."""
    cached = ctx.cache.get("pd")
    if isinstance(cached, Exception):
        raise cached
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    try:
        cached = await _run(ctx)
    except (Skip, Fail) as err:
        ctx.cache["pd"] = err
        raise
    ctx.cache["pd"] = cached
    return cached


async def _run(ctx: Context) -> Handoff:
    pkv, _dkv = await _pair(ctx)
    if pkv.supports_client_bootstrap:
        return await _bootstrap(ctx, pkv)
    h = Handoff("context-first")
    preq = await ctx.request("pd-prefill", which="prefill", prompt=PROMPT, max_tokens=1)
    h.prefill = await ctx.record(preq, which="prefill", label="pd-prefill", timeout=TIMEOUT)
    session = _judge_prefill(h, pkv)
    if session is None:
        return h
    h.problems += await _refused_by_decode_sidecar(ctx, session)
    dreq = await ctx.request("pd-decode", which="prefill", prompt=PROMPT, max_tokens=8, session=session)
    h.decode = await ctx.record(dreq, which="decode", label="pd-decode", timeout=TIMEOUT)
    _judge_decode(h)
    again = await ctx.request("pd-stale", which="prefill", prompt=PROMPT, max_tokens=8, session=session)
    h.stale = await ctx.record(again, which="decode", label="pd-stale", timeout=TIMEOUT)
    return h


async def _bootstrap(ctx: Context, pkv: pb.KvConnectorInfo) -> Handoff:
    h = Handoff("bootstrap")
    ep = next((e for e in pkv.local_endpoints if e.host and e.port), None)
    if ep is None:
        raise Fail("the client-bootstrap prefill advertises no local endpoint")
    session = pb.KvSessionRef(
        handoff_profile=pkv.handoff_profile,
        bootstrap=pb.KvBootstrap(endpoint=ep, room_id=secrets.randbits(63)),
    )
    preq = await ctx.request("pd-prefill", which="prefill", prompt=PROMPT, max_tokens=8, session=session)
    dreq = await ctx.request("pd-decode", which="prefill", prompt=PROMPT, max_tokens=8, session=session)
    out: dict[str, StreamRecord] = {}

    async def run(which: str, req: pb.GenerateRequest) -> None:
        out[which] = await ctx.record(req, which=which, label=f"pd-{which}", timeout=TIMEOUT)

    async with open_background_nursery() as nursery:
        nursery.start_soon(run, "prefill", preq)
        nursery.start_soon(run, "decode", dreq)
    h.prefill, h.decode = out["prefill"], out["decode"]
    _judge_prefill(h, pkv)
    _judge_decode(h)
    return h


@check(
    "pd.handoff",
    rule="a prefill ends in PrefillReady{kv_session} with the connector's handoff profile, a session a "
    "decode sidecar admits; a decode given that session unchanged (or the same client bootstrap) "
    "generates tokens under the stream rules",
    ref=PD,
)
async def pd_handoff(ctx: Context) -> str | None:
    h = await handoff(ctx)
    require(not h.problems, h.problems[0] if h.problems else "", h.problems)
    assert h.decode is not None
    return f"{h.mode}: {h.decode.summary()}"

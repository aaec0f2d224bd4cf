"""The stream corpus: a set of Generate calls recorded once per run and judged by every
stream-rule check (``generate.*``), each for its own rule.

Scenarios depend on how a request completes on the engine alone
(:meth:`~sidecar.conformance.context.Context.standalone`):

- aggregated: ``basic`` (8 tokens), ``multi`` (2 outputs, when ``max_num_sequences`` allows),
  ``prompt`` (prompt logprobs, when advertised), ``natural`` (room to stop on EOS),
  ``length`` (3 tokens, ``ignore_eos``), ``reference`` + ``stop-token`` (greedy, seeded;
  the second stops on the reference's third token), ``aborted`` (Abort after the first token);
- context-first prefill: ``basic`` and ``prompt`` (each ends in ``PrefillReady``; their KV
  sessions are released with Abort afterwards);
- client-bootstrap prefill: ``aborted`` (waits for a decode partner that never comes, then
  Abort);
- decode: none (decode needs a KV session; the ``pd.handoff`` check covers decode streams).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sidecar.conformance.context import Context
from sidecar.conformance.model import Fail, Skip
from sidecar.conformance.streams import StreamRecord, kind
from sidecar.openengine import pb

__all__ = ["Corpus", "get_corpus", "token_ids_of"]

ABORT_WAIT = 5.0


@dataclass
class Corpus:
    mode: str
    records: list[StreamRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def get(self, label: str) -> StreamRecord | None:
        return next((r for r in self.records if r.label == label), None)

    @property
    def answered(self) -> list[StreamRecord]:
        """Records of calls the engine accepted (at least one event)."""
        return [r for r in self.records if r.events]


def token_ids_of(rec: StreamRecord, index: int = 0) -> list[int]:
    return [
        t.token_id
        for e in rec.events
        if e.token is not None and (e.token.output_index or 0) == index
        for t in e.token.tokens
    ]


async def get_corpus(ctx: Context) -> Corpus:
    """The run's corpus, built on first use (a failure is re-raised to every later caller)."""
    cached = ctx.cache.get("corpus")
    if cached is None:
        try:
            cached = await _build(ctx)
        except (Fail, Skip) as err:
            cached = err
        ctx.cache["corpus"] = cached
    if isinstance(cached, Exception):
        raise cached
    return cached  # type: ignore[no-any-return]


async def _add(ctx: Context, corpus: Corpus, label: str, req: pb.GenerateRequest) -> StreamRecord:
    rec = await ctx.record(req, label=label, timeout=20.0)
    corpus.records.append(rec)
    if rec.refused:
        corpus.notes.append(f"{label}: refused with status {rec.status} ({rec.status_message})")
    elif rec.end == "timeout":
        corpus.notes.append(f"{label}: {rec.gave_up}")
    return rec


async def _build(ctx: Context) -> Corpus:
    mode = await ctx.standalone()
    if mode is None:
        if await ctx.role() == pb.EngineRole.PREFILL:
            return await _bootstrap_prefill(ctx)
        raise Skip("decode engine: generation needs a KV session from a prefill (see pd.handoff)")
    corpus = Corpus(mode)
    mi = await ctx.model_info()
    gen = mi.generation
    basic = await _add(
        ctx, corpus, "basic", await ctx.request("basic", max_tokens=1 if mode == "prefill" else 8)
    )
    if basic.refused:
        raise Fail(f"the engine refused a plain request: status {basic.status} ({basic.status_message})")
    if gen is not None and gen.prompt_logprobs is not None and gen.prompt_logprobs.supported:
        req = await ctx.request("prompt", max_tokens=1 if mode == "prefill" else 2, prompt_logprobs=True)
        await _add(ctx, corpus, "prompt", req)
    if mode == "prefill":
        for rec in corpus.records:
            last = rec.events[-1] if rec.events else None
            if last is not None and kind(last) == "prefill_ready" and last.prefill_ready.kv_session:  # type: ignore[union-attr]
                await ctx.abort(kv_session=last.prefill_ready.kv_session)  # type: ignore[union-attr]
        return corpus
    if gen is None or gen.max_num_sequences is None or gen.max_num_sequences >= 2:
        await _add(ctx, corpus, "multi", await ctx.request("multi", max_tokens=8, num_sequences=2))
    natural = 128 if mi.max_output_tokens is None else min(128, mi.max_output_tokens)
    await _add(ctx, corpus, "natural", await ctx.request("natural", max_tokens=natural))
    await _add(ctx, corpus, "length", await ctx.request("length", max_tokens=3, ignore_eos=True))
    greedy = {"temperature": 0.0, "seed": 1234, "ignore_eos": True, "max_tokens": 8}
    ref = await _add(ctx, corpus, "reference", await ctx.request("reference", **greedy))  # type: ignore[arg-type]
    ids = token_ids_of(ref)
    if len(ids) >= 3:
        stop = ids[2]
        req = await ctx.request("stop-token", stop_token_ids=[stop], **greedy)  # type: ignore[arg-type]
        await _add(ctx, corpus, "stop-token", req)
    await _aborted(ctx, corpus)
    return corpus


async def _aborted(ctx: Context, corpus: Corpus) -> None:
    req = await ctx.request("aborted", max_tokens=await ctx.long_max_tokens(), ignore_eos=True)
    async with ctx.open(req, label="aborted") as live:
        first = await live.until(("token", "finished", "error"), ABORT_WAIT)
        if first is not None and kind(first) == "token":
            live.record.aborted = True
            outcome = await ctx.abort(request_id=req.request_id)
            live.record.notes.append(f"Abort answered {outcome}")
            await live.rest(ABORT_WAIT)
    corpus.records.append(live.record)


async def _bootstrap_prefill(ctx: Context) -> Corpus:
    corpus = Corpus("bootstrap-prefill")
    kv = await ctx.connector()
    assert kv is not None
    endpoint = next((e for e in kv.local_endpoints if e.host and e.port), None)
    if endpoint is None:
        raise Skip("client-bootstrap prefill engine advertises no local endpoint")
    session = pb.KvSessionRef(
        handoff_profile=kv.handoff_profile,
        bootstrap=pb.KvBootstrap(endpoint=endpoint, room_id=secrets.randbits(62) | 1),
    )
    baseline = await ctx.busy()
    req = await ctx.request("aborted", max_tokens=1, session=session)
    async with ctx.open(req, label="aborted") as live:
        if baseline is not None:
            await ctx.wait_busy(baseline, ABORT_WAIT)
        live.record.aborted = True
        outcome = await ctx.abort(request_id=req.request_id)
        live.record.notes.append(f"Abort answered {outcome}")
        await live.rest(ABORT_WAIT)
    corpus.records.append(live.record)
    return corpus

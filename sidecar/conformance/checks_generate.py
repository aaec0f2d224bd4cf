"""Generate stream rules, each judged over the whole corpus (:mod:`sidecar.conformance.corpus`)."""

from __future__ import annotations

from collections.abc import Callable

from sidecar.conformance import streams as rules
from sidecar.conformance.checks_pd import handoff
from sidecar.conformance.context import Context
from sidecar.conformance.corpus import Corpus, get_corpus
from sidecar.conformance.model import Fail, Skip, check, require
from sidecar.conformance.streams import StreamRecord
from sidecar.openengine import pb
from sidecar.openengine.releases import spec_url

GENERATION = spec_url("generation-api")
ERRORS = spec_url("standard-errors")


def _judge(corpus: Corpus, records: list[StreamRecord], rule: Callable[[StreamRecord], list[str]]) -> str:
    """Apply ``rule`` to every record in scope; a stream lost before its terminal event breaks
    every rule that judges it (it is never skipped or passed as if it had ended)."""
    violations = [v for rec in records for v in rules.lost_violations(rec) + rule(rec)]
    require(not violations, violations[0] if violations else "", violations)
    return (
        f"{len(records)} stream(s): "
        + "; ".join(r.summary() for r in records[:3])
        + (" …" if len(records) > 3 else "")
    )


def _with(corpus: Corpus, *kinds: str) -> list[StreamRecord]:
    return [r for r in corpus.answered if any(k in r.kinds for k in kinds)]


@check(
    "generate.output-index",
    rule="every TokenOutput and GenerationFinished carries output_index (index 0 included), in 0 … num_sequences-1",
    ref=GENERATION,
)
async def output_index(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = _with(corpus, "token", "finished")
    if not records:
        raise Skip(f"no TokenOutput or GenerationFinished observed ({corpus.mode} engine)")
    return _judge(corpus, records, rules.output_index_violations)


@check(
    "generate.one-finish",
    rule="a successful stream ends every requested output with exactly one GenerationFinished "
    "(a prefill stream with one PrefillReady)",
    ref=GENERATION,
)
async def one_finish(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = [r for r in corpus.answered if r.end in ("ok", "transport")]
    if not records:
        raise Skip("no accepted stream that the engine closed OK or lost")
    prefill = corpus.mode != "aggregated"
    result = _judge(corpus, records, lambda r: rules.finish_count_violations(r, prefill=prefill))
    if corpus.mode == "aggregated" and corpus.get("multi") is None:
        result += " (max_num_sequences < 2: single-output streams only)"
    return result


@check(
    "generate.nothing-after-finish",
    rule="after GenerationFinished for an index nothing more for that index; after the stream's terminal "
    "nothing at all",
    ref=GENERATION,
)
async def nothing_after_finish(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = _with(corpus, "finished", "prefill_ready")
    if not records:
        raise Skip(f"no GenerationFinished or PrefillReady observed ({corpus.mode} engine)")
    return _judge(corpus, records, rules.after_finish_violations)


async def _error_streams(ctx: Context, corpus: Corpus | None) -> list[StreamRecord]:
    """Corpus streams that failed, plus the P/D round trip's (its stale-session replay)."""
    records = [r for r in corpus.answered if "error" in r.kinds] if corpus is not None else []
    if ctx.clients["prefill"] is not None and ctx.clients["decode"] is not None:
        try:
            h = await handoff(ctx)
        except (Skip, Fail):
            h = None
        if h is not None:
            records += [r for r in (h.prefill, h.decode, h.stale) if r is not None and "error" in r.kinds]
    return records


@check(
    "generate.nothing-after-error",
    rule="EngineError is terminal: no event follows it and the call closes with status OK",
    ref=ERRORS,
)
async def nothing_after_error(ctx: Context) -> str | None:
    try:
        corpus: Corpus | None = await get_corpus(ctx)
    except Skip:
        corpus = None
    records = await _error_streams(ctx, corpus)
    if not records:
        raise Skip("no EngineError observed: the suite could not make this engine fail an accepted request")
    violations = [v for rec in records for v in rules.after_error_violations(rec)]
    require(not violations, violations[0] if violations else "", violations)
    return "; ".join(r.summary() for r in records)


@check(
    "generate.usage-final",
    rule="Usage is set on the final response (last GenerationFinished, PrefillReady or EngineError) and "
    "on no other",
    ref=GENERATION,
)
async def usage_final(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = [r for r in corpus.answered if r.end in ("ok", "transport")]
    if not records:
        raise Skip("no accepted stream that the engine closed OK or lost")
    return _judge(corpus, records, rules.usage_violations)


@check(
    "generate.prompt-once",
    rule="PromptOutput is sent at most once per request",
    ref=GENERATION,
)
async def prompt_once(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    if corpus.get("prompt") is None:
        raise Skip("the model does not advertise prompt logprobs (generation.prompt_logprobs.supported)")
    return _judge(corpus, corpus.answered, rules.prompt_once_violations)


@check(
    "generate.stop-match",
    rule="a STOP finish carries stop_match naming the matched stop token, stop string or EOS token",
    ref=GENERATION,
)
async def stop_match(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = [
        r
        for r in corpus.answered
        if any(e.finished is not None and e.finished.reason == pb.FinishReason.STOP for e in r.events)
    ]
    if not records:
        raise Skip(f"no STOP finish observed ({corpus.mode} engine)")
    return _judge(corpus, records, rules.stop_match_violations)


@check(
    "generate.max-tokens",
    rule="no output generates more than stopping.max_tokens tokens (Usage.completion_tokens agrees)",
    ref=GENERATION,
)
async def max_tokens(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = _with(corpus, "token")
    if not records:
        raise Skip(f"no TokenOutput observed ({corpus.mode} engine)")
    return _judge(corpus, records, rules.max_tokens_violations)


@check(
    "generate.request-id",
    rule="every GenerateResponse names the request_id of its own request (or leaves it empty)",
    ref=GENERATION,
)
async def request_id(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    if not corpus.answered:
        raise Skip(f"no accepted stream ({corpus.mode} engine)")
    return _judge(corpus, corpus.answered, rules.request_id_violations)


@check(
    "generate.one-event",
    rule="every GenerateResponse carries one event (prompt, token, prefill_ready, finished or error)",
    ref=GENERATION,
)
async def one_event(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    if not corpus.answered:
        raise Skip(f"no accepted stream ({corpus.mode} engine)")
    return _judge(corpus, corpus.answered, rules.event_violations)


@check(
    "generate.closes-ok",
    rule="an accepted stream ends with its terminal event and the call then closes with status OK at "
    "once: no non-OK status or reset after the first event, no stream left open or silent",
    ref=ERRORS,
)
async def closes_ok(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    records = [r for r in corpus.records if not r.refused and r.end != "left"]
    if not records:
        raise Skip(f"no accepted stream ({corpus.mode} engine)")
    return _judge(corpus, records, rules.close_violations)


@check(
    "generate.wire-format",
    rule="every Generate message is one a gRPC client takes by default: a GenerateResponse that "
    "decodes, uncompressed (none negotiated), at most 4 MiB",
    ref=GENERATION,
)
async def wire_format(ctx: Context) -> str | None:
    corpus = await get_corpus(ctx)
    return _judge(corpus, corpus.records, rules.wire_violations)

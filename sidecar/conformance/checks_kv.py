"""KV events: sequence contiguity, rank attribution, snapshot and resume, well-formed streams.

The checks make the engine store blocks with one-token requests whose prompts are fresh
random token ids (so no prefix cache hides them), routed to each DP rank with
``openengine-target-dp-rank``. They need an engine that completes requests on its own
(aggregated, or a context-first prefill). ``kv.sequence`` runs last of the group and judges
the run-wide monitor (``kv_watch.open_monitor``): every batch since the run began, so a gap
anywhere before it — in a warm-up, in another check — is its finding. ``kv.rank`` stores
once more when its batch was lost in such a gap (and passes or fails on rank attribution).
``kv.well-formed``, after it, judges what every subscription of the run received against
what the KV bridge takes (``kv_watch.kv_problems``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from sidecar.conformance.context import Context, describe_status
from sidecar.conformance.kv_watch import (
    KvWatcher,
    SeenBatch,
    kv_monitor,
    kv_problems,
    kv_sources,
    kv_transport,
    open_watcher,
    replay,
    stored_runs,
    watch_ranks,
)
from sidecar.conformance.model import Fail, Skip, check, require
from sidecar.openengine.releases import spec_url

KV = spec_url("kv-connector-and-kv-events")
WAIT = 3.0
WARM_ATTEMPTS = 10
ROUNDS = 5
WARM_WAIT = 0.2


async def _prompt_len(ctx: Context) -> int:
    cap = (await ctx.server_info()).capacity
    block = cap.kv_block_size if cap is not None and cap.kv_block_size else 16
    return min(max(2 * block + 1, 33), 1024)


async def store_blocks(ctx: Context, rank: int | None, label: str) -> list[int]:
    """Run a one-token request on fresh token ids (routed to ``rank``); returns the ids."""
    if await ctx.standalone() is None:
        raise Skip(
            "cannot make this engine store KV blocks on its own (decode, or a prefill needing a partner)"
        )
    ids = ctx.token_ids(await _prompt_len(ctx))
    req = await ctx.request(label, token_ids=ids, max_tokens=1)
    metadata = None
    if rank is not None and len(await ctx.dp_ranks()) > 1:
        metadata = [("openengine-target-dp-rank", str(rank))]
    rec = await ctx.record(req, metadata=metadata, timeout=15.0)
    if rec.refused:
        if (await ctx.model_info()).supports_token_ids_input is False:
            raise Skip("the model does not accept token-id prompts")
        raise Fail(f"a token-id request to rank {rank} was refused: {describe_status(rec)}")
    last = rec.events[-1] if rec.events else None
    if last is not None and last.prefill_ready is not None and last.prefill_ready.kv_session is not None:
        await ctx.abort(kv_session=last.prefill_ready.kv_session)
    return ids


async def warm_up(ctx: Context, watcher: KvWatcher, ranks: Sequence[int]) -> None:
    """Store blocks until every rank's subscription delivered a batch (ZMQ joins late)."""
    for _ in range(WARM_ATTEMPTS):
        if all(watcher.by_rank(r) for r in ranks):
            return
        for r in ranks:
            if not watcher.by_rank(r):
                await store_blocks(ctx, r, "kv-warm")
        if await watcher.wait(lambda w: all(w.by_rank(r) for r in ranks), WARM_WAIT):
            return
    missing = [r for r in ranks if not watcher.by_rank(r)]
    raise Fail(
        f"no KV event batch from rank(s) {missing} after storing blocks {WARM_ATTEMPTS} times"
        + (f" (stream {watcher.ended})" if watcher.ended else ""),
        watcher.problems,
    )


def _gaps(rank: int, batches: list[SeenBatch]) -> list[str]:
    seqs = [b.seq for b in batches]
    out = []
    for a, b in itertools.pairwise(seqs):
        if b != a + 1:
            what = f"{b - a - 1} missing" if b > a else "sequence went back"
            out.append(f"rank {rank}: batch {a} followed by {b} ({what})")
    return out


def _has_run(batch: SeenBatch, ids: list[int]) -> bool:
    text = ",".join(map(str, ids)) + ","
    return any(run and ",".join(map(str, run)) + "," in text for run in stored_runs(batch))


def _stored(w: KvWatcher, rank: int, ids: list[int]) -> bool:
    """Whether ``rank``'s batches seen by ``w`` hold the blocks of the prompt ``ids``."""
    return any(_has_run(b, ids) for b in w.by_rank(rank))


@check(
    "kv.rank",
    rule="KV event batches are attributed to the DP rank that stored the blocks: a request routed to "
    "rank r shows up in rank r's batches, and each batch reports its source's rank",
    ref=KV,
)
async def rank(ctx: Context) -> str | None:
    ranks = await watch_ranks(ctx)
    problems: list[str] = []
    notes: list[str] = []
    async with open_watcher(ctx) as w:
        await warm_up(ctx, w, ranks)
        for r in ranks:
            ids = await store_blocks(ctx, r, "kv-rank")

            def arrived(w: KvWatcher, ids: list[int] = ids) -> bool:
                return any(_has_run(b, ids) for b in w.batches)

            if not await w.wait(arrived, WAIT) and _gaps(r, w.by_rank(r)):
                # its batch was lost in a sequence gap (kv.sequence's finding): store once more
                notes.append(f"rank {r}: a batch lost in a sequence gap, stored again")
                ids = await store_blocks(ctx, r, "kv-rank")
            if not await w.wait(arrived, WAIT):
                problems.append(f"no BlockStored for the prompt routed to rank {r} within {WAIT:g} s")
                continue
            for b in w.batches:
                if _has_run(b, ids) and b.source_rank != r:
                    problems.append(
                        f"blocks of a request routed to rank {r} arrived from rank {b.source_rank}"
                    )
    for b in w.batches:
        if b.reported_rank is not None and b.source_rank is not None and b.reported_rank != b.source_rank:
            problems.append(
                f"rank {b.source_rank}'s batch {b.seq} reports data-parallel rank {b.reported_rank}"
            )
            break
    require(not problems, problems[0] if problems else "", problems)
    return f"{w.transport}: ranks {ranks}" + "".join(f"; {n}" for n in notes)


async def _resume_native(ctx: Context, r0: int) -> list[str]:
    async with open_watcher(ctx, ranks=[r0]) as w:
        await warm_up(ctx, w, [r0])
        ids = await store_blocks(ctx, r0, "kv-resume")
        # the batch with these blocks is the engine's latest: a number taken before it arrived
        # may predate a publisher restart (kv.sequence's finding), and resuming from it fails
        await w.wait(lambda w: _stored(w, r0, ids), WAIT)
        last = w.by_rank(r0)[-1].seq
    await store_blocks(ctx, r0, "kv-resume")
    problems = []
    start = last + 1
    async with open_watcher(ctx, ranks=[r0], start=start) as w2:
        got = await w2.wait(lambda w: bool(w.batches), WARM_WAIT)
        if not got and not w2.ended:  # nothing held from `start` on: new traffic shows where it resumes
            await store_blocks(ctx, r0, "kv-resume")
            got = await w2.wait(lambda w: bool(w.batches), WAIT)
    if not w2.batches:
        why = f"the stream ended: {w2.ended}" if w2.ended else f"nothing within {WAIT:g} s" if not got else ""
        problems.append(f"resuming rank {r0} from sequence {start} (held) delivered no batch: {why}")
    elif w2.batches[0].seq != start:
        problems.append(f"resuming rank {r0} from sequence {start} started at {w2.batches[0].seq}")
    else:
        problems += _gaps(r0, w2.batches)
    async with open_watcher(ctx, ranks=[r0], snapshot=True) as w3:
        await w3.wait(lambda w: bool(w.batches), WAIT)
    if not w3.batches:
        problems.append(
            f"include_snapshot: no snapshot batch within {WAIT:g} s" + (f" ({w3.ended})" if w3.ended else "")
        )
    elif not w3.batches[0].events:
        problems.append("include_snapshot: the first batch is empty although blocks are cached")
    return problems


async def _resume_zmq(ctx: Context, r0: int) -> list[str]:
    source = next(
        (s for s in await kv_sources(ctx) if s.transport == "zmq" and s.data_parallel_rank in (r0, None)),
        None,
    )
    if source is None or not source.replay_endpoint:
        raise Skip(f"no ZMQ replay endpoint advertised for rank {r0}")
    async with open_watcher(ctx, ranks=[r0]) as w:
        await warm_up(ctx, w, [r0])
        for _ in range(2):
            ids = await store_blocks(ctx, r0, "kv-resume")
        await w.wait(lambda w: len(w.by_rank(r0)) >= 3 and _stored(w, r0, ids), WAIT)
    seqs = [b.seq for b in w.by_rank(r0)]
    start = seqs[0]
    replayed, problem = await replay(source, start)
    problems = [f"replay from {start}: {problem}"] if problem else []
    if not replayed:
        problems.append(f"replay from {start} (a batch just received) returned nothing")
    elif replayed[0] != start:
        problems.append(f"replay from {start} started at {replayed[0]}")
    else:
        problems += [
            f"replay: batch {a} followed by {b}" for a, b in itertools.pairwise(replayed) if b != a + 1
        ]
        if seqs[-1] not in replayed:
            problems.append(f"replay from {start} ended before batch {seqs[-1]}, which was already published")
    return problems


@check(
    "kv.resume",
    rule="a subscriber can resume: a native resume from a held sequence number starts exactly there and "
    "include_snapshot delivers the cache state; a ZMQ replay from a held number starts exactly there, "
    "contiguous to the end marker",
    ref=KV,
)
async def resume(ctx: Context) -> str | None:
    r0 = (await watch_ranks(ctx))[0]
    transport = await kv_transport(ctx)
    problems = await (_resume_native(ctx, r0) if transport == "grpc" else _resume_zmq(ctx, r0))
    require(not problems, problems[0] if problems else "", problems)
    return f"{transport}, rank {r0}"


@check(
    "kv.sequence",
    rule="each DP rank's KV event batches carry contiguous sequence numbers, from the first batch the "
    "engine published during the run: every batch is the previous one plus one, no gap, no restart",
    ref=KV,
)
async def sequence(ctx: Context) -> str | None:
    ranks = await watch_ranks(ctx)
    monitor = kv_monitor(ctx)
    if monitor is not None:  # watching since the run began: every batch of every check counts
        return await _sequence(ctx, monitor, ranks)
    async with open_watcher(ctx) as w:
        return await _sequence(ctx, w, ranks)


async def _sequence(ctx: Context, w: KvWatcher, ranks: list[int]) -> str:
    await warm_up(ctx, w, ranks)
    for _ in range(ROUNDS - 1):
        for r in ranks:
            await store_blocks(ctx, r, "kv-seq")
    # the last store's batch must arrive: a gap just before it shows, and a lost last batch too
    problems = []
    for r in ranks:
        ids = await store_blocks(ctx, r, "kv-seq")

        if not await w.wait(functools.partial(_stored, rank=r, ids=ids), WAIT):
            problems.append(
                f"rank {r}: the batch with the blocks stored last did not arrive within {WAIT:g} s"
            )
    seen = {r: w.by_rank(r) for r in ranks}
    problems += [p for r in ranks for p in _gaps(r, seen[r])]
    problems += [f"rank {r}: only {len(seen[r])} batch(es) arrived" for r in ranks if len(seen[r]) < 2]
    if w.ended:
        problems.append(f"a KV event stream ended while watched: {w.ended}")
    require(not problems, problems[0] if problems else "", problems)
    return f"{w.transport}: " + ", ".join(
        f"rank {r} batches {seen[r][0].seq}…{seen[r][-1].seq} ({len(seen[r])})" for r in ranks
    )


@check(
    "kv.well-formed",
    rule="every KV event message is one the KV bridge takes: a SubscribeKvEventsResponse carries a batch "
    "or a terminal EngineError, nothing follows that error, every batch (or ZMQ message) decodes",
    ref=KV,
)
async def well_formed(ctx: Context) -> str | None:
    ranks = await watch_ranks(ctx)
    transport = await kv_transport(ctx)
    watched = kv_monitor(ctx)
    if watched is None:  # not in a run that watches from the start: watch now
        async with open_watcher(ctx) as watched:
            await warm_up(ctx, watched, ranks)
    else:
        await warm_up(ctx, watched, ranks)
    if transport == "grpc":  # a snapshot subscription too: what follows a snapshot counts
        async with open_watcher(ctx, ranks=ranks[:1], snapshot=True) as snap:
            if await snap.wait(lambda w: bool(w.batches), WAIT):
                await snap.wait(lambda w: bool(w.ended), WARM_WAIT)
    problems = kv_problems(ctx)
    require(not problems, problems[0] if problems else "", problems)
    return f"{transport}: {len(watched.batches)} batch(es) from ranks {ranks}, every subscription well-formed"

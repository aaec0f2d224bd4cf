"""Drives one accepted Generate request: queue wait, prefill, handoff, token stream.

``run_request(engine, req, send)`` sends every response of the request through
``send`` (the gRPC stream's ``send_message``) and ends the request with exactly one
outcome. Cancellation (client reset, deadline, server shutdown) arrives as
``asyncio.CancelledError`` at whatever is awaited; the request is then handed to
:meth:`MockEngine.client_gone` (leaked or released) and the error propagates.

Aborts wake the request wherever it waits (queue, per-token pause, stall, KV
handoff); an aggregated/decode request then ends every unfinished output with
``GenerationFinished{CANCELLED}`` (Usage on the last), a prefill request with
``EngineError{CANCELLED}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from sidecar.mock import events as ev
from sidecar.mock import generator as gen
from sidecar.mock import schemas
from sidecar.mock import tokenizer as tok
from sidecar.mock import transfer as xfer
from sidecar.mock.engine import ABORTED, COMPLETED, DROPPED, FAILED, MockEngine, Request
from sidecar.mock.faults import StreamFaults
from sidecar.mock.kvcache import KvCacheFull, compute_block_hashes
from sidecar.nursery import lone_exception
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import PreEncoded, RpcStatusError

log = logging.getLogger(__name__)

Send = Callable[[Any], Awaitable[None]]
T = TypeVar("T")
CRASH_EXIT_STATUS = 70
_FAST_YIELD_EVERY = 32


class _Aborted(Exception):
    pass


class _ClientLeft(Exception):
    """Sending failed at the transport: the client is no longer there."""


class _Ended(Exception):
    """The stream ended (terminal sent or fault); ``outcome`` says how, ``status`` the non-OK
    status the call then ends with (fault ``status-after``)."""

    def __init__(self, outcome: str, status: RpcStatusError | None = None) -> None:
        self.outcome = outcome
        self.status = status


async def _pause(req: Request, seconds: float) -> None:
    """Sleep ``seconds`` (no bound when < 0) unless the request is woken first; raises
    :class:`_Aborted` if it was aborted."""
    if req.abort_reason is None:
        await req.wait_woken(seconds if seconds >= 0 else None)
    if req.abort_reason is not None:
        raise _Aborted


async def _abortable(req: Request, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` unless an Abort comes first (then it is cancelled and :class:`_Aborted`
    raised; a result that came first still counts). The work and the Abort watcher run in
    one task group: each ends the other, a cancelled caller cancels both."""
    if req.abort_reason is not None:
        coro.close()
        raise _Aborted
    result: list[T] = []

    async def work() -> None:
        try:
            result.append(await coro)
        finally:
            watcher.cancel()

    async def watch() -> None:
        while req.abort_reason is None:
            await req.wait_woken()
        worker.cancel()

    try:
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(watch())
            worker = group.create_task(work())
    except BaseExceptionGroup as failed:  # the work's own error (the watcher raises none)
        if req.abort_reason is not None:
            raise _Aborted from None
        raise lone_exception(failed) from None
    if not result:
        raise _Aborted
    return result[0]


class _Stream:
    """State of one request's response stream."""

    def __init__(self, engine: MockEngine, req: Request, send: Send) -> None:
        self.engine = engine
        self.req = req
        self.send_raw = send
        self.plan = req.plan
        self.faults = engine.config.faults.stream.merged(req.plan.stream_faults)
        self.tokens_sent = 0
        self.fast = engine.config.fast
        self.fast_tokens = (
            ev.FastTokens(req.id)
            if self.fast
            and not req.plan.output_logprobs
            and not self.faults.flags
            and not req.plan.stamp_tokens
            else None
        )
        delay = req.plan.token_delay_ms
        self.delay = engine.config.token_delay_s if delay is None else delay / 1000.0
        self.cached: int | None = None

    def usage(self) -> pb.Usage | None:
        if self.faults.no_usage:
            return None
        return ev.usage(len(self.plan.prompt_ids), self.req.completion_tokens, self.cached)

    async def send(self, message: Any) -> None:
        try:
            await self.send_raw(message)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            raise _ClientLeft(f"{type(err).__name__}: {err}") from err

    async def send_error(self, code: pb.ErrorCode, message: str, *, retryable: bool) -> None:
        """The terminal ``EngineError`` (fault ``event-after-error``: plus one more token event)."""
        await self.send(ev.error_event(self.req.id, code, message, retryable=retryable, use=self.usage()))
        if self.faults.has("event-after-error"):
            extra = gen.Step(tok.EOS_ID, "", None, None)
            await self.send(ev.token_event(self.req.id, 0, extra))

    async def fail(self, code: pb.ErrorCode, message: str, *, retryable: bool) -> None:
        await self.send_error(code, message, retryable=retryable)
        raise _Ended(FAILED)

    async def after_token(self) -> None:
        """Stream faults keyed on the number of token events sent."""
        f, n = self.faults, self.tokens_sent
        if f.crash_after is not None and n >= f.crash_after:
            log.error("fault crash-after=%d: exiting", f.crash_after)
            exit_process = self.engine.exit_process or os._exit
            exit_process(CRASH_EXIT_STATUS)
        if f.error_after is not None and n >= f.error_after:
            await self.fail(pb.ErrorCode.INTERNAL, f"injected fault after {n} token(s)", retryable=True)
        if f.close_without_terminal is not None and n >= f.close_without_terminal:
            raise _Ended(DROPPED)
        if f.status_after is not None and n >= f.status_after:
            raise _Ended(FAILED, RpcStatusError("INTERNAL", f"injected status after {n} token(s)"))
        if f.stall is not None and n >= f.stall:
            await _pause(self.req, -1.0)
        if f.oversized_event is not None and n == 1:
            big = gen.Step(gen.working_word(0), "x" * f.oversized_event, None, None)
            await self.send(ev.token_event(self.req.id, 0, big))
        if n == 2 and f.flags:
            await self._after_second_token(f)

    async def _after_second_token(self, f: StreamFaults) -> None:
        """Stream faults that add one message right after the second token event (a request
        of one or two tokens is spared: the suite's short requests still complete)."""
        rid = self.req.id
        if f.has("empty-event"):
            await self.send(pb.GenerateResponse(request_id=rid))
        if f.has("output-index-range"):
            step = gen.Step(gen.working_word(0), "", None, None)
            await self.send(ev.token_event(rid, self.plan.num_outputs, step))
        if f.has("undecodable-event"):
            await self.send(PreEncoded(b"\n\x02\xff\xfe"))  # request_id = 2 bytes, not UTF-8


async def run_request(engine: MockEngine, req: Request, send: Send) -> None:
    """Serve ``req`` to its end (see the module doc). Re-raises cancellation."""
    stream = _Stream(engine, req, send)
    outcome = FAILED
    status: RpcStatusError | None = None
    try:
        try:
            await _run(stream)
            outcome = COMPLETED
        except _Ended as end:
            outcome, status = end.outcome, end.status
        except _Aborted:
            await _send_cancelled(stream)
            outcome = ABORTED
    except asyncio.CancelledError:
        engine.client_gone(req)
        raise
    except _ClientLeft as gone:
        log.info("request %s: client gone while sending (%s)", req.id, gone)
        engine.client_gone(req)
        return
    except Exception:
        log.exception("request %s failed inside the mock engine", req.id)
        engine.finish(req, FAILED)
        raise
    if outcome == DROPPED:
        log.info("fault close-without-terminal: request %s stream closed", req.id)
    engine.finish(req, outcome)
    if status is not None:
        raise status
    if outcome != DROPPED and engine.take_hold():
        log.info("fault hold-after-terminal: request %s stream held open", req.id)
        await asyncio.Event().wait()  # until the client leaves (cancellation)


async def _send_cancelled(stream: _Stream) -> None:
    req = stream.req
    reason = req.abort_reason or "abort"
    if stream.engine.config.role == "prefill":
        await stream.send_error(pb.ErrorCode.CANCELLED, f"request aborted ({reason})", retryable=False)
        return
    pending = stream.req.extra.get("pending_outputs", list(range(stream.plan.num_outputs)))
    for k, index in enumerate(pending):
        last = k == len(pending) - 1
        await stream.send(
            ev.finished_event(
                req.id, index, None, stream.usage() if last else None, message=f"aborted ({reason})"
            )
        )


async def _run(stream: _Stream) -> None:
    engine, req, plan = stream.engine, stream.req, stream.plan
    # 1. Wait for a running slot.
    while not req.running:
        await _pause(req, -1.0)
    if req.alloc is None:
        try:
            engine.allocate(req)
        except KvCacheFull as err:
            await stream.fail(pb.ErrorCode.OVERLOADED, f"KV cache full: {err}", retryable=True)
    assert req.alloc is not None
    stream.cached = req.alloc.cached_tokens
    req.phase = "prefill"
    # 2. Decode: receive the prefill's KV over the transfer protocol.
    if engine.config.role == "decode":
        await _receive_kv(stream)
    elif engine.config.first_token_delay_s > 0:
        await _pause(req, engine.config.first_token_delay_s)
    if req.abort_reason is not None:
        raise _Aborted
    # 3. Prompt logprobs.
    if plan.prompt_logprobs is not None:
        scores = gen.prompt_scores(plan.prompt_ids, plan.prompt_logprobs.start, plan.prompt_logprobs.spec)
        await stream.send(ev.prompt_event(req.id, scores))
        if stream.faults.has("prompt-twice"):
            await stream.send(ev.prompt_event(req.id, scores))
    # 4. Prefill: hand the KV over and end with PrefillReady.
    if engine.config.role == "prefill":
        await _hand_off(stream)
        return
    req.phase = "decode"
    await _generate(stream)


async def _receive_kv(stream: _Stream) -> None:
    engine, req, plan = stream.engine, stream.req, stream.plan
    locator = req.locator
    assert locator is not None
    timeout = engine.config.bootstrap_timeout_s + 10.0 if locator.mode == "bootstrap" else 10.0
    try:
        payload = await _abortable(req, xfer.fetch_session(locator, timeout=timeout))
        expected = compute_block_hashes(
            plan.prompt_ids,
            engine.config.kv_block_size,
            lora_id=plan.lora.lora_id if plan.lora else None,
            media_hashes=plan.media,
            cache_salt=plan.cache_salt or None,
        )
        xfer.verify_payload(payload, expected, block_size=engine.config.kv_block_size)
    except xfer.KvTransferError as err:
        await stream.fail(err.code, str(err), retryable=err.retryable)


async def _hand_off(stream: _Stream) -> None:
    engine, req, plan = stream.engine, stream.req, stream.plan
    server = engine.transfer
    if server is None:
        await stream.fail(
            pb.ErrorCode.KV_TRANSFER_FAILED, "no KV transfer server on this engine", retryable=False
        )
        return
    alloc = req.alloc
    assert alloc is not None
    cache = engine.caches[req.rank]
    spec = engine.flavor
    first = gen.OutputSequence(
        seed=gen.output_seed(plan.seed, 0, plan.greedy),
        rules=plan.rules,
        greedy=plan.greedy,
        forced=plan.forced,
    ).next_step()
    req.phase = "handoff"

    def hold(sid: str) -> xfer.KvSessionPayload:  # context-first: held until decode pulls it
        payload = xfer.KvSessionPayload.from_allocation(sid, alloc)
        server.hold(payload, release=lambda: cache.release(alloc))
        req.extra["blocks_handed_off"] = True
        req.session_id = sid
        return payload

    if req.room is not None:
        session = plan.kv_session
        assert session is not None and session.bootstrap is not None
        sid = session.session_id or f"room-{req.room}"
        payload = xfer.KvSessionPayload.from_allocation(sid, alloc)
        req.extra["blocks_handed_off"] = True
        try:
            await _abortable(
                req, server.send_bootstrap(req.room, payload, release=lambda: cache.release(alloc))
            )
        except xfer.KvTransferError as err:
            await stream.fail(err.code, str(err), retryable=err.retryable)
        ref = xfer.sglang_session_ref(
            bootstrap=session.bootstrap,
            session_id=sid,
            dp_rank=req.rank,
            transfer_backend=spec.transfer_backend,
        )
    elif spec.handoff_profile == xfer.SGLANG_PROFILE:  # a schema without client bootstrap
        sid = hold(f"{req.id}@{engine.instance_id}").session_id
        ref = xfer.sglang_context_session_ref(
            session_id=sid, endpoint=server.endpoint, dp_rank=req.rank, transfer_backend=spec.transfer_backend
        )
    elif spec.handoff_profile == xfer.TRTLLM_PROFILE:
        ctx_id = xfer.new_ctx_request_id()
        payload = hold(str(ctx_id))
        ref = xfer.trtllm_session_ref(
            ctx_request_id=ctx_id,
            endpoint=server.endpoint,
            payload=payload,
            first_gen_tokens=[first.token_id],
            dp_rank=req.rank,
            transfer_backend=spec.transfer_backend,
        )
    else:
        sid = f"{req.id}@{engine.instance_id}"
        payload = hold(sid)
        ref = xfer.vllm_session_ref(
            session_id=sid,
            engine_id=engine.instance_id,
            endpoint=server.endpoint,
            num_blocks=payload.num_blocks,
            dp_rank=req.rank,
            tp_size=engine.config.tp_size,
            transfer_backend=spec.transfer_backend,
        )
    ref = schemas.advertise(engine.config, ref)
    if engine.config.faults.has("session-foreign-rank"):
        ref.dp_rank = engine.config.dp_size
    await stream.send(ev.prefill_ready_event(req.id, ref, stream.usage()))


async def _generate(stream: _Stream) -> None:
    engine, req, plan = stream.engine, stream.req, stream.plan
    n = plan.num_outputs
    faults = stream.faults
    rules = plan.rules
    if faults.has("ignore-max-tokens"):
        rules = dataclasses.replace(rules, max_tokens=rules.max_tokens + 1)
    skip_finish = faults.has("skip-finish")
    outputs = [
        gen.OutputSequence(
            seed=gen.output_seed(plan.seed, i, plan.greedy),
            rules=rules,
            greedy=plan.greedy,
            logprobs=plan.output_candidates,
            with_logprobs=plan.output_logprobs,
            forced=plan.forced,
        )
        for i in range(n)
    ]
    active = list(range(n))
    req.extra["pending_outputs"] = active
    cache = engine.caches[req.rank]
    fast = stream.fast_tokens
    delay = stream.delay
    steps = 0
    hung = engine.hangs.generate_running
    while active:
        if not hung.is_set():  # the Generate hang switch (sidecar/mock/hangs.py); an Abort still ends it
            await _abortable(req, hung.wait())
        if delay > 0:
            await _pause(req, delay)
        elif not stream.fast or steps % _FAST_YIELD_EVERY == 0:
            await asyncio.sleep(0)
            if req.abort_reason is not None:
                raise _Aborted
        steps += 1
        for index in list(active):
            step = outputs[index].next_step()
            req.completion_tokens += 1
            if index == 0 and req.alloc is not None and not req.alloc.released:
                try:
                    cache.extend(req.alloc, (step.token_id,))
                except KvCacheFull:
                    pass  # the mock keeps generating without caching further blocks
            if fast is not None:
                await stream.send(fast.event(index, step))
            elif plan.stamp_tokens:  # benchmark: the text is the engine's send time (ns since the epoch)
                await stream.send(
                    ev.token_event(req.id, index, gen.Step(step.token_id, str(time.time_ns()), None, None))
                )
            elif faults.flags:
                token = ev.token_event(req.id, index, step)
                if faults.has("wrong-request-id"):
                    token.request_id = "someone-else"
                if faults.has("no-output-index"):
                    token.token.output_index = None  # type: ignore[union-attr]
                if faults.has("early-usage") and stream.tokens_sent == 0:
                    token.usage = stream.usage()
                await stream.send(token)
            else:
                await stream.send(ev.token_event(req.id, index, step))
            stream.tokens_sent += 1
            if step.finish is not None:
                active.remove(index)
                last = not active
                finished = ev.finished_event(req.id, index, step.finish, stream.usage() if last else None)
                if faults.has("no-stop-match"):
                    finished.finished.stop_match = None  # type: ignore[union-attr]
                if skip_finish and not last:
                    skip_finish = False  # fault: this output never gets its GenerationFinished
                else:
                    await stream.send(finished)
                if stream.faults.token_after_finish:
                    extra = gen.Step(step.token_id, "", None, None)
                    await stream.send(ev.token_event(req.id, index, extra))
            if active:
                await stream.after_token()
            if req.abort_reason is not None and active:
                raise _Aborted

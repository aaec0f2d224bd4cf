"""Drives one accepted request through ``AsyncLLM.generate`` and sends its OpenEngine events.

``run_request(engine, active, send)`` ends the request with exactly one outcome:

- completed: every output finished (the last ``GenerationFinished`` carries Usage);
- aborted: an Abort (or a drain deadline) came before the terminal: vLLM is told to abort the
  request, nothing more is sent (not even outputs vLLM made before the Abort and the client has
  not read yet), and every unfinished output gets ``GenerationFinished{CANCELLED}``;
- cancelled: the client reset the stream (or the server shut down): the handler sees
  ``asyncio.CancelledError`` wherever it waits; vLLM is told to abort the request (a task
  that outlives the cancelled handler) and the error propagates;
- failed: vLLM rejected the request before its first output (a validation error becomes a
  non-OK status: nothing was sent, the request is forgotten), or failed it later (one
  terminal ``EngineError``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sidecar.engines.vllm.engine import ABORTED, CANCELLED, COMPLETED, FAILED, Active, VllmEngine
from sidecar.engines.vllm.events import EngineFailure, EventBuilder
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

log = logging.getLogger(__name__)

Send = Callable[[Any], Awaitable[None]]


def _refusal(err: BaseException) -> RpcStatusError | None:
    """The status for a vLLM error raised before the request's first output, if it is a refusal."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMNotFoundError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(err, VLLMNotFoundError):
        return RpcStatusError("NOT_FOUND", str(err))
    if isinstance(err, GracefulHTTPError):
        return RpcStatusError("RESOURCE_EXHAUSTED", str(err) or type(err).__name__)
    if isinstance(err, VLLMClientError | ValueError | TypeError):
        return RpcStatusError("INVALID_ARGUMENT", str(err))
    if isinstance(err, EngineDeadError):
        return RpcStatusError("UNAVAILABLE", "the vLLM engine core is not running")
    return None


async def run_request(engine: VllmEngine, active: Active, send: Send) -> None:
    """Serve ``active`` to its end (see the module doc). Re-raises cancellation."""
    plan = active.plan
    builder = EventBuilder(
        plan.request_id,
        plan.num_outputs,
        eos_token_id=engine.discovery.eos_token_id,
        prompt_logprobs=plan.prompt_logprobs,
        prompt_logprob_start=plan.prompt_logprob_start,
        output_logprobs=plan.output_logprobs,
        top_n=plan.top_n,
        candidate_ids=frozenset(plan.params.logprob_token_ids or ()),
    )
    llm = engine.llm
    outputs = llm.generate(
        plan.prompt,
        plan.params,
        plan.request_id,
        priority=plan.priority,
        trace_headers=plan.trace_headers or None,
    )

    async def emit(events: list[pb.GenerateResponse], *, terminal: bool = False) -> None:
        """Send ``events`` in order; once an Abort has come (and these are not its terminal
        events), the rest are withdrawn from ``builder`` unsent."""
        for i, event in enumerate(events):
            if active.abort_reason is not None and not terminal:
                builder.withdraw(events[i:])
                return
            try:
                await send(event)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the transport failed: the client is gone
                raise _ClientGone(f"{type(err).__name__}: {err}") from err
            active.first_event = True

    outcome = FAILED
    try:
        try:
            async for out in outputs:
                if active.abort_reason is not None:
                    # Aborted: nothing more is sent, not even what vLLM made before the Abort
                    # (it may have finished the request while its events still waited for the
                    # client); vLLM is told again in case the Abort came before it knew the request
                    if not out.finished:
                        await llm.abort(plan.request_id)
                    break
                await emit(builder.on_output(out))
            if not builder.done:
                reason = active.abort_reason or "by the engine"
                await emit(builder.cancel_rest(f"aborted ({reason})"), terminal=True)
            outcome = ABORTED if active.abort_reason is not None else COMPLETED
        except (asyncio.CancelledError, GeneratorExit):
            outcome = CANCELLED
            raise
        except _ClientGone as gone:
            log.info("request %s: client gone while sending (%s)", plan.request_id, gone)
            outcome = CANCELLED
        except EngineFailure as err:
            await emit([builder.error(pb.ErrorCode.INTERNAL, str(err), retryable=True)], terminal=True)
        except Exception as err:
            refusal = _refusal(err.__cause__ or err)
            if not active.first_event and refusal is not None:
                engine.forget(active)
                raise refusal from None
            log.exception("request %s failed inside vLLM", plan.request_id)
            if not builder.done:
                await emit(
                    [builder.error(pb.ErrorCode.INTERNAL, f"vLLM: {err}", retryable=True)], terminal=True
                )
    finally:
        if outcome == CANCELLED or not builder.done:
            engine.spawn(llm.abort(plan.request_id))  # idempotent; survives the cancelled handler
        engine.spawn(outputs.aclose())
        engine.finish(active, outcome)


class _ClientGone(Exception):
    """Sending an event failed at the transport."""

"""Drives one accepted request through ``AsyncLLM.generate`` (the outcomes are
:func:`sidecar.engines.common.stream.drive`'s): vLLM's delta outputs become events through
:class:`~sidecar.engines.vllm.events.EventBuilder`; vLLM's errors raised before the first output
become a non-OK status (:func:`_refusal`)."""

from __future__ import annotations

from typing import Any

from sidecar.engines.common.registry import Active
from sidecar.engines.common.stream import Send, drive
from sidecar.engines.vllm.engine import VllmEngine
from sidecar.engines.vllm.events import EventBuilder
from sidecar.openengine.serving.grpc_server import RpcStatusError


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


def _finished(out: Any) -> bool:
    return bool(out.finished)


async def run_request(engine: VllmEngine, active: Active, send: Send) -> None:
    """Serve ``active`` to its end; re-raises cancellation."""
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
    outputs = engine.llm.generate(
        plan.prompt,
        plan.params,
        plan.request_id,
        priority=plan.priority,
        trace_headers=plan.trace_headers or None,
    )
    await drive(
        engine,
        active,
        send,
        builder,
        outputs,
        convert=builder.on_output,
        finished=_finished,
        refusal=_refusal,
        engine_name="vLLM",
    )

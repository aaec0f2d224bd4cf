"""Drives one accepted request through SGLang's ``Engine.async_generate`` (the outcomes are
:func:`sidecar.engines.common.stream.drive`'s): SGLang's cumulative chunks become events through
:class:`~sidecar.engines.sglang.events.ChunkEvents`; SGLang's errors raised before the first
output become a non-OK status (:func:`_refusal`).

Without ``max_tokens`` a request may run to the end of the context (SGLang's own default is 128
tokens): the adapter sets ``max_new_tokens`` to the context left after the prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sidecar.engines.common.registry import Active
from sidecar.engines.common.stream import Send, drive
from sidecar.engines.sglang.engine import SglangEngine
from sidecar.engines.sglang.events import ChunkEvents, EngineRefusal
from sidecar.openengine.serving.grpc_server import RpcStatusError


def _refusal(err: BaseException) -> RpcStatusError | None:
    """The status for an SGLang error raised before the request's first output, if it is a refusal."""
    if isinstance(err, EngineRefusal):
        return RpcStatusError("RESOURCE_EXHAUSTED" if err.status == 429 else "INVALID_ARGUMENT", str(err))
    if isinstance(err, ValueError | TypeError):
        return RpcStatusError("INVALID_ARGUMENT", str(err))
    return None


def _finished(chunk: Any) -> bool:
    return bool((chunk.get("meta_info") or {}).get("finish_reason"))


def _max_new_tokens(engine: SglangEngine, active: Active) -> int:
    plan = active.plan
    ids = plan.prompt_ids
    if ids is None:
        ids = engine.tokenizer_manager.tokenizer.encode(plan.prompt_text)
    return max(1, engine.discovery.limits.max_model_len - len(ids))


async def run_request(engine: SglangEngine, active: Active, send: Send) -> None:
    """Serve ``active`` to its end; re-raises cancellation."""
    plan = active.plan
    builder = ChunkEvents(
        plan.request_id,
        plan.num_outputs,
        eos_token_id=engine.discovery.eos_token_id,
        stop_token_ids=plan.stop_token_ids,
        prompt_logprobs=plan.prompt_logprobs,
        prompt_top_n=plan.prompt_top_n,
        output_logprobs=plan.output_logprobs,
        top_n=plan.top_n,
    )
    sampling = plan.kwargs["sampling_params"]
    if "max_new_tokens" not in sampling:
        sampling["max_new_tokens"] = _max_new_tokens(engine, active)

    async def outputs() -> AsyncIterator[Any]:
        stream = await engine.sgl.async_generate(rid=plan.rid, **plan.kwargs)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    await drive(
        engine,
        active,
        send,
        builder,
        outputs(),
        convert=builder.on_chunk,
        finished=_finished,
        refusal=_refusal,
        engine_name="SGLang",
    )

"""A ``GenerateRequest`` checked and mapped to vLLM's prompt and ``SamplingParams``, before acceptance.

:func:`plan_request` raises :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError` for anything the
engine will not run, so a refusal is a non-OK status with no event: the engine-neutral checks of
:mod:`sidecar.engines.common.checks` (the statuses are listed there), and vLLM's own validation
of ``SamplingParams`` (``INVALID_ARGUMENT``). Everything else maps onto vLLM's own fields
(docs/ENGINES.md has the table). I/O-free; imports vLLM's ``SamplingParams`` only when
building one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.engines.common.checks import (
    ModelLimits,
    check_request,
    guide,
    invalid,
    metadata_values,
    prompt_input,
    sampling_values,
    stopping_values,
    top_n,
    unsupported,
)
from sidecar.openengine import pb

__all__ = ["ModelLimits", "VllmPlan", "plan_request"]

#: OpenEngine guide kind -> vLLM ``StructuredOutputsParams`` field
_GUIDES = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf_grammar": "grammar",
    "choice": "choice",
    "json_object": "json_object",
}


@dataclass
class VllmPlan:
    """One accepted request, ready for ``AsyncLLM.generate``."""

    request_id: str
    prompt: dict[str, Any]
    params: Any  # vllm.SamplingParams
    num_outputs: int
    prompt_logprobs: bool = False
    prompt_logprob_start: int = 0
    output_logprobs: bool = False
    top_n: int = 0
    priority: int = 0
    trace_headers: dict[str, str] = field(default_factory=dict)


def plan_request(
    request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]], limits: ModelLimits
) -> VllmPlan:
    """Check ``request`` and map it; raises :class:`RpcStatusError` (see the module doc)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    priority, trace = metadata_values(metadata)
    if priority is not None and not limits.priority:
        raise unsupported("openengine-priority needs --scheduling-policy priority on this engine")
    check_request(request, limits)
    source = prompt_input(request, limits)
    prompt: dict[str, Any] = {"prompt": source} if isinstance(source, str) else {"prompt_token_ids": source}
    kwargs: dict[str, Any] = {
        **sampling_values(request.sampling, limits),
        **stopping_values(request.stopping, limits),
        "output_kind": RequestOutputKind.DELTA,
    }
    resp = request.response or pb.ResponseOptions()
    plan_extra: dict[str, Any] = {}
    if resp.return_prompt_logprobs:
        top, _ = top_n(resp.prompt_candidates, "prompt", limits)
        kwargs["prompt_logprobs"] = top
        plan_extra["prompt_logprob_start"] = resp.prompt_logprob_start or 0
    if resp.return_output_logprobs:
        top, ids = top_n(resp.output_candidates, "output", limits)
        kwargs["logprobs"] = top
        if ids:
            kwargs["logprob_token_ids"] = ids
        plan_extra["top_n"] = top
    guided = guide(request.guided, limits)
    if guided is not None:
        kind, value = guided
        kwargs["structured_outputs"] = StructuredOutputsParams(**{_GUIDES[kind]: value})
    kv = request.kv
    if kv is not None:
        if kv.cache_salt is not None:
            if not kv.cache_salt:
                raise invalid("kv.cache_salt is empty (omit it for no salt)")
            prompt["cache_salt"] = kv.cache_salt
        if kv.bypass_prefix_cache:
            kwargs["skip_reading_prefix_cache"] = True
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as err:
        raise invalid(f"sampling options: {err}") from None
    return VllmPlan(
        request_id=request.request_id,
        prompt=prompt,
        params=params,
        num_outputs=kwargs.get("n", 1),
        prompt_logprobs=bool(resp.return_prompt_logprobs),
        output_logprobs=bool(resp.return_output_logprobs),
        priority=-(priority or 0),  # vLLM runs lower values first; OpenEngine higher first
        trace_headers=trace,
        **plan_extra,
    )

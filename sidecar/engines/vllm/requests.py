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

from sidecar.engines.common import checks
from sidecar.engines.common.checks import ModelLimits
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

    priority, trace, source = checks.request_basics(
        request,
        metadata,
        limits,
        priority_refusal="openengine-priority needs --scheduling-policy priority on this engine",
    )
    prompt: dict[str, Any] = {"prompt": source} if isinstance(source, str) else {"prompt_token_ids": source}
    kwargs: dict[str, Any] = {
        **checks.sampling_values(request.sampling, limits),
        **checks.stopping_values(request.stopping, limits),
        "output_kind": RequestOutputKind.DELTA,
    }
    resp = request.response or pb.ResponseOptions()
    plan_extra: dict[str, Any] = {}
    if resp.return_prompt_logprobs:
        top, _ = checks.top_n(resp.prompt_candidates, "prompt", limits)
        kwargs["prompt_logprobs"] = top
        plan_extra["prompt_logprob_start"] = resp.prompt_logprob_start or 0
    if resp.return_output_logprobs:
        top, ids = checks.top_n(resp.output_candidates, "output", limits)
        kwargs["logprobs"] = top
        if ids:
            kwargs["logprob_token_ids"] = ids
        plan_extra["top_n"] = top
    guided = checks.guide(request.guided, limits)
    if guided is not None:
        kind, value = guided
        kwargs["structured_outputs"] = StructuredOutputsParams(**{_GUIDES[kind]: value})
    salt, bypass = checks.kv_values(request)
    if salt is not None:
        prompt["cache_salt"] = salt
    if bypass:
        kwargs["skip_reading_prefix_cache"] = True
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as err:
        raise checks.invalid(f"sampling options: {err}") from None
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

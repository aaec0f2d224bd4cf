"""A ``GenerateRequest`` checked and mapped to SGLang's ``async_generate`` arguments, before acceptance.

:func:`plan_request` raises :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError` for anything the
engine will not run: the engine-neutral checks of :mod:`sidecar.engines.common.checks` (the
statuses are listed there), and what SGLang cannot do here, ``UNIMPLEMENTED``: guided decoding
by choice or JSON object (SGLang takes a JSON schema, a regex or an EBNF grammar), the
prefix-cache bypass, ``openengine-priority`` (priority scheduling is off), and stop token ids
other than EOS together with ``ignore_eos`` (SGLang's ``ignore_eos`` turns stop token ids off
too: it would generate past them). Everything else maps
onto SGLang's own fields (docs/ENGINES.md has the table). I/O-free, SGLang-free.

SGLang's rid is not the request id: its scheduler aborts every request whose rid *starts
with* the one it is given, so the adapter sends ``oe{len}:{id}`` (:func:`sglang_rid`), which no
other request's rid starts with (and SGLang's own per-sample suffix ``_i`` for ``n`` > 1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.engines.common import checks
from sidecar.engines.common.checks import ModelLimits, unsupported
from sidecar.openengine import pb

__all__ = ["ModelLimits", "SglangPlan", "plan_request", "sglang_rid"]

#: OpenEngine sampling value -> SGLang ``sampling_params`` key
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "sampling_seed",
    "n": "n",
}
#: OpenEngine stopping value -> SGLang ``sampling_params`` key
_STOPPING = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "include_stop_str_in_output": "no_stop_trim",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
}
#: OpenEngine guide kind -> SGLang ``sampling_params`` key
_GUIDES = {"json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "ebnf"}


def sglang_rid(request_id: str) -> str:
    """The SGLang rid of ``request_id``: no other request's rid starts with it (see the module doc)."""
    return f"oe{len(request_id)}:{request_id}"


@dataclass
class SglangPlan:
    """One accepted request, ready for ``Engine.async_generate`` (``kwargs``)."""

    request_id: str
    kwargs: dict[str, Any]
    num_outputs: int
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_logprobs: bool = False
    output_logprobs: bool = False
    prompt_top_n: int = 0
    top_n: int = 0
    candidate_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def rid(self) -> str:
        return sglang_rid(self.request_id)

    @property
    def rids(self) -> list[str]:
        """SGLang's rids of this request's outputs (it adds ``_i`` per sample when ``n`` > 1)."""
        if self.num_outputs == 1:
            return [self.rid]
        return [f"{self.rid}_{i}" for i in range(self.num_outputs)]


def plan_request(
    request: pb.GenerateRequest,
    metadata: Sequence[tuple[str, str | bytes]],
    limits: ModelLimits,
    eos_token_ids: frozenset[int] = frozenset(),
) -> SglangPlan:
    """Check ``request`` and map it; raises :class:`RpcStatusError` (see the module doc)."""
    _, trace, source = checks.request_basics(
        request,
        metadata,
        limits,  # priority off: SGLang's discovery says so
        priority_refusal="openengine-priority: this engine does not schedule by priority",
    )
    sampling = {_SAMPLING[k]: v for k, v in checks.sampling_values(request.sampling, limits).items()}
    stopping = checks.stopping_values(request.stopping, limits)
    if stopping.get("ignore_eos") and set(stopping.get("stop_token_ids") or ()) - eos_token_ids:
        # SGLang's scheduler checks no stop token at all under ignore_eos: it would run past them
        raise unsupported("stop token ids with ignore_eos: this engine ignores both together")
    sampling.update({_STOPPING[k]: v for k, v in stopping.items()})
    kwargs: dict[str, Any] = {"stream": True}
    if isinstance(source, str):
        kwargs["prompt"] = source
    else:
        kwargs["input_ids"] = source
    resp = request.response or pb.ResponseOptions()
    prompt_top, top = 0, 0
    ids: list[int] = []
    if resp.return_prompt_logprobs or resp.return_output_logprobs:
        kwargs["return_logprob"] = True
        # SGLang computes prompt logprobs from logprob_start_len on; none when only output is asked
        kwargs["logprob_start_len"] = (resp.prompt_logprob_start or 0) if resp.return_prompt_logprobs else -1
    if resp.return_prompt_logprobs:
        prompt_top, _ = checks.top_n(resp.prompt_candidates, "prompt", limits)
    if resp.return_output_logprobs:
        top, ids = checks.top_n(resp.output_candidates, "output", limits)
        if ids:
            kwargs["token_ids_logprob"] = ids
    if max(top, prompt_top):  # one number for both in SGLang: each side is cut to its own
        kwargs["top_logprobs_num"] = max(top, prompt_top)
    guided = checks.guide(request.guided, limits)
    if guided is not None:
        kind, value = guided
        if kind not in _GUIDES:
            raise unsupported(f"guided decoding by {kind} is not supported by this engine")
        sampling[_GUIDES[kind]] = json.dumps(value) if kind == "json_schema" else value
    salt, bypass = checks.kv_values(request)
    if salt is not None:
        kwargs["cache_salt"] = salt
    if bypass:
        raise unsupported("kv.bypass_prefix_cache is not supported by this engine")
    if trace:
        kwargs["external_trace_header"] = trace
    kwargs["sampling_params"] = sampling
    return SglangPlan(
        request_id=request.request_id,
        kwargs=kwargs,
        num_outputs=int(sampling.get("n", 1)),
        prompt_ids=None if isinstance(source, str) else source,
        prompt_text=source if isinstance(source, str) else None,
        prompt_logprobs=bool(resp.return_prompt_logprobs),
        output_logprobs=bool(resp.return_output_logprobs),
        prompt_top_n=prompt_top,
        top_n=top,
        candidate_ids=ids,
        stop_token_ids=frozenset(stopping.get("stop_token_ids") or ()),
    )

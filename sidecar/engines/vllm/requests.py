"""A ``GenerateRequest`` checked and mapped to vLLM's prompt and ``SamplingParams``, before acceptance.

:func:`plan_request` raises :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError` for anything the
engine will not run, so a refusal is a non-OK status with no event (schema "Standard errors"):

- ``INVALID_ARGUMENT``: malformed metadata or values (no input, empty stop condition,
  ``num_sequences`` 0, non-finite or out-of-range sampling values, token ids outside the
  vocabulary, ``min_tokens`` above ``max_tokens``, a prompt longer than the context, more
  candidates than ``max_logprobs``, an invalid JSON schema);
- ``NOT_FOUND``: a model name this engine does not serve;
- ``FAILED_PRECONDITION``: a KV session (this engine is aggregated), a LoRA adapter (LoRA is not
  enabled);
- ``UNIMPLEMENTED``: what vLLM cannot do here: media, ``media_options``, prompt candidates by token
  ids, ``all`` candidates, structural tags, a guided-decoding backend other than the engine's,
  ``openengine-priority`` without ``--scheduling-policy priority``.

Everything else maps onto vLLM's own fields (docs/ENGINES.md). I/O-free; imports
vLLM's ``SamplingParams`` only when building one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import betterproto2

from sidecar.core.errors import Rejection
from sidecar.core.metadata import normalize_metadata
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

SEED_MODULUS = 2**63  # vLLM seeds a torch generator: an int64


@dataclass(frozen=True)
class ModelLimits:
    """What requests are checked against (from vLLM's resolved configuration)."""

    names: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    max_num_sequences: int
    max_logprobs: int
    priority: bool
    guided_backend: str


@dataclass
class Plan:
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


def _which(message: Any, group: str) -> tuple[str | None, Any]:
    """The set field of a oneof group and its value (untyped, as betterproto2 returns it)."""
    kind, value = betterproto2.which_one_of(message, group)
    return kind, value


def _invalid(message: str) -> RpcStatusError:
    return RpcStatusError("INVALID_ARGUMENT", message)


def _unsupported(message: str) -> RpcStatusError:
    return RpcStatusError("UNIMPLEMENTED", message)


def _metadata(pairs: Sequence[tuple[str, str | bytes]]) -> tuple[int | None, dict[str, str]]:
    """(openengine-priority, trace headers); the OpenEngine keys checked as the sidecar checks them."""
    keys = [
        (k, v.decode("ascii", "replace") if isinstance(v, bytes) else v)
        for k, v in pairs
        if k.lower().startswith("openengine-") or k.lower() in ("traceparent", "tracestate")
    ]
    try:
        meta = normalize_metadata(keys, dp_ranks=[0])
    except Rejection as rej:
        raise _invalid(rej.message) from None
    trace = {k: v for k, v in meta.pairs if k in ("traceparent", "tracestate")}
    return meta.priority, trace


def _prompt(request: pb.GenerateRequest, limits: ModelLimits) -> dict[str, Any]:
    kind, value = _which(request, "input")
    if kind == "prompt":
        if not value:
            raise _invalid("prompt is empty")
        return {"prompt": value}
    if kind == "token_ids":
        ids = list(value.ids)
        if not ids:
            raise _invalid("token_ids is empty")
        if len(ids) >= limits.max_model_len:
            raise _invalid(f"prompt has {len(ids)} tokens; the context is {limits.max_model_len}")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise _invalid(f"token id {bad} is outside the vocabulary ({limits.vocab_size})")
        return {"prompt_token_ids": ids}
    raise _invalid("request has no input (prompt or token_ids)")


def _finite(name: str, value: float | None, lo: float | None = None, hi: float | None = None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _invalid(f"sampling.{name} {value} is out of range")


def _sampling(s: pb.SamplingParams | None, limits: ModelLimits) -> dict[str, Any]:
    if s is None:
        return {}
    _finite("temperature", s.temperature, 0.0)
    _finite("top_p", s.top_p, 0.0, 1.0)
    _finite("min_p", s.min_p, 0.0, 1.0)
    _finite("frequency_penalty", s.frequency_penalty, -2.0, 2.0)
    _finite("presence_penalty", s.presence_penalty, -2.0, 2.0)
    _finite("repetition_penalty", s.repetition_penalty, 0.0)
    if s.top_p is not None and s.top_p == 0.0:
        raise _invalid("sampling.top_p must be above 0")
    if s.repetition_penalty is not None and s.repetition_penalty == 0.0:
        raise _invalid("sampling.repetition_penalty must be above 0")
    if s.top_k is not None and s.top_k < -1:
        raise _invalid(f"sampling.top_k {s.top_k} is out of range (-1 or 0 disable it)")
    if s.num_sequences is not None:
        if s.num_sequences == 0:
            raise _invalid("sampling.num_sequences must be greater than zero when present")
        if s.num_sequences > limits.max_num_sequences:
            raise _invalid(
                f"sampling.num_sequences {s.num_sequences} is above max_num_sequences {limits.max_num_sequences}"
            )
    out = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "seed": None if s.seed is None else s.seed % SEED_MODULUS,
        "n": s.num_sequences,
    }
    return {k: v for k, v in out.items() if v is not None}


def _stopping(st: pb.StoppingOptions | None, limits: ModelLimits) -> dict[str, Any]:
    if st is None:
        return {}
    if st.max_tokens is not None and st.max_tokens == 0:
        raise _invalid("stopping.max_tokens must be greater than zero when present")
    if st.max_tokens is not None and st.min_tokens is not None and st.min_tokens > st.max_tokens:
        raise _invalid(f"stopping.min_tokens {st.min_tokens} is above max_tokens {st.max_tokens}")
    texts: list[str] = []
    ids: list[int] = []
    for i, cond in enumerate(st.conditions):
        kind, value = _which(cond, "condition")
        if kind == "stop_text" and value:
            texts.append(value)
        elif kind == "stop_token_id":
            if value >= limits.vocab_size:
                raise _invalid(f"stopping.conditions[{i}]: token id {value} is outside the vocabulary")
            ids.append(value)
        else:
            raise _invalid(f"stopping.conditions[{i}] is empty")
    out: dict[str, Any] = {
        "max_tokens": st.max_tokens,
        "min_tokens": st.min_tokens,
        "ignore_eos": st.ignore_eos,
        "include_stop_str_in_output": st.include_stop_in_output,
        "stop": texts or None,
        "stop_token_ids": ids or None,
    }
    return {k: v for k, v in out.items() if v is not None}


def _top_n(sel: pb.CandidateTokenSelection | None, what: str, limits: ModelLimits) -> tuple[int, list[int]]:
    """(top n, token ids) of a candidate selection; ``all`` and (prompt) token ids are refused."""
    if sel is None:
        return 0, []
    kind, value = _which(sel, "selection")
    if kind == "top_n":
        if value > limits.max_logprobs:
            raise _invalid(f"{what} candidates top_n {value} is above max_logprobs {limits.max_logprobs}")
        return int(value), []
    if kind == "token_ids" and what == "output":
        ids = list(value.ids)
        if not ids:
            raise _invalid("output candidate token_ids is empty")
        if any(t >= limits.vocab_size for t in ids):
            raise _invalid("output candidate token_ids are outside the vocabulary")
        return 0, ids
    if kind is None:
        return 0, []
    raise _unsupported(f"{what} logprob candidates by {kind} are not supported by this engine")


def _guided(g: pb.GuidedDecoding | None, limits: ModelLimits) -> Any:
    if g is None:
        return None
    kind, value = _which(g, "guide")
    if kind is None:
        if g.backend:
            raise _invalid("guided.backend is set without a guide")
        return None
    if g.backend and g.backend != limits.guided_backend:
        raise _unsupported(f"guided.backend {g.backend!r}: this engine uses {limits.guided_backend!r}")
    from vllm.sampling_params import StructuredOutputsParams

    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError:
            raise _invalid("guided.json_schema is not valid JSON") from None
        return StructuredOutputsParams(json=schema)
    if kind == "regex" and value:
        return StructuredOutputsParams(regex=value)
    if kind == "ebnf_grammar" and value:
        return StructuredOutputsParams(grammar=value)
    if kind == "choice":
        if not value.choices:
            raise _invalid("guided.choice has no choices")
        return StructuredOutputsParams(choice=list(value.choices))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        raise _unsupported("guided decoding by structural_tag is not supported by this engine")
    raise _invalid(f"guided.{kind} is empty")


def plan_request(
    request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]], limits: ModelLimits
) -> Plan:
    """Check ``request`` and map it; raises :class:`RpcStatusError` (see the module doc)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    priority, trace = _metadata(metadata)
    if priority is not None and not limits.priority:
        raise _unsupported("openengine-priority needs --scheduling-policy priority on this engine")
    if not request.request_id:
        raise _invalid("request_id is empty")
    if request.model and request.model not in limits.names:
        raise RpcStatusError("NOT_FOUND", f"model {request.model!r} is not served here")
    if request.kv is not None and request.kv.session is not None:
        raise RpcStatusError("FAILED_PRECONDITION", "a KV session was sent to an aggregated engine")
    if request.lora_name:
        raise RpcStatusError("FAILED_PRECONDITION", "LoRA is not enabled on this engine")
    if request.media:
        raise _unsupported("this engine serves a text-only model: media is not accepted")
    if request.media_options is not None and request.media_options.fields:
        raise _unsupported("this engine serves a text-only model: media_options is not accepted")
    prompt = _prompt(request, limits)
    kwargs: dict[str, Any] = {
        **_sampling(request.sampling, limits),
        **_stopping(request.stopping, limits),
        "output_kind": RequestOutputKind.DELTA,
    }
    resp = request.response or pb.ResponseOptions()
    plan_extra: dict[str, Any] = {}
    if resp.return_prompt_logprobs:
        top, _ = _top_n(resp.prompt_candidates, "prompt", limits)
        kwargs["prompt_logprobs"] = top
        plan_extra["prompt_logprob_start"] = resp.prompt_logprob_start or 0
    if resp.return_output_logprobs:
        top, ids = _top_n(resp.output_candidates, "output", limits)
        kwargs["logprobs"] = top
        if ids:
            kwargs["logprob_token_ids"] = ids
        plan_extra["top_n"] = top
    guide = _guided(request.guided, limits)
    if guide is not None:
        kwargs["structured_outputs"] = guide
    kv = request.kv
    if kv is not None:
        if kv.cache_salt is not None:
            if not kv.cache_salt:
                raise _invalid("kv.cache_salt is empty (omit it for no salt)")
            prompt["cache_salt"] = kv.cache_salt
        if kv.bypass_prefix_cache:
            kwargs["skip_reading_prefix_cache"] = True
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as err:
        raise _invalid(f"sampling options: {err}") from None
    return Plan(
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

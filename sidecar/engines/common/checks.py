"""Checks every adapter applies to a ``GenerateRequest`` before acceptance, engine-neutral.

Each function raises :class:`~sidecar.openengine.serving.grpc_server.RpcStatusError` for what no engine will
run (a refusal is a non-OK status with no event, schema "Standard errors") and returns the
request's values under OpenEngine's names; an adapter maps them onto its engine's own fields:

- ``INVALID_ARGUMENT``: malformed metadata or values (no input, empty stop condition,
  ``num_sequences`` 0, non-finite or out-of-range sampling values, token ids outside the
  vocabulary, ``min_tokens`` above ``max_tokens``, a prompt as long as the context, more
  candidates than ``max_logprobs``, a JSON schema that is not JSON);
- ``NOT_FOUND``: a model name the engine does not serve;
- ``FAILED_PRECONDITION``: a KV session (the engines are aggregated), a LoRA adapter;
- ``UNIMPLEMENTED``: media, ``media_options``, prompt candidates by token ids, ``all``
  candidates, structural tags, a guided-decoding backend other than the engine's,
  ``openengine-priority`` when the engine does not schedule by priority.

I/O-free, engine-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import betterproto2

from sidecar.core.errors import Rejection
from sidecar.core.metadata import normalize_metadata
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

SEED_MODULUS = 2**63  # engines seed a torch generator: an int64


@dataclass(frozen=True)
class ModelLimits:
    """What requests are checked against (from the engine's resolved configuration)."""

    names: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    max_num_sequences: int
    max_logprobs: int
    priority: bool
    guided_backend: str


def which(message: Any, group: str) -> tuple[str | None, Any]:
    """The set field of a oneof group and its value (untyped, as betterproto2 returns it)."""
    kind, value = betterproto2.which_one_of(message, group)
    return kind, value


def invalid(message: str) -> RpcStatusError:
    return RpcStatusError("INVALID_ARGUMENT", message)


def unsupported(message: str) -> RpcStatusError:
    return RpcStatusError("UNIMPLEMENTED", message)


def metadata_values(pairs: Sequence[tuple[str, str | bytes]]) -> tuple[int | None, dict[str, str]]:
    """(openengine-priority, trace headers); the OpenEngine keys checked as the sidecar checks them."""
    keys = [
        (k, v.decode("ascii", "replace") if isinstance(v, bytes) else v)
        for k, v in pairs
        if k.lower().startswith("openengine-") or k.lower() in ("traceparent", "tracestate")
    ]
    try:
        meta = normalize_metadata(keys, dp_ranks=[0])
    except Rejection as rej:
        raise invalid(rej.message) from None
    trace = {k: v for k, v in meta.pairs if k in ("traceparent", "tracestate")}
    return meta.priority, trace


def check_request(request: pb.GenerateRequest, limits: ModelLimits) -> None:
    """Request id, model, KV session, LoRA and media: what no adapter here accepts."""
    if not request.request_id:
        raise invalid("request_id is empty")
    if request.model and request.model not in limits.names:
        raise RpcStatusError("NOT_FOUND", f"model {request.model!r} is not served here")
    if request.kv is not None and request.kv.session is not None:
        raise RpcStatusError("FAILED_PRECONDITION", "a KV session was sent to an aggregated engine")
    if request.lora_name:
        raise RpcStatusError("FAILED_PRECONDITION", "LoRA is not enabled on this engine")
    if request.media:
        raise unsupported("this engine serves a text-only model: media is not accepted")
    if request.media_options is not None and request.media_options.fields:
        raise unsupported("this engine serves a text-only model: media_options is not accepted")


def prompt_input(request: pb.GenerateRequest, limits: ModelLimits) -> str | list[int]:
    """The prompt text, or its token ids (checked against the vocabulary and the context)."""
    kind, value = which(request, "input")
    if kind == "prompt":
        if not value:
            raise invalid("prompt is empty")
        return str(value)
    if kind == "token_ids":
        ids = list(value.ids)
        if not ids:
            raise invalid("token_ids is empty")
        if len(ids) >= limits.max_model_len:
            raise invalid(f"prompt has {len(ids)} tokens; the context is {limits.max_model_len}")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the vocabulary ({limits.vocab_size})")
        return ids
    raise invalid("request has no input (prompt or token_ids)")


def request_basics(
    request: pb.GenerateRequest,
    metadata: Sequence[tuple[str, str | bytes]],
    limits: ModelLimits,
    *,
    priority_refusal: str,
) -> tuple[int | None, dict[str, str], str | list[int]]:
    """``(openengine-priority, trace headers, prompt)``: the metadata (a priority refused,
    ``UNIMPLEMENTED`` with ``priority_refusal``, unless the engine schedules by priority), then
    :func:`check_request` and :func:`prompt_input`."""
    priority, trace = metadata_values(metadata)
    if priority is not None and not limits.priority:
        raise unsupported(priority_refusal)
    check_request(request, limits)
    return priority, trace, prompt_input(request, limits)


def kv_values(request: pb.GenerateRequest) -> tuple[str | None, bool]:
    """``(cache salt, bypass the prefix cache)``; an empty salt is refused (omit it for none)."""
    kv = request.kv
    if kv is None:
        return None, False
    if kv.cache_salt is not None and not kv.cache_salt:
        raise invalid("kv.cache_salt is empty (omit it for no salt)")
    return kv.cache_salt, bool(kv.bypass_prefix_cache)


def _finite(name: str, value: float | None, lo: float | None = None, hi: float | None = None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(f"sampling.{name} {value} is out of range")


def sampling_values(s: pb.SamplingParams | None, limits: ModelLimits) -> dict[str, Any]:
    """The set sampling values: ``temperature``, ``top_p``, ``top_k``, ``min_p``, the three
    penalties, ``seed`` (mod 2^63) and ``n`` (``num_sequences``)."""
    if s is None:
        return {}
    _finite("temperature", s.temperature, 0.0)
    _finite("top_p", s.top_p, 0.0, 1.0)
    _finite("min_p", s.min_p, 0.0, 1.0)
    _finite("frequency_penalty", s.frequency_penalty, -2.0, 2.0)
    _finite("presence_penalty", s.presence_penalty, -2.0, 2.0)
    _finite("repetition_penalty", s.repetition_penalty, 0.0)
    if s.top_p is not None and s.top_p == 0.0:
        raise invalid("sampling.top_p must be above 0")
    if s.repetition_penalty is not None and s.repetition_penalty == 0.0:
        raise invalid("sampling.repetition_penalty must be above 0")
    if s.top_k is not None and s.top_k < -1:
        raise invalid(f"sampling.top_k {s.top_k} is out of range (-1 or 0 disable it)")
    if s.num_sequences is not None:
        if s.num_sequences == 0:
            raise invalid("sampling.num_sequences must be greater than zero when present")
        if s.num_sequences > limits.max_num_sequences:
            raise invalid(
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


def stopping_values(st: pb.StoppingOptions | None, limits: ModelLimits) -> dict[str, Any]:
    """The set stopping values: ``max_tokens``, ``min_tokens``, ``ignore_eos``,
    ``include_stop_str_in_output``, ``stop`` (texts), ``stop_token_ids``."""
    if st is None:
        return {}
    if st.max_tokens is not None and st.max_tokens == 0:
        raise invalid("stopping.max_tokens must be greater than zero when present")
    if st.max_tokens is not None and st.min_tokens is not None and st.min_tokens > st.max_tokens:
        raise invalid(f"stopping.min_tokens {st.min_tokens} is above max_tokens {st.max_tokens}")
    texts: list[str] = []
    ids: list[int] = []
    for i, cond in enumerate(st.conditions):
        kind, value = which(cond, "condition")
        if kind == "stop_text" and value:
            texts.append(value)
        elif kind == "stop_token_id":
            if value >= limits.vocab_size:
                raise invalid(f"stopping.conditions[{i}]: token id {value} is outside the vocabulary")
            ids.append(value)
        else:
            raise invalid(f"stopping.conditions[{i}] is empty")
    out: dict[str, Any] = {
        "max_tokens": st.max_tokens,
        "min_tokens": st.min_tokens,
        "ignore_eos": st.ignore_eos,
        "include_stop_str_in_output": st.include_stop_in_output,
        "stop": texts or None,
        "stop_token_ids": ids or None,
    }
    return {k: v for k, v in out.items() if v is not None}


def top_n(sel: pb.CandidateTokenSelection | None, what: str, limits: ModelLimits) -> tuple[int, list[int]]:
    """(top n, token ids) of a candidate selection; ``all`` and prompt token ids are refused."""
    if sel is None:
        return 0, []
    kind, value = which(sel, "selection")
    if kind == "top_n":
        if value > limits.max_logprobs:
            raise invalid(f"{what} candidates top_n {value} is above max_logprobs {limits.max_logprobs}")
        return int(value), []
    if kind == "token_ids" and what == "output":
        ids = list(value.ids)
        if not ids:
            raise invalid("output candidate token_ids is empty")
        if any(t >= limits.vocab_size for t in ids):
            raise invalid("output candidate token_ids are outside the vocabulary")
        return 0, ids
    if kind is None:
        return 0, []
    raise unsupported(f"{what} logprob candidates by {kind} are not supported by this engine")


def guide(g: pb.GuidedDecoding | None, limits: ModelLimits) -> tuple[str, Any] | None:
    """``(kind, value)`` of a guided-decoding request: ``json_schema`` (parsed), ``regex``,
    ``ebnf_grammar``, ``choice`` (a list), ``json_object`` (True); None when there is none."""
    if g is None:
        return None
    kind, value = which(g, "guide")
    if kind is None:
        if g.backend:
            raise invalid("guided.backend is set without a guide")
        return None
    if g.backend and g.backend != limits.guided_backend:
        raise unsupported(f"guided.backend {g.backend!r}: this engine uses {limits.guided_backend!r}")
    if kind == "json_schema":
        try:
            return kind, json.loads(value)
        except ValueError:
            raise invalid("guided.json_schema is not valid JSON") from None
    if kind in ("regex", "ebnf_grammar") and value:
        return kind, str(value)
    if kind == "choice":
        if not value.choices:
            raise invalid("guided.choice has no choices")
        return kind, list(value.choices)
    if kind == "json_object":
        return kind, True
    if kind == "structural_tag":
        raise unsupported("guided decoding by structural_tag is not supported by this engine")
    raise invalid(f"guided.{kind} is empty")

"""A foreign API's generation options → the parts of a ``GenerateRequest``, and back (pure).

Shared by the planes that translate another protocol onto OpenEngine — the Dynamo worker
plane (``sidecar.dynamo.mapping``) and the OpenAI front (``sidecar.north.openai``) — so one
option means one thing whichever way it came in. The option names are the ones both APIs
use (vLLM's spelling: ``temperature``, ``top_k``, ``stop``, ``include_stop_str_in_output``,
``guided_decoding``'s ``json`` / ``regex`` / ``choice`` / ``grammar`` / ``structural_tag``).

Every function raises :class:`~sidecar.core.errors.Rejection` (``INVALID_ARGUMENT``) for a
malformed value, naming it with the caller's ``prefix`` (``sampling_options.`` for Dynamo,
nothing for OpenAI); whether the engine offers a feature is admission's question, not
theirs. Nothing here does I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping

from sidecar.core.card import MultimodalCard, WorkerCard
from sidecar.core.errors import invalid_argument
from sidecar.core.metadata import TRACEPARENT, TRACESTATE
from sidecar.json_types import JSONObject
from sidecar.openengine import pb

__all__ = [
    "CLIENT_CODES",
    "MAX_U32",
    "guided_decoding",
    "media_item",
    "model_multimodal",
    "response_options",
    "sampling_params",
    "source_uuid",
    "stopping_options",
    "token_id_list",
    "trace_metadata",
    "uint32",
    "usage_dict",
]

MAX_U32 = 2**32 - 1
#: Error codes that mean the client's request is wrong (another worker would refuse it too).
CLIENT_CODES = frozenset(
    {
        pb.ErrorCode.INVALID_ARGUMENT,
        pb.ErrorCode.MODEL_NOT_FOUND,
        pb.ErrorCode.UNSUPPORTED_FEATURE,
        pb.ErrorCode.ROLE_MISMATCH,
        pb.ErrorCode.DUPLICATE_REQUEST,
    }
)


def uint32(value: object, what: str) -> int | None:
    """``value`` as an unsigned 32-bit integer (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_U32:
        invalid_argument(f"{what} must be an unsigned 32-bit integer, got {value!r}")
    return value


def token_id_list(value: object, what: str) -> list[int]:
    """``value`` as a list of token ids (unsigned 32-bit integers)."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_U32 for t in value
    ):
        invalid_argument(f"{what} must be a list of token ids")
    return value


def _number(value: object, what: str) -> float | None:
    """``value`` as a float (an integer is taken too); ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        invalid_argument(f"{what} must be a number")
    return float(value)


def _integer(value: object, what: str) -> int | None:
    """``value`` as an integer of any size; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        invalid_argument(f"{what} must be an integer")
    return value


def _positive_top_k(top_k: int | None) -> int | None:
    """A ``top_k`` above 0 (capped to the field's int32); 0 or below: unset."""
    return min(top_k, 2**31 - 1) if top_k is not None and top_k > 0 else None


def _seed(seed: int | None) -> int | None:
    """A seed as the field's uint64 (modulo 2**64)."""
    return seed & (2**64 - 1) if seed is not None else None


def sampling_params(opts: Mapping[str, object], prefix: str = "") -> pb.SamplingParams | None:
    """``temperature``, ``top_p``, ``min_p``, the penalties, ``top_k`` (≤ 0: unset), ``seed``
    (taken modulo 2**64) and ``n`` (→ ``num_sequences``); ``None`` when none is set."""

    def number(name: str) -> float | None:
        return _number(opts.get(name), prefix + name)

    def integer(name: str) -> int | None:
        return _integer(opts.get(name), prefix + name)

    # checked in this order: the first malformed option is the one named
    params = pb.SamplingParams(
        temperature=number("temperature"),
        top_p=number("top_p"),
        min_p=number("min_p"),
        frequency_penalty=number("frequency_penalty"),
        presence_penalty=number("presence_penalty"),
        repetition_penalty=number("repetition_penalty"),
        top_k=_positive_top_k(integer("top_k")),
        seed=_seed(integer("seed")),
        num_sequences=uint32(opts.get("n"), prefix + "n"),
    )
    return params if params != pb.SamplingParams() else None


def _text(value: object) -> str:
    """A guide given as an object (a JSON schema, a structural tag) or as its JSON text."""
    return value if isinstance(value, str) else json.dumps(value)


def guided_decoding(g: Mapping[str, object]) -> pb.GuidedDecoding | None:
    """One guide of ``json`` (a schema, object or text), ``json_object`` (true), ``regex``,
    ``choice``, ``grammar`` (EBNF) or ``structural_tag``, with ``backend``; ``None``: none."""
    backend = g.get("backend") or ""
    if not isinstance(backend, str):
        invalid_argument("guided decoding backend must be a string")
    if g.get("json") is not None:
        return pb.GuidedDecoding(json_schema=_text(g["json"]), backend=backend)
    if g.get("json_object"):
        return pb.GuidedDecoding(json_object=pb.JsonObjectConstraint(), backend=backend)
    if g.get("regex") is not None:
        return pb.GuidedDecoding(regex=str(g["regex"]), backend=backend)
    if g.get("choice") is not None:
        choices = g["choice"]
        if not isinstance(choices, list):
            invalid_argument("guided decoding choice must be a list of strings")
        return pb.GuidedDecoding(
            choice=pb.ChoiceConstraint(choices=[str(c) for c in choices]), backend=backend
        )
    if g.get("grammar") is not None:
        return pb.GuidedDecoding(ebnf_grammar=str(g["grammar"]), backend=backend)
    if g.get("structural_tag") is not None:
        return pb.GuidedDecoding(structural_tag=_text(g["structural_tag"]), backend=backend)
    return None


def stopping_options(
    stop: Mapping[str, object],
    *,
    include_stop: bool = False,
    eos: frozenset[int] = frozenset(),
    prefix: str = "",
) -> pb.StoppingOptions | None:
    """``max_tokens``, ``min_tokens`` (0: unset), ``ignore_eos``, ``stop`` (a string or strings
    → ``stop_text``), ``stop_token_ids`` (and Dynamo's ``_hidden`` / ``_visible`` lists; ids in
    ``eos`` are left to the engine's own EOS rule), ``include_stop`` → ``include_stop_in_output``."""
    conditions: list[pb.StopCondition] = []
    texts = stop.get("stop") or []
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list):
        invalid_argument(f"{prefix}stop must be a string or a list of strings")
    for text in texts:
        if not isinstance(text, str):
            invalid_argument(f"{prefix}stop must be strings")
        conditions.append(pb.StopCondition(stop_text=text))
    seen: set[int] = set()
    for key in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        for tid in token_id_list(stop.get(key) or [], f"{prefix}{key}"):
            if tid not in eos and tid not in seen:
                seen.add(tid)
                conditions.append(pb.StopCondition(stop_token_id=tid))
    ignore_eos = stop.get("ignore_eos")
    options = pb.StoppingOptions(
        max_tokens=uint32(stop.get("max_tokens"), f"{prefix}max_tokens"),
        min_tokens=uint32(stop.get("min_tokens"), f"{prefix}min_tokens") or None,
        ignore_eos=bool(ignore_eos) if ignore_eos is not None else None,
        include_stop_in_output=True if include_stop else None,
        conditions=conditions,
    )
    return options if options != pb.StoppingOptions() else None


def _logprob_count(value: object, what: str) -> int | None:
    """``None`` / ``False``: not asked; ``True``: asked, no candidates; else the candidates."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    n = uint32(value, what)
    assert n is not None
    return n


def _candidates(count: int | None) -> pb.CandidateTokenSelection | None:
    return pb.CandidateTokenSelection(top_n=count) if count else None


def response_options(logprobs: object = None, prompt_logprobs: object = None) -> pb.ResponseOptions | None:
    """Output (and prompt) logprobs: a count asks for them with that many ``top_n`` candidates
    (0 or ``True``: the chosen token's only); ``None`` when neither is asked."""
    k = _logprob_count(logprobs, "logprobs")
    pk = _logprob_count(prompt_logprobs, "prompt_logprobs")
    if k is None and pk is None:
        return None
    return pb.ResponseOptions(
        return_output_logprobs=True if k is not None else None,
        output_candidates=_candidates(k),
        return_prompt_logprobs=True if pk is not None else None,
        prompt_candidates=_candidates(pk),
    )


def usage_dict(u: pb.Usage) -> JSONObject:
    """OpenAI's ``usage`` object (Dynamo's ``completion_usage`` is the same)."""
    out: JSONObject = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if u.cached_prompt_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return out


def model_multimodal(card: WorkerCard, model: str) -> MultimodalCard | None:
    """The multimodal capabilities of the model a request names (``None``: unknown or none)."""
    if model:
        resolved = card.resolve(model)
        return resolved.model.multimodal if resolved is not None else None
    return card.models[0].multimodal if len(card.models) == 1 else None


def source_uuid(url: str) -> str:
    """A media item's uuid when nothing else names it: stable across repeats of the source."""
    return "sha256:" + hashlib.sha256(url.encode()).hexdigest()


def _data_uri_bytes(uri: str, name: str) -> tuple[bytes, str]:
    head, sep, payload = uri[len("data:") :].partition(",")
    params = head.split(";")
    if not sep or "base64" not in params[1:]:
        invalid_argument(f"{name}: only base64 data URIs can be passed as raw bytes")
    try:
        return base64.b64decode(payload, validate=True), params[0]
    except (binascii.Error, ValueError):
        invalid_argument(f"{name}: the data URI is not valid base64")


def media_item(
    modality: pb.Modality, name: str, url: str, uuid: str, mm: MultimodalCard | None
) -> pb.MediaItem:
    """One media item: a ``data:`` URI as ``data_uri`` when the engine advertises it, else as
    ``raw_bytes`` (base64-decoded, ``mime_type`` from the URI) when it advertises that;
    anything else as ``url`` (the sidecar never fetches it). ``name`` (``image``) is for
    messages. A source the engine does not advertise is left for admission to refuse."""
    if not url.startswith("data:"):
        return pb.MediaItem(modality=modality, url=url, uuid=uuid)
    if mm is not None and "data_uri" not in mm.source_types and "raw_bytes" in mm.source_types:
        raw, mime = _data_uri_bytes(url, name)
        return pb.MediaItem(modality=modality, raw_bytes=raw, mime_type=mime, uuid=uuid)
    return pb.MediaItem(modality=modality, data_uri=url, uuid=uuid)


def trace_metadata(headers: Mapping[str, str] | None) -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of ``headers`` (keys in lower case), as request metadata
    (admission checks their syntax)."""
    out: dict[str, str] = {}
    for key in (TRACEPARENT, TRACESTATE):
        value = (headers or {}).get(key)
        if value:
            out[key] = value
    return out

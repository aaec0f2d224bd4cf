"""Admission: check a ``GenerateRequest`` against the worker card before the engine sees it.

:func:`admit` returns :class:`Admitted` or raises :class:`~sidecar.core.errors.Rejection`;
a rejected request must not reach the engine. Checks run in this order (first failure
wins): metadata, model, role, LoRA, input, sampling, stopping, logprobs, guided
decoding, KV options, priority, media.

Codes:

- ``MODEL_NOT_FOUND``: no served model, alias or loaded adapter by that name; an
  adapter that is not loaded.
- ``ROLE_MISMATCH``: the request is shaped for another role: an unknown engine role;
  ``kv.session`` on an aggregated worker; none on a decode worker; none on a
  client-bootstrap (SGLang-style) prefill worker; one on a context-first prefill
  worker (it creates the session).
- ``UNSUPPORTED_FEATURE``: a feature the card does not advertise, or a worker limit it
  exceeds (``num_sequences`` > ``max_num_sequences``, ``top_n`` > ``max_top_n``): another
  worker might take the same request.
- ``INVALID_ARGUMENT``: malformed values (metadata, empty inputs, non-finite or
  out-of-range sampling values, ``num_sequences`` 0, ``min_tokens`` > ``max_tokens``,
  empty stop text, empty guides, invalid JSON schema, media without modality or
  source, unknown ``media_options`` keys, malformed KV envelopes — see ``handoff.py``)
  and requests beyond the model's limits (``max_tokens`` > ``max_output_tokens``, more
  prompt token ids than ``max_context_length``), as engines answer them.

Unknown (absent) capabilities — the policy:

- **Fail closed** for features an engine could silently ignore, which would change
  the result without an error: ``num_sequences`` > 1, prompt/output logprobs and their
  candidate modes, guided decoding, ``openengine-priority``, ``include_stop_in_output``
  true, ``cache_salt``, ``bypass_prefix_cache`` true, LoRA, ``media_options`` on a
  model without ``multimodal_capabilities``. Advertised lists are authoritative: a mode,
  modality or source type not listed is unsupported, even when ``supported`` is true.
- **Pass to the engine** where the contract makes the engine reject loudly: text vs
  token-id input (rejected only when explicitly ``false``), ``media_options`` when
  ``supports_per_request_media_options`` is unreported (only explicit ``false`` rejects,
  the schema's api.md), media on a revision-1 engine that reports ``supports_multimodal = true``
  but no ``multimodal_capabilities``, and limits that are unreported.
- Explicit defaults are always fine: ``include_stop_in_output = false``,
  ``bypass_prefix_cache = false``, ``num_sequences = 1``, ``return_*_logprobs = false``.

Rewrites (``Admitted.request`` is then a copy; the input is never mutated): an empty
``model`` on a single-model worker becomes its served name; a loaded adapter's name
used as ``model`` becomes ``model = <base served name>``, ``lora_name = <adapter>``.
Everything else, ``kv.session`` included, is forwarded unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import betterproto2
import msgspec

from sidecar.core.card import (
    ROLE_AGGREGATED,
    ROLE_DECODE,
    ROLE_PREFILL,
    GenerationCard,
    LogprobCard,
    LoraCard,
    ModelCard,
    WorkerCard,
    enum_name,
)
from sidecar.core.errors import invalid_argument, model_not_found, role_mismatch, unsupported
from sidecar.core.handoff import check_decode_session, check_prefill_session
from sidecar.core.metadata import NormalizedMetadata, normalize_metadata
from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import set_unknown_fields, unknown_fields
from sidecar.quoting import quote

__all__ = ["MEDIA_OPTION_KEYS", "Admitted", "admit"]

#: ``media_options`` is keyed by modality name (the schema's api.md).
MEDIA_OPTION_KEYS = ("image", "video", "audio")


@dataclass(frozen=True)
class Admitted:
    """An admitted request: what to send, and what it resolved to."""

    #: The request to send (the input object unless a rewrite applied; see module doc).
    request: pb.GenerateRequest
    model: ModelCard
    lora: LoraCard | None
    metadata: NormalizedMetadata
    #: Outputs the request asks for (``num_sequences``, default 1).
    num_sequences: int

    @property
    def metadata_pairs(self) -> list[tuple[str, str]]:
        return list(self.metadata.pairs)


def _gen(model: ModelCard) -> GenerationCard | None:
    return model.generation


def _resolve(
    request: pb.GenerateRequest, card: WorkerCard
) -> tuple[ModelCard, LoraCard | None, dict[str, str]]:
    rewrite: dict[str, str] = {}
    name = request.model
    if not name:
        if len(card.models) != 1:
            invalid_argument("request.model is required: this worker serves several models")
        model = card.models[0]
        rewrite["model"] = model.served_model_name
        return model, None, rewrite
    resolved = card.resolve(name)
    if resolved is None:
        served = ", ".join(card.served_model_names) or "none"
        model_not_found(f"model {quote(name)} is not served by this worker (serves: {served})")
    lora = resolved.lora
    if lora is not None:
        if request.lora_name and request.lora_name != lora.lora_name:
            invalid_argument(
                f"model {quote(name)} names adapter {quote(lora.lora_name)} but lora_name is {quote(request.lora_name)}"
            )
        rewrite["model"] = resolved.model.served_model_name
        rewrite["lora_name"] = lora.lora_name
    return resolved.model, lora, rewrite


def _check_lora(request: pb.GenerateRequest, model: ModelCard, card: WorkerCard) -> LoraCard | None:
    name = request.lora_name
    if not name:
        return None
    if model.supports_lora is not True:
        how = "does not support" if model.supports_lora is False else "does not advertise"
        unsupported(f"model {model.served_model_name!r} {how} LoRA adapters")
    if card.lora_adapters is None:
        unsupported("this worker's loaded LoRA adapters are unknown (ListLoras unavailable)")
    lora = card.lora_named(name)
    if lora is None or lora.base_model != model.served_model_name:
        model_not_found(
            f"LoRA adapter {quote(name)} is not loaded for model {quote(model.served_model_name)}"
        )
    return lora


def _check_role(request: pb.GenerateRequest, card: WorkerCard, meta: NormalizedMetadata) -> None:
    session = request.kv.session if request.kv is not None else None
    role = card.role
    if role == ROLE_AGGREGATED:
        if session is not None:
            role_mismatch("this aggregated worker takes no kv.session (no handoff, no bootstrap)")
    elif role == ROLE_DECODE:
        if session is None:
            role_mismatch("this decode worker needs kv.session (the prefill handoff)")
        check_decode_session(session, card, target_dp_rank=meta.target_dp_rank)
    elif role == ROLE_PREFILL:
        kv = card.kv_connector
        if kv is not None and kv.uses_client_bootstrap:
            if session is None:
                role_mismatch(
                    "this prefill worker uses client bootstrap: the request needs kv.session.bootstrap"
                )
            check_prefill_session(session, card, target_dp_rank=meta.target_dp_rank)
        elif session is not None:
            role_mismatch(
                "this context-first prefill worker creates the KV session; the request must not carry one"
            )
    else:
        role_mismatch(f"this worker's engine role is {role}: it cannot take generation requests")


def _check_input(request: pb.GenerateRequest, model: ModelCard) -> None:
    kind, value = betterproto2.which_one_of(request, "input")
    if kind == "prompt":
        if model.supports_text_input is False:
            unsupported(f"model {model.served_model_name!r} does not accept text prompts (send token_ids)")
    elif kind == "token_ids":
        assert isinstance(value, pb.TokenIds)
        if not value.ids:
            invalid_argument("token_ids is empty")
        if model.supports_token_ids_input is False:
            unsupported(f"model {model.served_model_name!r} does not accept token_ids input (send a prompt)")
        limit = model.max_context_length
        if limit is not None and len(value.ids) > limit:
            invalid_argument(f"prompt has {len(value.ids)} tokens, above max_context_length {limit}")
    else:
        invalid_argument("request has no input (prompt or token_ids)")


def _finite(name: str, value: float | None, lo: float | None = None, hi: float | None = None) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        invalid_argument(f"sampling.{name} must be a finite number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        invalid_argument(f"sampling.{name} {value} is out of range")


def _check_sampling(request: pb.GenerateRequest, model: ModelCard) -> int:
    s = request.sampling
    if s is None:
        return 1
    _finite("temperature", s.temperature, lo=0.0)
    _finite("top_p", s.top_p, lo=0.0, hi=1.0)
    _finite("min_p", s.min_p, lo=0.0, hi=1.0)
    _finite("frequency_penalty", s.frequency_penalty)
    _finite("presence_penalty", s.presence_penalty)
    _finite("repetition_penalty", s.repetition_penalty)
    n = s.num_sequences
    if n is None:
        return 1
    if n == 0:
        invalid_argument("sampling.num_sequences must be greater than zero when present")
    if n > 1:
        gen = _gen(model)
        limit = gen.max_num_sequences if gen is not None else None
        if limit is None:
            unsupported(
                f"num_sequences {n}: model {model.served_model_name!r} does not advertise max_num_sequences"
            )
        if n > limit:
            unsupported(f"num_sequences {n} is above this worker's max_num_sequences {limit}")
    return int(n)


def _check_stopping(request: pb.GenerateRequest, model: ModelCard) -> None:
    st = request.stopping
    if st is None:
        return
    limit = model.max_output_tokens
    if st.max_tokens is not None and limit is not None and st.max_tokens > limit:
        invalid_argument(f"stopping.max_tokens {st.max_tokens} is above max_output_tokens {limit}")
    if st.min_tokens is not None and st.max_tokens is not None and st.min_tokens > st.max_tokens:
        invalid_argument(f"stopping.min_tokens {st.min_tokens} is above max_tokens {st.max_tokens}")
    for i, cond in enumerate(st.conditions):
        kind, value = betterproto2.which_one_of(cond, "condition")
        if not kind or (kind == "stop_text" and not value):
            invalid_argument(f"stopping.conditions[{i}] is empty")
    if st.include_stop_in_output is True:
        gen = _gen(model)
        if gen is None or gen.supports_stop_in_output is not True:
            unsupported(f"model {model.served_model_name!r} does not advertise include_stop_in_output")


def _check_logprobs(
    which: str,
    wanted: bool | None,
    cand: pb.CandidateTokenSelection | None,
    cap: LogprobCard | None,
    model: str,
) -> None:
    kind, value = ("", None) if cand is None else betterproto2.which_one_of(cand, "selection")
    if wanted is not True and not kind:
        return
    if cap is None or cap.supported is not True:
        unsupported(f"model {model!r} does not advertise {which} logprobs")
    if not kind:
        return
    if kind not in cap.candidate_selection_modes:
        offered = ", ".join(cap.candidate_selection_modes) or "none"
        unsupported(f"{which} logprob candidates by {kind} are not advertised (modes: {offered})")
    if kind == "top_n":
        assert isinstance(value, int)
        if cap.max_top_n is not None and value > cap.max_top_n:
            unsupported(f"{which} candidates top_n {value} is above this worker's max_top_n {cap.max_top_n}")
    elif kind == "token_ids":
        assert isinstance(value, pb.TokenIds)
        if not value.ids:
            invalid_argument(f"{which} candidate token_ids is empty")


def _check_response(request: pb.GenerateRequest, model: ModelCard) -> None:
    r = request.response
    if r is None:
        return
    gen = _gen(model)
    name = model.served_model_name
    _check_logprobs(
        "prompt", r.return_prompt_logprobs, r.prompt_candidates, gen.prompt_logprobs if gen else None, name
    )
    _check_logprobs(
        "output", r.return_output_logprobs, r.output_candidates, gen.output_logprobs if gen else None, name
    )


def _check_guided(request: pb.GenerateRequest, model: ModelCard) -> None:
    g = request.guided
    if g is None:
        return
    kind, value = betterproto2.which_one_of(g, "guide")
    if not kind:
        if g.backend:
            invalid_argument("guided.backend is set without a guide")
        return
    gen = _gen(model)
    cap = gen.guided_decoding if gen is not None else None
    if cap is None or cap.supported is not True:
        unsupported(f"model {model.served_model_name!r} does not advertise guided decoding")
    if kind not in cap.modes:
        offered = ", ".join(cap.modes) or "none"
        unsupported(f"guided decoding by {kind} is not advertised (modes: {offered})")
    if kind == "choice":
        assert isinstance(value, pb.ChoiceConstraint)
        if not value.choices:
            invalid_argument("guided.choice has no choices")
    elif kind in ("json_schema", "regex", "ebnf_grammar", "structural_tag"):
        assert isinstance(value, str)
        if not value:
            invalid_argument(f"guided.{kind} is empty")
        if kind == "json_schema":
            try:
                msgspec.json.decode(value)
            except msgspec.DecodeError:
                invalid_argument("guided.json_schema is not valid JSON")


def _check_kv_options(request: pb.GenerateRequest, model: ModelCard) -> None:
    kv = request.kv
    if kv is None:
        return
    gen = _gen(model)
    if kv.cache_salt is not None:
        if not kv.cache_salt:
            invalid_argument("kv.cache_salt is empty (omit it for no salt)")
        if gen is None or gen.supports_cache_salt is not True:
            unsupported(f"model {model.served_model_name!r} does not advertise cache_salt")
    if kv.bypass_prefix_cache is True and (gen is None or gen.supports_prefix_cache_bypass is not True):
        unsupported(f"model {model.served_model_name!r} does not advertise bypass_prefix_cache")


def _check_priority(meta: NormalizedMetadata, model: ModelCard) -> None:
    if meta.priority is None:
        return
    gen = _gen(model)
    if gen is None or gen.supports_priority is not True:
        unsupported(f"model {model.served_model_name!r} does not advertise openengine-priority")


def _role_modalities(model: ModelCard, role: str) -> list[str]:
    mm = model.multimodal
    assert mm is not None
    return mm.aggregate_modalities if role == ROLE_AGGREGATED else mm.prefill_decode_modalities


def _check_media(request: pb.GenerateRequest, model: ModelCard, role: str) -> None:
    name = model.served_model_name
    mm = model.multimodal
    if request.media:
        if mm is None and model.supports_multimodal is not True:
            kinds = dict.fromkeys(enum_name(pb.Modality, m.modality) or "unspecified" for m in request.media)
            unsupported(f"model {name!r} does not accept media ({', '.join(kinds)})")
        for i, item in enumerate(request.media):
            modality = enum_name(pb.Modality, item.modality)
            if modality is None:
                invalid_argument(f"media[{i}] has no modality")
            kind, value = betterproto2.which_one_of(item, "source")
            if not kind:
                invalid_argument(f"media[{i}] has no source (url, data_uri or raw_bytes)")
            if not value:
                invalid_argument(f"media[{i}].{kind} is empty")
            if kind == "data_uri" and not str(value).startswith("data:"):
                invalid_argument(f"media[{i}].data_uri does not start with 'data:'")
            if mm is None:
                continue  # revision-1 engine: supports_multimodal only; the engine validates
            accepted = _role_modalities(model, role)
            if modality not in accepted:
                path = "aggregated" if role == ROLE_AGGREGATED else "prefill/decode"
                unsupported(
                    f"media[{i}]: {modality} is not accepted on the {path} path of model {name!r} "
                    f"(accepted: {', '.join(accepted) or 'none'})"
                )
            if kind not in mm.source_types:
                unsupported(
                    f"media[{i}] ({modality}): source {kind} is not advertised "
                    f"(source types: {', '.join(mm.source_types) or 'none'})"
                )
    opts = request.media_options
    if opts is not None and opts.fields:
        for key, val in opts.fields.items():
            if key not in MEDIA_OPTION_KEYS:
                invalid_argument(f"media_options key {quote(key)} is not a modality (image, video, audio)")
            if betterproto2.which_one_of(val, "kind")[0] != "struct_value":
                invalid_argument(f"media_options.{key} must be an object")
        if mm is None:
            unsupported(f"model {name!r} does not advertise multimodal capabilities for media_options")
        if mm.supports_per_request_media_options is False:
            unsupported(f"model {name!r} does not accept per-request media_options")
        accepted = _role_modalities(model, role)
        for key in opts.fields:
            if key not in accepted:
                unsupported(f"media_options.{key}: {key} is not accepted by model {name!r} for this role")


def admit(
    request: pb.GenerateRequest,
    metadata: Mapping[str, str] | Iterable[tuple[str, str]] | None,
    card: WorkerCard,
    *,
    allow_application_keys: bool = True,
) -> Admitted:
    """Admit ``request`` on the worker described by ``card`` or raise ``Rejection``.

    Pure and synchronous: no I/O, the input request is not mutated.
    """
    meta = normalize_metadata(metadata, dp_ranks=card.dp_ranks, allow_application_keys=allow_application_keys)
    model, lora, rewrite = _resolve(request, card)
    _check_role(request, card, meta)
    if lora is None:
        lora = _check_lora(request, model, card)
    _check_input(request, model)
    n = _check_sampling(request, model)
    _check_stopping(request, model)
    _check_response(request, model)
    _check_guided(request, model)
    _check_kv_options(request, model)
    _check_priority(meta, model)
    _check_media(request, model, card.role)
    out = request
    if rewrite:
        out = dataclasses.replace(
            request,
            model=rewrite.get("model", request.model),
            lora_name=rewrite.get("lora_name", request.lora_name),
        )
        # replace() rebuilds the message; keep fields this build does not know (newer revisions).
        unknown = unknown_fields(request)
        if unknown:
            set_unknown_fields(out, unknown)
    return Admitted(request=out, model=model, lora=lora, metadata=meta, num_sequences=n)

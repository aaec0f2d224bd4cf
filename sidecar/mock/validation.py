"""Synchronous checks of a Generate request before acceptance (I/O-free).

Everything here runs before the engine commits to a request, so every failure is a
:class:`RequestRefused`: a non-OK gRPC status and no events (schema "Standard errors").
Status choices: malformed input, metadata or options → ``INVALID_ARGUMENT``; a feature
this flavour does not advertise → ``UNIMPLEMENTED``; role/request mismatch and LoRA
disabled → ``FAILED_PRECONDITION``; unknown model or adapter → ``NOT_FOUND``.
Admission-time statuses (overload, draining, duplicates) are decided by the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import betterproto2

from sidecar.mock import generator as gen
from sidecar.mock import schemas
from sidecar.mock import tokenizer as tok
from sidecar.mock.config import EngineConfig
from sidecar.mock.faults import FaultSpecError, StreamFaults, parse_stream_faults
from sidecar.mock.flavors import (
    MEDIA_PLACEHOLDER,
    MEDIA_TOKENS,
    MODALITY_NAMES,
    FlavorSpec,
    accepted_modalities,
)
from sidecar.mock.kvcache import MediaSpan
from sidecar.mock.lora import Adapter
from sidecar.openengine import pb

KEY_ROUTING = "openengine-routing-key"
KEY_TARGET_RANK = "openengine-target-dp-rank"
KEY_PRIORITY = "openengine-priority"
TRACE_KEYS = ("traceparent", "tracestate")
_UINT32 = re.compile(r"[0-9]{1,10}")
_INT32 = re.compile(r"-?[0-9]{1,10}")
_PLACEHOLDER_MODALITY = {v: k for k, v in MEDIA_PLACEHOLDER.items()}
_DATA_URI = re.compile(r"data:[\w.+-]+/[\w.+-]+(;[\w=.+-]+)*;base64,[A-Za-z0-9+/=\s]+", re.ASCII)


class RequestRefused(Exception):
    """Refuse the request before acceptance with gRPC status ``status`` (a status name)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class RoleMismatch(RequestRefused):
    """The request does not fit the engine's role (``FAILED_PRECONDITION``)."""

    def __init__(self, message: str) -> None:
        super().__init__("FAILED_PRECONDITION", message)


def _invalid(message: str) -> RequestRefused:
    return RequestRefused("INVALID_ARGUMENT", message)


def _unsupported(message: str) -> RequestRefused:
    return RequestRefused("UNIMPLEMENTED", message)


@dataclass(frozen=True)
class RoutingMetadata:
    """The OpenEngine metadata of one call, parsed."""

    routing_key: str | None = None
    target_rank: int | None = None
    priority: int = 0
    priority_given: bool = False
    forwarded: dict[str, str] = field(default_factory=dict)


def parse_metadata(
    pairs: Sequence[tuple[str, str | bytes]],
    dp_size: int,
    *,
    lenient: bool = False,
    allow_repeats: bool = False,
) -> RoutingMetadata:
    """Check the OpenEngine keys (the schema's api.md, "gRPC request metadata").

    At most one value per ``openengine-*`` key; numbers are base-10 ``uint32`` / ``int32``;
    a target rank must name one of this server's ranks. Unknown keys are ignored.
    Faults: ``lenient`` ignores malformed numbers, ``allow_repeats`` keeps the last value.
    """
    seen: dict[str, str] = {}
    forwarded: dict[str, str] = {}
    for key, raw in pairs:
        key = key.lower()
        if not (key.startswith("openengine-") or key in TRACE_KEYS):
            continue
        value = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        if key in seen and not allow_repeats:
            raise _invalid(f"metadata key {key!r} sent more than once")
        seen[key] = value
        forwarded[key] = value
    routing = seen.get(KEY_ROUTING)
    if routing is not None and (not routing or not routing.isascii()):
        raise _invalid(f"{KEY_ROUTING} must be a non-empty ASCII value")
    target = None
    if KEY_TARGET_RANK in seen:
        text = seen[KEY_TARGET_RANK]
        if not _UINT32.fullmatch(text) or int(text) > 0xFFFFFFFF:
            if not lenient:
                raise _invalid(f"{KEY_TARGET_RANK} must be a base-10 uint32, got {text!r}")
            text = ""
        target = int(text) if text else None
        if target is not None and target >= dp_size:
            raise _invalid(f"{KEY_TARGET_RANK} {target} is not a rank of this server (dp size {dp_size})")
    priority = 0
    if KEY_PRIORITY in seen:
        text = seen[KEY_PRIORITY]
        if not _INT32.fullmatch(text) or not -(2**31) <= int(text) < 2**31:
            if not lenient:
                raise _invalid(f"{KEY_PRIORITY} must be a base-10 int32, got {text!r}")
        else:
            priority = int(text)
    return RoutingMetadata(routing, target, priority, KEY_PRIORITY in seen, forwarded)


@dataclass(frozen=True)
class PromptLogprobs:
    start: int
    spec: gen.CandidateSpec | None


@dataclass
class RequestPlan:
    """A validated request with every default resolved."""

    request: pb.GenerateRequest
    model: str
    prompt_ids: list[int]
    media: tuple[MediaSpan, ...]
    num_outputs: int
    rules: gen.StopRules
    greedy: bool
    seed: int
    prompt_logprobs: PromptLogprobs | None
    output_logprobs: bool
    output_candidates: gen.CandidateSpec | None
    forced: tuple[int, ...]
    lora: Adapter | None
    metadata: RoutingMetadata
    kv_session: pb.KvSessionRef | None
    bypass_prefix_cache: bool
    cache_salt: str
    stream_faults: StreamFaults
    token_delay_ms: float | None
    stamp_tokens: bool = False  # benchmark: token text = engine send time (``extra.mock.stamp``)


@dataclass(frozen=True)
class EngineView:
    """What validation needs to know about the engine."""

    config: EngineConfig
    flavor: FlavorSpec
    model: str
    model_names: frozenset[str]
    loras: Mapping[str, Adapter]


def _which(msg: Any, group: str) -> tuple[str, Any]:
    name, value = betterproto2.which_one_of(msg, group)
    return name or "", value


def _candidates(sel: pb.CandidateTokenSelection | None, caps: Any, what: str) -> gen.CandidateSpec | None:
    if sel is None:
        return None
    name, value = _which(sel, "selection")
    if not name:
        return None
    if name == "top_n":
        if pb.CandidateTokenSelectionMode.TOP_N not in caps.modes:
            raise _unsupported(f"{what}: top_n candidates are not supported")
        if value > caps.max_top_n:
            raise _invalid(f"{what}: top_n {value} exceeds max_top_n {caps.max_top_n}")
        return gen.CandidateSpec(top_n=value)
    if name == "token_ids":
        if pb.CandidateTokenSelectionMode.TOKEN_IDS not in caps.modes:
            raise _unsupported(f"{what}: token_ids candidates are not supported")
        ids = tuple(value.ids)
        if any(i >= tok.VOCAB_SIZE for i in ids):
            raise _invalid(f"{what}: candidate token id outside the vocabulary")
        return gen.CandidateSpec(token_ids=ids)
    raise _unsupported(f"{what}: 'all' candidates are not supported")


def _media(
    request: pb.GenerateRequest, prompt: list[int], view: EngineView
) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """Validate media items and expand their placeholders (module doc of flavors)."""
    spec, role = view.flavor, view.config.role
    items = list(request.media)
    allowed = accepted_modalities(view.config)
    hashes: list[str] = []
    for i, item in enumerate(items):
        if item.modality == pb.Modality.UNSPECIFIED or item.modality not in MEDIA_TOKENS:
            raise _invalid(f"media[{i}]: modality is required")
        if item.modality not in allowed:
            raise _unsupported(
                f"media[{i}]: {MODALITY_NAMES[item.modality]} is not accepted by a {role} {spec.engine_name} engine"
            )
        src, value = _which(item, "source")
        kind = {
            "url": pb.MediaSourceType.URL,
            "data_uri": pb.MediaSourceType.DATA_URI,
            "raw_bytes": pb.MediaSourceType.RAW_BYTES,
        }.get(src)
        if kind is None:
            raise _invalid(f"media[{i}]: exactly one source (url, data_uri, raw_bytes) is required")
        if kind not in spec.source_types:
            raise _unsupported(f"media[{i}]: source type {src} is not supported")
        if src == "url" and not re.match(r"https?://[^\s/]+", value):
            raise _invalid(f"media[{i}]: url must be http(s)://, got {value[:40]!r}")
        if src == "data_uri" and not _DATA_URI.fullmatch(value):
            raise _invalid(f"media[{i}]: malformed data URI")
        if src == "raw_bytes" and not value:
            raise _invalid(f"media[{i}]: raw_bytes is empty")
        content = value if isinstance(value, bytes) else value.encode()
        hashes.append(
            item.uuid or f"{gen.hash_text(content.hex() if isinstance(value, bytes) else value):016x}"
        )
    placeholders = [t for t in prompt if t in _PLACEHOLDER_MODALITY]
    if not items:
        if placeholders:
            raise _invalid(f"prompt has {len(placeholders)} media placeholder(s) but no media items")
        return prompt, ()
    if not placeholders:
        # No placeholders: one per item is inserted after BOS, in media order.
        head = 1 if prompt and prompt[0] == tok.BOS_ID else 0
        prompt = prompt[:head] + [MEDIA_PLACEHOLDER[m.modality] for m in items] + prompt[head:]
        placeholders = [MEDIA_PLACEHOLDER[m.modality] for m in items]
    modalities = [_PLACEHOLDER_MODALITY[t] for t in placeholders]
    if modalities != [m.modality for m in items]:
        raise _invalid(
            "media placeholders do not match media items in order: prompt has "
            f"{[MODALITY_NAMES[m] for m in modalities]}, items are {[MODALITY_NAMES[m.modality] for m in items]}"
        )
    expanded: list[int] = []
    spans: list[MediaSpan] = []
    for t in prompt:
        m = _PLACEHOLDER_MODALITY.get(t)
        if m is None:
            expanded.append(t)
            continue
        spans.append(MediaSpan(hashes[len(spans)], len(expanded), MEDIA_TOKENS[m]))
        expanded.extend([t] * MEDIA_TOKENS[m])
    return expanded, tuple(spans)


def _media_options(request: pb.GenerateRequest, view: EngineView) -> None:
    opts = request.media_options.to_dict() if request.media_options is not None else {}
    if not opts:
        return
    spec = view.flavor
    if not spec.per_request_media_options or view.config.text_only:
        raise _unsupported("per-request media_options are not supported by this engine")
    allowed = {MODALITY_NAMES[m] for m in accepted_modalities(view.config)}
    for key, value in opts.items():
        if key not in allowed:
            raise _invalid(f"media_options key {key!r} is not an accepted modality ({sorted(allowed)})")
        if not isinstance(value, dict):
            raise _invalid(f"media_options.{key} must be an object")
        unknown = set(value) - spec.media_option_keys.get(key, frozenset())
        if unknown:
            raise _invalid(f"media_options.{key}: unsupported option(s) {sorted(unknown)}")


def _guided(request: pb.GenerateRequest, view: EngineView, seed: int) -> tuple[int, ...]:
    g = request.guided
    if g is None:
        return ()
    name, value = _which(g, "guide")
    if not name:
        if g.backend:
            raise _invalid("guided.backend given without a guide")
        return ()
    mode = pb.GuidedDecodingMode[name.upper()]
    if mode not in view.flavor.guided_modes:
        raise _unsupported(f"guided decoding mode {name} is not supported")
    if g.backend and g.backend not in view.flavor.guided_backends:
        raise _invalid(f"guided backend {g.backend!r} is not one of {list(view.flavor.guided_backends)}")
    if name == "json_schema":
        try:
            json.loads(value)
        except ValueError as err:
            raise _invalid(f"guided.json_schema is not JSON: {err}") from None
    elif name == "regex":
        try:
            re.compile(value)
        except re.error as err:
            raise _invalid(f"guided.regex does not compile: {err}") from None
    elif name == "choice":
        if not value.choices or any(not c for c in value.choices):
            raise _invalid("guided.choice needs non-empty choices")
        return gen.choice_tokens(value.choices, seed)
    elif name == "json_object":
        return tuple(tok.encode("{}"))
    elif not value:
        raise _invalid(f"guided.{name} is empty")
    return ()


def _session_checks(session: pb.KvSessionRef | None, view: EngineView, md: RoutingMetadata) -> None:
    spec, role = view.flavor, view.config.role
    if session is None:
        if role == "decode":
            raise RoleMismatch("a decode engine needs kv.session (role mismatch)")
        if role == "prefill" and spec.client_bootstrap:
            raise _invalid("a prefill request to this engine needs kv.session with a bootstrap")
        return
    if role == "aggregated":
        raise RoleMismatch("kv.session given to an aggregated engine (role mismatch)")
    if role == "prefill" and not spec.client_bootstrap:
        raise RoleMismatch(
            "kv.session given to a context-first prefill engine; decode requests carry sessions (role mismatch)"
        )
    if md.target_rank is not None and md.target_rank != session.dp_rank:
        raise _invalid(
            f"kv.session.dp_rank {session.dp_rank} disagrees with {KEY_TARGET_RANK} {md.target_rank}"
        )
    if session.handoff_profile and session.handoff_profile != spec.handoff_profile:
        raise _invalid(
            f"handoff_profile {session.handoff_profile!r}; this engine speaks {spec.handoff_profile!r}"
        )
    if session.transfer_backend and session.transfer_backend != spec.transfer_backend:
        raise _invalid(
            f"transfer_backend {session.transfer_backend!r}; this engine uses {spec.transfer_backend!r}"
        )
    if spec.client_bootstrap:
        b = session.bootstrap
        if b is None or b.endpoint is None or not b.endpoint.host or not b.endpoint.port:
            raise _invalid("kv.session.bootstrap with an endpoint and room is required")
    else:
        if not session.session_id:
            raise _invalid("kv.session.session_id is required")
        if not session.handoff_profile and schemas.has(view.config, "handoffProfile"):
            raise _invalid("kv.session.handoff_profile is required")


def _extra(request: pb.GenerateRequest) -> tuple[StreamFaults, float | None, bool]:
    extra = request.extra.to_dict() if request.extra is not None else {}
    mock = extra.get("mock")
    if mock is None:
        return StreamFaults(), None, False
    if not isinstance(mock, dict):
        raise _invalid("extra.mock must be an object")
    faults = mock.get("faults", [])
    if isinstance(faults, str):
        faults = [faults]
    try:
        sf = parse_stream_faults(str(f) for f in faults)
    except FaultSpecError as err:
        raise _invalid(f"extra.mock.faults: {err}") from None
    delay = mock.get("token_delay_ms")
    if delay is not None and (not isinstance(delay, int | float) or delay < 0):
        raise _invalid("extra.mock.token_delay_ms must be a non-negative number")
    stamp = mock.get("stamp", False)
    if not isinstance(stamp, bool):
        raise _invalid("extra.mock.stamp must be a boolean")
    return sf, (float(delay) if delay is not None else None), stamp


def validate(
    request: pb.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]], view: EngineView
) -> RequestPlan:
    """Check ``request`` against this engine; raises :class:`RequestRefused`.

    One check per field group, in this order (the first refusal wins): metadata, model and
    adapter, KV session, input (prompt, media, context), sampling, stopping, response
    options, KV options, guided decoding, ``extra.mock``.
    """
    cfg, spec = view.config, view.flavor
    md = parse_metadata(
        metadata,
        cfg.dp_size,
        lenient=cfg.faults.has("lenient-metadata"),
        allow_repeats=cfg.faults.has("repeated-metadata"),
    )
    lora = _check_model(request, view)
    kv = request.kv
    session = kv.session if kv is not None else None
    _session_checks(session, view, md)
    prompt, media = _check_input(request, view)
    s = request.sampling or pb.SamplingParams()
    n = _check_sampling(s, spec)
    seed = gen.mix(cfg.seed, gen.request_seed(prompt, s.seed, lora.name if lora else ""))
    rules = _check_stopping(request.stopping or pb.StoppingOptions(), cfg, spec, len(prompt))
    r = request.response or pb.ResponseOptions()
    prompt_lp, out_spec = _check_response(r, spec, len(prompt))
    salt, bypass = _check_kv_options(kv, spec)
    forced = _guided(request, view, seed)
    stream_faults, delay, stamp = _extra(request)
    return RequestPlan(
        request=request,
        model=request.model or view.model,
        prompt_ids=prompt,
        media=media,
        num_outputs=n,
        rules=rules,
        greedy=s.temperature is not None and s.temperature == 0,
        seed=seed,
        prompt_logprobs=prompt_lp,
        output_logprobs=bool(r.return_output_logprobs),
        output_candidates=out_spec,
        forced=forced,
        lora=lora,
        metadata=md,
        kv_session=session,
        bypass_prefix_cache=bypass,
        cache_salt=salt,
        stream_faults=stream_faults,
        token_delay_ms=delay,
        stamp_tokens=stamp,
    )


def _check_model(request: pb.GenerateRequest, view: EngineView) -> Adapter | None:
    """The model (a served name, or a loaded adapter's name) and ``lora_name``: the adapter, if any."""
    lora: Adapter | None = None
    model = request.model
    if model and model not in view.model_names:
        lora = view.loras.get(model)
        if lora is None:
            raise RequestRefused("NOT_FOUND", f"model {model!r} is not served here")
    if request.lora_name:
        if not view.config.enable_lora:
            raise RequestRefused("FAILED_PRECONDITION", "LoRA is disabled on this engine")
        lora = view.loras.get(request.lora_name)
        if lora is None:
            raise RequestRefused("NOT_FOUND", f"LoRA adapter {request.lora_name!r} is not loaded")
    return lora


def _check_input(request: pb.GenerateRequest, view: EngineView) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """``prompt`` or ``token_ids``, the media items and options, within the context: the
    prompt's token ids (media placeholders expanded) and the media spans in it."""
    name, value = _which(request, "input")
    if name == "prompt":
        if not value:
            raise _invalid("prompt is empty")
        prompt = [tok.BOS_ID, *tok.encode(value)]
    elif name == "token_ids":
        prompt = list(value.ids)
        if not prompt:
            raise _invalid("token_ids is empty")
        bad = next((t for t in prompt if t >= tok.VOCAB_SIZE), None)
        if bad is not None:
            raise _invalid(f"token id {bad} outside the vocabulary (size {tok.VOCAB_SIZE})")
    else:
        raise _invalid("one of prompt or token_ids is required")
    prompt, media = _media(request, prompt, view)
    _media_options(request, view)
    limit = view.config.max_context_length
    if len(prompt) >= limit:
        raise _invalid(f"prompt of {len(prompt)} tokens exceeds the context of {limit}")
    return prompt, media


def _check_sampling(s: pb.SamplingParams, spec: FlavorSpec) -> int:
    """The sampling ranges; returns the number of outputs."""
    if s.temperature is not None and s.temperature < 0:
        raise _invalid("temperature must be >= 0")
    if s.top_p is not None and not 0 < s.top_p <= 1:
        raise _invalid("top_p must be in (0, 1]")
    if s.top_k is not None and s.top_k < -1:
        raise _invalid("top_k must be -1, 0 or positive")
    if s.min_p is not None and not 0 <= s.min_p <= 1:
        raise _invalid("min_p must be in [0, 1]")
    for pname in ("frequency_penalty", "presence_penalty"):
        pv = getattr(s, pname)
        if pv is not None and not -2 <= pv <= 2:
            raise _invalid(f"{pname} must be in [-2, 2]")
    if s.repetition_penalty is not None and s.repetition_penalty <= 0:
        raise _invalid("repetition_penalty must be > 0")
    n = 1 if s.num_sequences is None else s.num_sequences
    if n < 1:
        raise _invalid("num_sequences must be > 0 when present")
    if n > spec.max_num_sequences:
        raise _invalid(f"num_sequences {n} exceeds max_num_sequences {spec.max_num_sequences}")
    return n


def _max_tokens(st: pb.StoppingOptions, cfg: EngineConfig, prompt_len: int) -> int:
    """``max_tokens`` (default: as many as fit); a prefill engine clamps instead of refusing."""
    room = cfg.max_context_length - prompt_len
    if st.max_tokens is None:
        return min(cfg.max_output_tokens, room)
    max_tokens = st.max_tokens
    if cfg.role != "prefill":
        if max_tokens < 1:
            raise _invalid("max_tokens must be >= 1")
        if max_tokens > cfg.max_output_tokens:
            raise _invalid(f"max_tokens {max_tokens} exceeds max_output_tokens {cfg.max_output_tokens}")
        if max_tokens > room:
            raise _invalid(
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the context "
                f"of {cfg.max_context_length}"
            )
    return max(1, min(max_tokens, room))


def _stop_conditions(st: pb.StoppingOptions) -> tuple[list[str], set[int]]:
    texts: list[str] = []
    ids: set[int] = set()
    for i, cond in enumerate(st.conditions):
        cname, cvalue = _which(cond, "condition")
        if cname == "stop_text":
            if not cvalue:
                raise _invalid(f"stopping.conditions[{i}]: empty stop_text")
            texts.append(cvalue)
        elif cname == "stop_token_id":
            if cvalue >= tok.VOCAB_SIZE:
                raise _invalid(f"stopping.conditions[{i}]: token id {cvalue} outside the vocabulary")
            ids.add(cvalue)
        else:
            raise _invalid(f"stopping.conditions[{i}]: no condition set")
    return texts, ids


def _check_stopping(
    st: pb.StoppingOptions, cfg: EngineConfig, spec: FlavorSpec, prompt_len: int
) -> gen.StopRules:
    """Token bounds and stop conditions, as the generator's stop rules."""
    max_tokens = _max_tokens(st, cfg, prompt_len)
    min_tokens = st.min_tokens or 0
    if min_tokens > max_tokens:
        raise _invalid(f"min_tokens {min_tokens} exceeds max_tokens {max_tokens}")
    texts, ids = _stop_conditions(st)
    if st.include_stop_in_output and not spec.supports_stop_in_output:
        raise _unsupported("include_stop_in_output is not supported")
    return gen.StopRules(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_texts=tuple(texts),
        stop_token_ids=frozenset(ids),
        ignore_eos=bool(st.ignore_eos),
        include_stop_in_output=bool(st.include_stop_in_output),
    )


def _check_response(
    r: pb.ResponseOptions, spec: FlavorSpec, prompt_len: int
) -> tuple[PromptLogprobs | None, gen.CandidateSpec | None]:
    """Logprob options: what the prompt's and the outputs' logprobs carry."""
    prompt_lp = None
    if r.return_prompt_logprobs:
        start = r.prompt_logprob_start or 0
        if start > prompt_len:
            raise _invalid(f"prompt_logprob_start {start} is beyond the prompt ({prompt_len} tokens)")
        prompt_lp = PromptLogprobs(start, _candidates(r.prompt_candidates, spec.prompt_logprobs, "prompt"))
    out_spec = None
    if r.return_output_logprobs:
        out_spec = _candidates(r.output_candidates, spec.output_logprobs, "output")
    return prompt_lp, out_spec


def _check_kv_options(kv: pb.KvOptions | None, spec: FlavorSpec) -> tuple[str, bool]:
    """``cache_salt`` and ``bypass_prefix_cache``, where the flavour supports them."""
    salt = ""
    bypass = False
    if kv is not None:
        if kv.cache_salt is not None and kv.cache_salt != "":
            if not spec.supports_cache_salt:
                raise _unsupported("cache_salt is not supported")
            salt = kv.cache_salt
        if kv.bypass_prefix_cache:
            if not spec.supports_prefix_cache_bypass:
                raise _unsupported("bypass_prefix_cache is not supported")
            bypass = True
    return salt, bypass

"""Dynamo's preprocessed request ↔ OpenEngine ``GenerateRequest``, engine events ↔ Dynamo chunks.

Pure functions (no Dynamo import), used by the worker plane's handler.

Request (Dynamo's ``PreprocessedRequest`` as a dict) → ``GenerateRequest`` + metadata:

==============================================  ===============================================
Dynamo                                          OpenEngine
==============================================  ===============================================
``model``                                       ``model`` (served name, alias or LoRA name)
``token_ids``                                   ``token_ids``
``sampling_options`` temperature, top_p,        ``sampling`` (same names; ``top_k`` ≤ 0 and
top_k, min_p, penalties, seed, n                ``n`` absent mean unset)
``sampling_options.guided_decoding``            ``guided`` (json → json_schema, regex, choice,
                                                grammar → ebnf_grammar, structural_tag, backend)
``sampling_options.include_stop_str_in_output`` ``stopping.include_stop_in_output``
``stop_conditions`` max_tokens, min_tokens,     ``stopping`` (stop strings → ``stop_text``; stop
ignore_eos, stop, stop_token_ids(_hidden,       token ids other than the EOS ids → ``stop_token_id``;
_visible)                                       EOS stays the engine's own rule)
``output_options.logprobs`` / ``prompt_logprobs``  ``response`` logprobs with ``top_n`` candidates
``routing.dp_rank`` / ``routing.priority``      ``openengine-target-dp-rank`` / ``openengine-priority``
``prefill_result.disaggregated_params``         ``kv.session`` (the prefill engine's
``["openengine_kv_session"]`` (base64)          ``KvSessionRef`` bytes, forwarded byte for byte)
``bootstrap_info`` (host, port, room)           ``kv.session.bootstrap`` (client-bootstrap engines)
``multi_modal_data`` (+ ``extra_args`` order    ``media`` in prompt order, each with modality,
and routing hashes), ``mm_processor_kwargs``    source and uuid; ``media_options`` (``media.py``)
==============================================  ===============================================

Events → chunks (``{"token_ids": [...], "index": i, ...}``): ``TokenOutput`` → token ids
(+ ``log_probs`` / ``top_logprobs``); ``GenerationFinished`` → ``finish_reason``
(``stop``/``length``/``cancelled``) + ``completion_usage`` on the last; ``PrefillReady`` →
``disaggregated_params`` carrying the engine's ``KvSessionRef`` bytes (base64, opaque) +
usage; ``PromptOutput`` and ``EngineError`` produce no chunk (an engine error ends the
stream with an error raised to Dynamo, see :func:`error_kind`).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.core.card import ROLE_DECODE, ROLE_PREFILL, MultimodalCard, WorkerCard
from sidecar.core.errors import Rejection, invalid_argument
from sidecar.core.handoff import parse_kv_session
from sidecar.core.lifecycle import CANCELLED, FAILED, Outcome
from sidecar.core.metadata import PRIORITY, TARGET_DP_RANK
from sidecar.dynamo.media import media_request
from sidecar.openengine import pb

__all__ = [
    "KV_SESSION_KEY",
    "ChunkMerger",
    "DynamoRequest",
    "chunk_of",
    "error_kind",
    "prefill_result_of",
    "to_generate_request",
]

#: Key of the engine's ``KvSessionRef`` (base64 of its protobuf bytes) in ``disaggregated_params``.
KV_SESSION_KEY = "openengine_kv_session"

_FINISH = {
    pb.FinishReason.STOP: "stop",
    pb.FinishReason.LENGTH: "length",
    pb.FinishReason.CANCELLED: "cancelled",
}
_SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_MAX_U32 = 2**32 - 1


class DynamoRequest:
    """A mapped request: what to admit, and the prefill's session bytes the engine gets verbatim
    (``Sidecar.admit(..., kv_session_bytes=)``)."""

    __slots__ = ("kv_session_bytes", "metadata", "request")

    def __init__(
        self, request: pb.GenerateRequest, metadata: dict[str, str], kv_session_bytes: bytes | None
    ) -> None:
        self.request = request
        self.metadata = metadata
        self.kv_session_bytes = kv_session_bytes


def _dict(value: Any, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        invalid_argument(f"{what} must be an object")
    return value


def _uint(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_U32:
        invalid_argument(f"{what} must be an unsigned 32-bit integer, got {value!r}")
    return value


def _token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_U32 for t in value
    ):
        invalid_argument(f"{what} must be a list of token ids")
    return value


def _sampling(opts: Mapping[str, Any]) -> pb.SamplingParams | None:
    fields: dict[str, Any] = {}
    for name in _SAMPLING_FLOATS:
        v = opts.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                invalid_argument(f"sampling_options.{name} must be a number")
            fields[name] = float(v)
    top_k = opts.get("top_k")
    if top_k is not None and top_k > 0:
        fields["top_k"] = int(top_k)
    seed = opts.get("seed")
    if seed is not None:
        fields["seed"] = int(seed) & (2**64 - 1)
    n = _uint(opts.get("n"), "sampling_options.n")
    if n is not None:
        fields["num_sequences"] = n
    return pb.SamplingParams(**fields) if fields else None


def _guided(opts: Mapping[str, Any]) -> pb.GuidedDecoding | None:
    g = _dict(opts.get("guided_decoding"), "sampling_options.guided_decoding")
    if not g:
        return None
    backend = g.get("backend") or ""
    if g.get("json") is not None:
        schema = g["json"]
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return pb.GuidedDecoding(json_schema=text, backend=backend)
    if g.get("regex") is not None:
        return pb.GuidedDecoding(regex=str(g["regex"]), backend=backend)
    if g.get("choice") is not None:
        return pb.GuidedDecoding(
            choice=pb.ChoiceConstraint(choices=[str(c) for c in g["choice"]]), backend=backend
        )
    if g.get("grammar") is not None:
        return pb.GuidedDecoding(ebnf_grammar=str(g["grammar"]), backend=backend)
    if g.get("structural_tag") is not None:
        tag = g["structural_tag"]
        text = tag if isinstance(tag, str) else json.dumps(tag)
        return pb.GuidedDecoding(structural_tag=text, backend=backend)
    return None


def _stopping(
    stop: Mapping[str, Any], sampling: Mapping[str, Any], eos: set[int]
) -> pb.StoppingOptions | None:
    conditions: list[pb.StopCondition] = []
    texts = stop.get("stop") or []
    if isinstance(texts, str):
        texts = [texts]
    for text in texts:
        if not isinstance(text, str):
            invalid_argument("stop_conditions.stop must be strings")
        conditions.append(pb.StopCondition(stop_text=text))
    seen: set[int] = set()
    for key in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        for tid in _token_ids(stop.get(key) or [], f"stop_conditions.{key}"):
            if tid not in eos and tid not in seen:
                seen.add(tid)
                conditions.append(pb.StopCondition(stop_token_id=tid))
    fields: dict[str, Any] = {}
    max_tokens = _uint(stop.get("max_tokens"), "stop_conditions.max_tokens")
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    min_tokens = _uint(stop.get("min_tokens"), "stop_conditions.min_tokens")
    if min_tokens:
        fields["min_tokens"] = min_tokens
    if stop.get("ignore_eos") is not None:
        fields["ignore_eos"] = bool(stop["ignore_eos"])
    if sampling.get("include_stop_str_in_output"):
        fields["include_stop_in_output"] = True
    if conditions:
        fields["conditions"] = conditions
    return pb.StoppingOptions(**fields) if fields else None


def _response(out: Mapping[str, Any]) -> pb.ResponseOptions | None:
    fields: dict[str, Any] = {}
    k = out.get("logprobs")
    if k is not None and k is not False:
        fields["return_output_logprobs"] = True
        if int(k) > 0:
            fields["output_candidates"] = pb.CandidateTokenSelection(top_n=int(k))
    pk = out.get("prompt_logprobs")
    if pk is not None and pk is not False:
        fields["return_prompt_logprobs"] = True
        if int(pk) > 0:
            fields["prompt_candidates"] = pb.CandidateTokenSelection(top_n=int(pk))
    return pb.ResponseOptions(**fields) if fields else None


def _session_bytes(prefill_result: Any) -> bytes | None:
    result = _dict(prefill_result, "prefill_result")
    params = _dict(result.get("disaggregated_params"), "prefill_result.disaggregated_params")
    encoded = params.get(KV_SESSION_KEY)
    if encoded is None:
        return None
    if not isinstance(encoded, str):
        invalid_argument(f"disaggregated_params.{KV_SESSION_KEY} must be a base64 string")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        invalid_argument(f"disaggregated_params.{KV_SESSION_KEY} is not base64")


def _bootstrap_session(info: Any, card: WorkerCard, dp_rank: int | None) -> pb.KvSessionRef | None:
    boot = _dict(info, "bootstrap_info")
    if not boot:
        return None
    host, port, room = boot.get("bootstrap_host"), boot.get("bootstrap_port"), boot.get("bootstrap_room")
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int):
        invalid_argument("bootstrap_info needs bootstrap_host, bootstrap_port and bootstrap_room")
    kv = card.kv_connector
    return pb.KvSessionRef(
        transfer_backend=kv.transfer_backend if kv else "",
        handoff_profile=kv.handoff_profile if kv else "",
        dp_rank=dp_rank if dp_rank is not None else (card.dp_ranks[0] if card.dp_ranks else 0),
        bootstrap=pb.KvBootstrap(endpoint=pb.KvEndpoint(host=host, port=port), room_id=room & (2**64 - 1)),
    )


def _multimodal(card: WorkerCard, model: str) -> MultimodalCard | None:
    """The multimodal capabilities of the model a request names (``None``: unknown or none)."""
    if model:
        resolved = card.resolve(model)
        return resolved.model.multimodal if resolved is not None else None
    return card.models[0].multimodal if len(card.models) == 1 else None


def to_generate_request(
    request: Mapping[str, Any],
    card: WorkerCard,
    *,
    request_id: str = "",
    trace_headers: Mapping[str, str] | None = None,
) -> DynamoRequest:
    """Map one Dynamo request (see the module doc); raises :class:`Rejection` (INVALID_ARGUMENT)."""
    if not isinstance(request, Mapping):
        invalid_argument("the Dynamo request must be an object")
    tokens = _token_ids(request.get("token_ids"), "token_ids")
    sampling_opts = _dict(request.get("sampling_options"), "sampling_options")
    stop_opts = _dict(request.get("stop_conditions"), "stop_conditions")
    out_opts = _dict(request.get("output_options"), "output_options")
    routing = _dict(request.get("routing"), "routing")
    eos = set(_token_ids(request.get("eos_token_ids") or [], "eos_token_ids"))
    model = request.get("model") or ""
    if not isinstance(model, str):
        invalid_argument("model must be a string")
    media, media_options = media_request(request, _multimodal(card, model))
    req = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=pb.TokenIds(ids=list(tokens)),
        sampling=_sampling(sampling_opts),
        stopping=_stopping(stop_opts, sampling_opts, eos),
        response=_response(out_opts),
        guided=_guided(sampling_opts),
        media=media,
        media_options=media_options,
    )
    metadata: dict[str, str] = {}
    dp_rank = routing.get("dp_rank")
    if not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or dp_rank not in card.dp_ranks:
        dp_rank = None
    priority = routing.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool) and priority != 0:
        metadata[PRIORITY] = str(priority)
    for key in ("traceparent", "tracestate"):
        value = (trace_headers or {}).get(key)
        if value:
            metadata[key] = value
    session_bytes = None
    if card.role == ROLE_DECODE:
        session_bytes = _session_bytes(request.get("prefill_result"))
    if session_bytes is not None:
        try:
            session = parse_kv_session(session_bytes)
        except ValueError as err:
            raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, f"the prefill's KV session: {err}") from None
        req.kv = pb.KvOptions(session=session)
    elif card.role in (ROLE_PREFILL, ROLE_DECODE) and request.get("bootstrap_info"):
        boot = _bootstrap_session(request.get("bootstrap_info"), card, dp_rank)
        if boot is not None:
            req.kv = pb.KvOptions(session=boot)
            dp_rank = None  # the session's dp_rank is authoritative
    if dp_rank is not None and req.kv is None:
        metadata[TARGET_DP_RANK] = str(dp_rank)
    return DynamoRequest(req, metadata, session_bytes)


# --------------------------------------------------------------------------- engine → Dynamo


def _usage(u: pb.Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    if u.cached_prompt_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return out


def _logprobs(tokens: Sequence[pb.TokenInfo]) -> tuple[list[float], list[list[dict[str, Any]]]] | None:
    if not tokens or tokens[0].logprob is None:
        return None
    log_probs = [t.logprob if t.logprob is not None else 0.0 for t in tokens]
    top = [
        [
            {
                "rank": c.rank if c.rank is not None else r + 1,
                "token_id": c.token_id,
                "token": c.token,
                "logprob": c.logprob,
            }
            for r, c in enumerate(t.candidates)
        ]
        for t in tokens
    ]
    return log_probs, top


def chunk_of(ev: pb.GenerateResponse, kv_session_bytes: bytes | None = None) -> dict[str, Any] | None:
    """The Dynamo chunk relaying one engine event (``None``: nothing to relay);
    ``kv_session_bytes``: a ``PrefillReady``'s session as the engine sent it
    (``StreamHandle.kv_session_bytes``; without it, the parsed session re-serialised)."""
    token = ev.token
    if token is not None:
        tokens = token.tokens
        chunk: dict[str, Any] = {"token_ids": [t.token_id for t in tokens], "index": token.output_index or 0}
        lp = _logprobs(tokens)
        if lp is not None:
            chunk["log_probs"], chunk["top_logprobs"] = lp
        if ev.usage is not None:
            chunk["completion_usage"] = _usage(ev.usage)
        return chunk
    finished = ev.finished
    if finished is not None:
        chunk = {
            "token_ids": [],
            "index": finished.output_index or 0,
            "finish_reason": _FINISH.get(finished.reason, "stop"),
        }
        if ev.usage is not None:
            chunk["completion_usage"] = _usage(ev.usage)
        return chunk
    ready = ev.prefill_ready
    if ready is not None:
        raw = kv_session_bytes
        if raw is None:
            raw = bytes(ready.kv_session) if ready.kv_session is not None else b""
        chunk = {
            "token_ids": [],
            "index": 0,
            "disaggregated_params": {KV_SESSION_KEY: base64.b64encode(raw).decode("ascii")},
        }
        if ev.usage is not None:
            chunk["completion_usage"] = _usage(ev.usage)
        return chunk
    return None


def prefill_result_of(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """What Dynamo's prefill router forwards to the decode worker for a prefill chunk (tests)."""
    return {"disaggregated_params": dict(chunk.get("disaggregated_params") or {})}


class ChunkMerger:
    """Coalesces queued chunks of one output into one (fewer Dynamo round trips per token).

    ``merge(a, b)`` folds ``b`` into ``a`` and returns True when both relay the same output,
    ``a`` is not final (no finish reason, no handoff) and both carry logprobs or neither does.
    """

    @staticmethod
    def merge(a: dict[str, Any], b: dict[str, Any]) -> bool:
        if (
            a.get("index") != b.get("index")
            or "finish_reason" in a
            or "disaggregated_params" in a
            or "disaggregated_params" in b
            or ("log_probs" in a) != ("log_probs" in b)
            or "completion_usage" in a
        ):
            return False
        a["token_ids"].extend(b["token_ids"])
        if "log_probs" in b:
            a["log_probs"].extend(b["log_probs"])
            a["top_logprobs"].extend(b["top_logprobs"])
        for key in ("finish_reason", "completion_usage"):
            if key in b:
                a[key] = b[key]
        return True


# --------------------------------------------------------------------------- outcomes

#: How a stream that did not complete is reported to Dynamo: the exception class name in
#: ``dynamo.llm.exceptions`` (``None``: end the stream quietly).
_CLIENT_CODES = {
    pb.ErrorCode.INVALID_ARGUMENT,
    pb.ErrorCode.MODEL_NOT_FOUND,
    pb.ErrorCode.UNSUPPORTED_FEATURE,
    pb.ErrorCode.ROLE_MISMATCH,
    pb.ErrorCode.DUPLICATE_REQUEST,
}


def error_kind(outcome: Outcome, *, dynamo_cancelled: bool) -> str | None:
    """Name of the ``dynamo.llm.exceptions`` class to raise for ``outcome`` (``None``: none).

    Client-side errors → ``InvalidArgument`` (HTTP 400); draining, overload and other
    retryable failures → ``EngineShutdown`` / ``Disconnected`` so Dynamo can retry elsewhere;
    a stream Dynamo itself stopped ends quietly.
    """
    if outcome.code is None:
        return None
    if outcome.kind == CANCELLED and dynamo_cancelled:
        return None
    if outcome.code in _CLIENT_CODES:
        return "InvalidArgument"
    if outcome.code in (pb.ErrorCode.DRAINING, pb.ErrorCode.OVERLOADED):
        return "EngineShutdown"
    if outcome.kind == CANCELLED:
        return "Cancelled"
    if outcome.kind == FAILED and outcome.retryable:
        return "Disconnected"
    return "Unknown"

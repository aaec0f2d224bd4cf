"""Dynamo's preprocessed request ↔ OpenEngine ``GenerateRequest``, engine events ↔ Dynamo chunks.

Pure functions (no Dynamo import), used by the worker plane's handler. The option conversions
are ``sidecar.core.request_options``'s, shared with the OpenAI front.

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
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.core.card import ROLE_DECODE, ROLE_PREFILL, WorkerCard
from sidecar.core.errors import Rejection, invalid_argument
from sidecar.core.handoff import parse_kv_session
from sidecar.core.lifecycle import CANCELLED, FAILED, Outcome
from sidecar.core.metadata import PRIORITY, TARGET_DP_RANK
from sidecar.core.request_options import (
    CLIENT_CODES,
    guided_decoding,
    model_multimodal,
    response_options,
    sampling_params,
    stopping_options,
    token_id_list,
    trace_metadata,
    usage_dict,
)
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
    tokens = token_id_list(request.get("token_ids"), "token_ids")
    sampling_opts = _dict(request.get("sampling_options"), "sampling_options")
    stop_opts = _dict(request.get("stop_conditions"), "stop_conditions")
    out_opts = _dict(request.get("output_options"), "output_options")
    routing = _dict(request.get("routing"), "routing")
    eos = frozenset(token_id_list(request.get("eos_token_ids") or [], "eos_token_ids"))
    model = request.get("model") or ""
    if not isinstance(model, str):
        invalid_argument("model must be a string")
    media, media_options = media_request(request, model_multimodal(card, model))
    req = pb.GenerateRequest(
        request_id=request_id,
        model=model,
        token_ids=pb.TokenIds(ids=list(tokens)),
        sampling=sampling_params(sampling_opts, "sampling_options."),
        stopping=stopping_options(
            stop_opts,
            include_stop=bool(sampling_opts.get("include_stop_str_in_output")),
            eos=eos,
            prefix="stop_conditions.",
        ),
        response=response_options(out_opts.get("logprobs"), out_opts.get("prompt_logprobs")),
        guided=guided_decoding(
            _dict(sampling_opts.get("guided_decoding"), "sampling_options.guided_decoding")
        ),
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
    metadata.update(trace_metadata(trace_headers))
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
            chunk["completion_usage"] = usage_dict(ev.usage)
        return chunk
    finished = ev.finished
    if finished is not None:
        chunk = {
            "token_ids": [],
            "index": finished.output_index or 0,
            "finish_reason": _FINISH.get(finished.reason, "stop"),
        }
        if ev.usage is not None:
            chunk["completion_usage"] = usage_dict(ev.usage)
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
            chunk["completion_usage"] = usage_dict(ev.usage)
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
    if outcome.code in CLIENT_CODES:
        return "InvalidArgument"
    if outcome.code in (pb.ErrorCode.DRAINING, pb.ErrorCode.OVERLOADED):
        return "EngineShutdown"
    if outcome.kind == CANCELLED:
        return "Cancelled"
    if outcome.kind == FAILED and outcome.retryable:
        return "Disconnected"
    return "Unknown"

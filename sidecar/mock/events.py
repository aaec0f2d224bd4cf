"""Builders of the Generate stream's responses, including fast mode's pre-encoded ones.

Fast mode sends a token event as ``request_id`` field bytes (encoded once per request)
followed by the ``token`` field bytes (encoded once per (output, token id, text) and
cached) — protobuf fields concatenate, so the bytes equal ``bytes(GenerateResponse)``
exactly and the client cannot tell the difference.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.mock import tokenizer as tok
from sidecar.mock.generator import Finish, Step, TokenScore
from sidecar.openengine import pb
from sidecar.openengine.schema.protobuf_wire import length_delimited
from sidecar.openengine.serving.grpc_server import PreEncoded

_REASONS = {
    "stop": pb.FinishReason.STOP,
    "length": pb.FinishReason.LENGTH,
    "cancelled": pb.FinishReason.CANCELLED,
}
_FAST_CACHE_LIMIT = 200_000
_fast_cache: dict[tuple[int, int, str], bytes] = {}


def usage(prompt: int, completion: int, cached: int | None) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_prompt_tokens=cached,
    )


def token_info(token_id: int, score: TokenScore | None) -> pb.TokenInfo:
    info = pb.TokenInfo(token_id=token_id, token=tok.token_text(token_id))
    if score is not None:
        info.logprob = score.logprob
        info.rank = score.rank
        info.candidates = [
            pb.LogProb(token_id=c.token_id, logprob=c.logprob, token=tok.token_text(c.token_id), rank=c.rank)
            for c in score.candidates
        ]
    return info


def token_event(request_id: str, index: int, step: Step) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        token=pb.TokenOutput(
            output_index=index, tokens=[token_info(step.token_id, step.score)], text=step.text
        ),
    )


class FastTokens:
    """Pre-encoded token events of one request (fast mode)."""

    __slots__ = ("_prefix", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._prefix = bytes(pb.GenerateResponse(request_id=request_id))

    def event(self, index: int, step: Step) -> PreEncoded:
        key = (index, step.token_id, step.text)
        body = _fast_cache.get(key)
        if body is None:
            body = bytes(
                pb.GenerateResponse(
                    token=pb.TokenOutput(
                        output_index=index,
                        tokens=[pb.TokenInfo(token_id=step.token_id, token=tok.token_text(step.token_id))],
                        text=step.text,
                    )
                )
            )
            if len(_fast_cache) < _FAST_CACHE_LIMIT:
                _fast_cache[key] = body
        return PreEncoded(self._prefix + body)


def finished_event(
    request_id: str, index: int, finish: Finish | None, use: pb.Usage | None, message: str = ""
) -> pb.GenerationFinished | pb.GenerateResponse:
    """``GenerationFinished`` (``finish`` None = cancelled) with ``stop_match`` for STOP."""
    reason = "cancelled" if finish is None else finish.reason
    done = pb.GenerationFinished(output_index=index, reason=_REASONS[reason], message=message)
    if finish is not None and finish.reason == "stop":
        if finish.eos_token_id is not None:
            done.stop_match = pb.StopMatch(eos_token_id=finish.eos_token_id)
        elif finish.stop_token_id is not None:
            done.stop_match = pb.StopMatch(stop_token_id=finish.stop_token_id)
        elif finish.stop_text is not None:
            done.stop_match = pb.StopMatch(stop_text=finish.stop_text)
    return pb.GenerateResponse(request_id=request_id, finished=done, usage=use)


def prompt_event(request_id: str, scores: Sequence[tuple[int, TokenScore | None]]) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, prompt=pb.PromptOutput(tokens=[token_info(t, s) for t, s in scores])
    )


def error_event(
    request_id: str, code: pb.ErrorCode, message: str, *, retryable: bool, use: pb.Usage | None
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        error=pb.EngineError(code=code, message=message, retryable=retryable),
        usage=use,
    )


def prefill_ready_event(
    request_id: str, session: pb.KvSessionRef, use: pb.Usage | None
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, prefill_ready=pb.PrefillReady(kv_session=session), usage=use
    )


#: The highest field number protobuf allows: unknown to every message (fault ``oversized-answer``).
PAD_FIELD = (1 << 29) - 1


def padded(message: object, size: int) -> PreEncoded:
    """``message`` serialized with an unknown field that makes it about ``size`` bytes long
    (a parser skips it; a bound on the message's size does not)."""
    data = bytes(message)  # type: ignore[call-overload]
    filler = max(0, size - len(data) - 10)
    return PreEncoded(data + length_delimited(PAD_FIELD, bytes(filler)))

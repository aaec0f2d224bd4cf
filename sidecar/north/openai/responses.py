"""Engine events → OpenAI response bodies and SSE chunks (pure; one :class:`ResponseBuilder`
per request).

Each output (``output_index``) is one choice. A ``TokenOutput`` adds its ``text`` to its choice
(and its tokens' logprobs: Completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``, Chat's ``content`` entries with ``bytes``); a ``GenerationFinished`` sets its
``finish_reason`` (``stop``, ``length``, or ``abort`` for an output the engine cancelled) and,
like vLLM, ``stop_reason`` (the stop string or token id that matched; ``null`` for EOS). The
last event's ``Usage`` is the response's ``usage``.

Streaming, every event becomes at most one chunk (``data: {...}``); a chat stream opens each
choice with ``{"role": "assistant", "content": ""}`` first. With
``stream_options.include_usage`` a last chunk with no choices carries the usage; then
``data: [DONE]``. Not streaming, the choices are built once the stream has completed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

import msgspec

from sidecar.core.request_options import usage_dict
from sidecar.json_types import JSONObject
from sidecar.openengine import pb

__all__ = [
    "DONE",
    "ChatLogprobs",
    "ChatTokenLogprob",
    "Choice",
    "CompletionLogprobs",
    "ResponseBody",
    "ResponseBuilder",
    "sse",
]

DONE = b"data: [DONE]\n\n"
FINISH_REASONS = {
    pb.FinishReason.STOP: "stop",
    pb.FinishReason.LENGTH: "length",
    pb.FinishReason.CANCELLED: "abort",
}
_encode = msgspec.json.Encoder().encode


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    """One token of Chat's ``logprobs.content`` (``logprob`` -9999.0 when the engine gave none)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Delta(TypedDict, total=False):
    role: str
    content: str


class Message(TypedDict):
    role: str
    content: str


class Choice(TypedDict):
    """One choice of a body or chunk: Chat's carries ``delta`` (streamed) or ``message``,
    Completions' ``text``; ``stop_reason`` is absent from a chat chunk that finishes nothing."""

    index: int
    delta: NotRequired[Delta]
    message: NotRequired[Message]
    text: NotRequired[str]
    logprobs: ChatLogprobs | CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: NotRequired[str | int | None]


class ResponseBody(TypedDict):
    """A whole response, or one streamed chunk (``usage``: the whole one's, or the last chunk's)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: NotRequired[JSONObject]


def sse(body: Mapping[str, object]) -> bytes:
    """One SSE event carrying the JSON object ``body``."""
    return b"data: " + _encode(body) + b"\n\n"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0


def _stop_reason(match: pb.StopMatch | None) -> str | int | None:
    if match is None:
        return None
    if match.stop_text is not None:
        return match.stop_text
    if match.stop_token_id is not None:
        return match.stop_token_id
    return None


class ResponseBuilder:
    """Builds one request's response: ``chat`` or not; ``logprobs`` asked; ``stream`` (chunks
    as events come; otherwise the text is kept for :meth:`body`)."""

    def __init__(
        self, *, chat: bool, request_id: str, model: str, n: int, logprobs: bool, stream: bool
    ) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.stream = stream
        self.choices = [_Choice() for _ in range(n)]
        self.usage: pb.Usage | None = None
        self._opened = False
        self._object = "chat.completion.chunk" if chat else "text_completion"

    def _choice(self, index: int | None) -> _Choice:
        i = index or 0
        while i >= len(self.choices):  # an engine sending more outputs than asked: kept anyway
            self.choices.append(_Choice())
        return self.choices[i]

    def _chunk(self, choices: list[Choice]) -> ResponseBody:
        return {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def opening(self) -> list[bytes]:
        """The chunks a chat stream starts with (each choice's role), once."""
        if not self.chat or self._opened:
            return []
        self._opened = True
        return [
            sse(
                self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
            for i in range(len(self.choices))
        ]

    # -- events ----------------------------------------------------------------------------

    def _logprobs(self, choice: _Choice, tokens: list[pb.TokenInfo]) -> ChatLogprobs | CompletionLogprobs:
        if self.chat:
            content: list[ChatTokenLogprob] = [
                {
                    "token": t.token,
                    "logprob": t.logprob if t.logprob is not None else -9999.0,
                    "bytes": list(t.token.encode()),
                    "top_logprobs": [
                        {"token": c.token, "logprob": c.logprob, "bytes": list(c.token.encode())}
                        for c in t.candidates
                    ],
                }
                for t in tokens
            ]
            if not self.stream:
                choice.logprobs += content
            return {"content": content}
        out: CompletionLogprobs = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for t in tokens:
            out["tokens"].append(t.token)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({c.token: c.logprob for c in t.candidates} or None)
            out["text_offset"].append(choice.offset)
            choice.offset += len(t.token)
        if not self.stream:
            choice.tokens += out["tokens"]
            choice.token_logprobs += out["token_logprobs"]
            choice.top_logprobs += out["top_logprobs"]
            choice.text_offset += out["text_offset"]
        return out

    def event(self, ev: pb.GenerateResponse) -> bytes | None:
        """Account one engine event; streaming, its SSE chunk (``None``: nothing to send)."""
        if ev.usage is not None:
            self.usage = ev.usage
        token = ev.token
        if token is not None:
            index = token.output_index or 0
            choice = self._choice(index)
            lp = self._logprobs(choice, token.tokens) if self.logprobs else None
            if not self.stream:
                choice.text.append(token.text)
                return None
            if self.chat:
                return sse(
                    self._chunk(
                        [
                            {
                                "index": index,
                                "delta": {"content": token.text},
                                "logprobs": lp,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            return sse(
                self._chunk(
                    [
                        {
                            "index": index,
                            "text": token.text,
                            "logprobs": lp,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    ]
                )
            )
        finished = ev.finished
        if finished is not None:
            index = finished.output_index or 0
            choice = self._choice(index)
            choice.finish_reason = FINISH_REASONS.get(finished.reason, "stop")
            choice.stop_reason = _stop_reason(finished.stop_match)
            if not self.stream:
                return None
            body: Choice
            if self.chat:
                body = {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}
            else:
                body = {"index": index, "text": "", "logprobs": None, "finish_reason": choice.finish_reason}
            body["stop_reason"] = choice.stop_reason
            return sse(self._chunk([body]))
        return None

    # -- ends ------------------------------------------------------------------------------

    def usage_body(self) -> JSONObject:
        if self.usage is None:
            return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return usage_dict(self.usage)

    def usage_chunk(self) -> bytes:
        """The streamed usage (``stream_options.include_usage``): a chunk with no choices."""
        chunk = self._chunk([])
        chunk["usage"] = self.usage_body()
        return sse(chunk)

    def body(self) -> ResponseBody:
        """The whole (not streamed) response."""
        choices: list[Choice] = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lp: ChatLogprobs | CompletionLogprobs | None
            if self.chat:
                lp = {"content": c.logprobs} if self.logprobs else None
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
                continue
            lp = (
                {
                    "tokens": c.tokens,
                    "token_logprobs": c.token_logprobs,
                    "top_logprobs": c.top_logprobs,
                    "text_offset": c.text_offset,
                }
                if self.logprobs
                else None
            )
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage_body(),
        }
